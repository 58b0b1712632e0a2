"""The interpreter instrumentation counts exactly the bytes a tiny hand-analysed kernel moves."""

import pytest
import torch
import triton
import triton.language as tl

from traffic import count_traffic
from traffic.counter import OTHER


@triton.jit
def _gather_scale_kernel(
    out_ptr,  # [n]
    x_ptr,  # [size]
    index_ptr,  # [n] positions of x to read
    scale_ptr,  # [1]
    counter_ptr,  # [1] int32, incremented once per program
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    idx = tl.load(index_ptr + offs, mask=mask, other=0)
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr).to(tl.float32)
    tl.store(out_ptr + offs, (x * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.atomic_add(counter_ptr, 1)


def _launch(x, index, scale, counter, out, block):
    n = index.numel()
    _gather_scale_kernel[(triton.cdiv(n, block),)](out_ptr=out, x_ptr=x, index_ptr=index, scale_ptr=scale,
                                                   counter_ptr=counter, n=n, BLOCK=block)


def test_counts_unmasked_bytes_per_argument():
    x = torch.arange(50, dtype=torch.float16)
    index = torch.tensor([3, 3, 7, 1, 3, 9, 0, 49, 7, 2], dtype=torch.int64)  # 10 reads of 7 distinct elements
    scale = torch.tensor([2.0], dtype=torch.float32)
    counter = torch.zeros(1, dtype=torch.int32)
    out = torch.empty(10, dtype=torch.float16)
    with count_traffic(tensors={"x": x}, track_unique=("x",)) as t:
        _launch(x, index, scale, counter, out, block=4)  # 3 programs, the last with 2 of 4 lanes masked off
    torch.testing.assert_close(out, x[index] * 2)
    assert t.num_launches == 1 and t.launches[0].programs == 3
    assert t.launches[0].kernel == "_gather_scale_kernel"
    loaded = t.by_label("loaded")
    # Caller names win over parameter names; masked lanes move nothing; a scalar load is one element per program.
    assert loaded == {"x": 10 * 2, "index_ptr": 10 * 8, "scale_ptr": 3 * 4}
    assert t.by_label("stored") == {"out_ptr": 10 * 2}
    assert t.by_label("atomic") == {"counter_ptr": 3 * 4}
    assert t.unique_loaded("x") == 7 * 2
    assert t.loaded("x", "scale_ptr") == 20 + 12 and t.loaded() == 20 + 80 + 12


def test_views_of_one_buffer_and_unknown_addresses():
    # K and V as two halves of one buffer (as an engine's KV cache may be): each view gets its own name.
    kv = torch.arange(64, dtype=torch.float32).view(2, 32)
    index = torch.arange(8, dtype=torch.int32) * 4
    scale, counter, out = torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.empty(8)
    with count_traffic(tensors={"k": kv[0], "v": kv[1]}) as t:
        _launch(kv[1], index, scale, counter, out, block=8)
        _launch(kv[0], index[:2], scale, counter, out[:2], block=8)
    assert t.num_launches == 2
    assert t.launches[0].loaded["v"] == 8 * 4 and "k" not in t.launches[0].loaded
    assert t.launches[1].loaded["k"] == 2 * 4 and "v" not in t.launches[1].loaded
    # An index past the view reads memory no argument covers: counted, but as OTHER.
    index_out = torch.tensor([0, 40], dtype=torch.int32)
    with count_traffic() as t:
        _launch(kv[0], index_out, scale, counter, out[:2], block=2)
    assert t.by_label("loaded")[OTHER] == 4 and t.by_label("loaded")["x_ptr"] == 4


def test_restores_the_interpreter():
    from triton.runtime import interpreter as interp

    before = (interp.GridExecutor.__call__, "create_masked_load" in vars(interp.interpreter_builder))
    with pytest.raises(ZeroDivisionError):
        with count_traffic():
            1 / 0
    assert (interp.GridExecutor.__call__, "create_masked_load" in vars(interp.interpreter_builder)) == before
    x, out = torch.ones(4), torch.empty(4)
    _launch(x, torch.arange(4), torch.ones(1), torch.zeros(1, dtype=torch.int32), out, block=4)
    with count_traffic() as t:  # nothing leaked from the launch outside the block
        pass
    assert t.num_launches == 0 and t.loaded() == 0
