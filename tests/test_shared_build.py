"""Which build of the shared class a plan takes (prefixattn/autotune/builds.py: the one decision, in Plan.stats) and
how its launch is assembled (launcher.with_hopper_shared, a PreparedLaunch class with its own build and the global
scratch it lends). The Hopper build itself is Gluon, which has no interpreter: here its launches go to a recording
stand-in; tests/tuning/test_hopper_shared_build.py compiles it."""

from __future__ import annotations

import pytest
import torch

from prefixattn import attention, launcher, plan, prefix_attention
from prefixattn.autotune import builds
from prefixattn.autotune.builds import (HOPPER, HOPPER_STAGES, PORTABLE, asking_for, hopper_num_warps,
                                       hopper_shared_refusal, shared_build)
from prefixattn.kernels import hopper_shared_kernel as hopper_module
from prefixattn.kernels.layout import CLASS_SHARED
from prefixattn.planner import plans
from tests.prefix_batches import make_batch

SERVED = dict(is_hip=False, arch=90, dtype="bf16", kv_dtype=None, head_dim=128, v_head_dim=None, block_size=16,
              block_m=128, block_n=64)


def test_the_portable_build_is_the_default():
    b = _batch(torch.bfloat16)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always")
    assert p.shared_build == PORTABLE and p.stats["shared_build"] == PORTABLE
    assert "PREFIXATTN_SHARED_BUILD=hopper" in p.stats["shared_build_why"]


def test_the_interpreter_keeps_the_portable_build():
    b = _batch(torch.bfloat16)
    with asking_for(HOPPER):
        p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always")
    assert p.shared_build == PORTABLE and "interpreter" in p.stats["shared_build_why"]


def test_the_hopper_build_serves_16_bit_sm90_shared_classes():
    assert shared_build(HOPPER, interpreted=False, **SERVED) == (HOPPER, shared_build(
        HOPPER, interpreted=False, **{**SERVED, "features": ("HAS_SOFT_CAP", "HAS_WINDOW", "HAS_SINKS")})[1])
    for dtype, head_dim, block_size, block_n in (("fp16", 64, 32, 128), ("bf16", 128, 64, 64)):
        shapes = {**SERVED, "dtype": dtype, "head_dim": head_dim, "block_size": block_size, "block_n": block_n}
        assert hopper_shared_refusal(**shapes) is None


@pytest.mark.parametrize("change,words", [
    (dict(arch=80), "sm_90 only"), (dict(is_hip=True, arch="gfx942"), "sm_90 only"),
    (dict(dtype="fp32"), "16-bit"), (dict(kv_dtype="fp8"), "16-bit"), (dict(head_dim=96), "head sizes"), (dict(head_dim=256), "head sizes"),
    (dict(head_dim=192, v_head_dim=128), "head sizes"), (dict(block_size=1), "block sizes"),
    (dict(block_size=64, block_n=32), "block sizes"), (dict(features=("HAS_KV_SCALE",)), "HAS_KV_SCALE"),
    (dict(block_m=32), "whole warpgroups"),
])
def test_everything_else_stays_portable_and_says_why(change, words):
    build, why = shared_build(HOPPER, interpreted=False, **{**SERVED, **change})
    assert build == PORTABLE and words in why


def test_the_environment_asks_once_and_refuses_what_it_does_not_know(monkeypatch):
    monkeypatch.setattr(builds, "_requested", [])
    monkeypatch.setenv(builds.SHARED_BUILD_ENV, "gluon")
    with pytest.raises(ValueError, match="PREFIXATTN_SHARED_BUILD: expected one of portable, hopper, got 'gluon'"):
        builds.requested_shared_build()
    monkeypatch.setenv(builds.SHARED_BUILD_ENV, HOPPER)
    assert builds.requested_shared_build() == HOPPER
    monkeypatch.setenv(builds.SHARED_BUILD_ENV, PORTABLE)  # read once: a later change does not move it
    assert builds.requested_shared_build() == HOPPER
    with asking_for(PORTABLE):
        assert builds.requested_shared_build() == PORTABLE
    assert builds.requested_shared_build() == HOPPER
    with pytest.raises(ValueError, match="asking_for: expected one of portable, hopper, got 'sm90'"):
        with asking_for("sm90"):
            pass


class _Jit:
    """A JIT function's stand-in (``fn``: the kernel it stands for): records each launch's class arguments and the
    Triton allocator current during it."""

    def __init__(self, kernel, log: list) -> None:
        self.fn, self.log, self.options = kernel.fn, log, []

    def __getitem__(self, grid):
        def launch(*args, **options):
            from triton.runtime import _allocation

            named = dict(zip(self.fn.__code__.co_varnames, args))  # by position, as launched
            self.log.append((self.fn.__name__, named, _allocation._allocator.get()))
            self.options.append(options)
        return launch


@pytest.fixture
def on_hopper(monkeypatch):
    """Plans take the Hopper build (an sm_90 device, compiled kernels), whose launches and the portable kernel's are
    recorded by stand-ins; every launch through the JIT path."""
    log: list = []
    monkeypatch.setattr(plans, "_KERNELS_INTERPRETED", False)
    monkeypatch.setattr(plans, "_device_arch", lambda device: (False, 90))
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel",
                        _Jit(prefix_attention.prefix_attention_kernel, log))
    monkeypatch.setattr(hopper_module, "hopper_shared_kernel", _Jit(hopper_module.hopper_shared_kernel, log))
    monkeypatch.setattr(launcher, "ALLOW_DIRECT", False)
    with asking_for(HOPPER):
        yield log


def test_the_shared_class_launches_its_hopper_build_with_the_scratch_it_lends(on_hopper):
    b = _batch(torch.bfloat16)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always", logits_soft_cap=30.0)
    assert p.shared_build == HOPPER and p.work_classes[0] == CLASS_SHARED and len(p.work_classes) >= 2
    attention(b.q, b.k_cache, b.v_cache, p)
    names = [name for name, _, _ in on_hopper]
    assert names == ["hopper_shared_kernel"] + ["prefix_attention_kernel"] * (len(p.work_classes) - 1)
    _, shared, allocator = on_hopper[0]
    options = hopper_module.hopper_shared_kernel.options
    assert shared["IS_SHARED"] and shared["STAGES"] == HOPPER_STAGES and shared["HAS_SOFT_CAP"]
    assert options[0] == {"num_warps": hopper_num_warps(shared["BLOCK_M"])}
    assert isinstance(allocator, launcher.ScratchBuffer)
    for _, named, _ in on_hopper[1:]:  # one argument list: the same parameters, the same per-call tensors
        assert list(named) == [n for n in shared if n != "STAGES"]
        assert all(named[n] is shared[n] for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "items_ptr"))
    from triton.runtime import _allocation
    assert not isinstance(_allocation._allocator.get(), launcher.ScratchBuffer)  # given back


def test_the_hopper_build_refuses_caches_and_scales_it_cannot_read(on_hopper):
    b = _batch(torch.bfloat16)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always")
    assert p.shared_build == HOPPER
    apart = b.k_cache.transpose(1, 2).contiguous().transpose(1, 2)  # a token's heads not side by side
    with pytest.raises(ValueError, match=r"k_cache: expected a token's heads side by side .* reads it by TMA"):
        attention(b.q, apart, b.v_cache, p)
    with pytest.raises(ValueError, match="k_scale/v_scale: the shared class's Hopper build"):
        attention(b.q, b.k_cache, b.v_cache, p, v_scale=2.0)  # a float k_scale joins qk_scale: served
    assert on_hopper == []  # nothing launched


def _batch(dtype):
    return make_batch(0, q_lens=[1, 1, 3], extra_lens=[3, 5, 2], paths=[("a",), ("a",), ("a",)],
                      level_blocks={"a": 2}, block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=128, dtype=dtype)
