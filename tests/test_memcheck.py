"""The interpreter's bounds check (tests/memcheck.py), which tests/conftest.py puts around every test: a stray load,
store or compare-and-swap fails before it touches memory; masked-off lanes may point anywhere."""

import os

import pytest
import torch
import triton
import triton.language as tl

from tests.memcheck import OutOfBounds

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="checks the interpreter only")


@triton.jit
def _copy(dst_ptr,  # [n] fp32
          src_ptr,  # [n] fp32
          n, extra, USE_MASK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if USE_MASK:
        x = tl.load(src_ptr + offs, mask=offs < n, other=0.0)
        tl.store(dst_ptr + offs + extra, x, mask=offs + extra < n)
    else:
        tl.store(dst_ptr + offs + extra, tl.load(src_ptr + offs))


@triton.jit
def _cas(counter_ptr,  # [1] int32
         offset):
    offs = tl.arange(0, 4)
    tl.atomic_cas(counter_ptr + tl.where(offs == 0, 0, offset), tl.full([4], -1, tl.int32), tl.zeros([4], tl.int32))


def _cause(exc_info) -> str:
    """The interpreter wraps a kernel's exception in its own: the text of the whole chain."""
    return repr(exc_info.value) + repr(exc_info.value.__cause__)


def test_masked_lanes_past_the_end_pass_and_the_copy_is_right():
    src, dst = torch.arange(5, dtype=torch.float32), torch.zeros(5)
    _copy[(1,)](dst, src, 5, 0, USE_MASK=True, BLOCK=8)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("kind, src_len, extra", [("load", 5, 0), ("store", 8, 3)])
def test_an_unmasked_access_past_the_end_fails_before_it_writes(kind, src_len, extra):
    src, dst = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    _copy[(1,)](dst, src, 8, 0, USE_MASK=False, BLOCK=8)  # the same kernel, in bounds
    assert torch.equal(dst, src)
    dst.zero_()
    with pytest.raises(Exception) as exc_info:
        _copy[(1,)](dst, src[:src_len].clone(), 8, extra, USE_MASK=False, BLOCK=8)
    assert OutOfBounds.__name__ in _cause(exc_info) and f"{kind} of" in _cause(exc_info)
    assert not dst.any()  # no lane was stored, not even the ones in bounds


def test_an_unmasked_compare_and_swap_past_the_end_fails():
    counter = torch.zeros(1, dtype=torch.int32)
    _cas[(1,)](counter, 0)
    with pytest.raises(Exception) as exc_info:
        _cas[(1,)](counter, 1)
    assert OutOfBounds.__name__ in _cause(exc_info) and "atomic_cas of 3 active lane(s)" in _cause(exc_info)
    assert counter.item() == 0
