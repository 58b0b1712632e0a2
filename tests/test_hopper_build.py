"""Which build of each matrix class a plan takes (prefixattn/autotune/builds.py: the one decision, in Plan.stats) and
how its launches are assembled (launcher.with_hopper, a PreparedLaunch class with its own build and the global scratch
it lends). The Hopper build itself is Gluon, which has no interpreter: here its launches go to a recording stand-in;
tests/tuning/test_hopper_build_binary.py compiles it."""

from __future__ import annotations

import pytest
import torch

from prefixattn import attention, launcher, plan, prefix_attention
from prefixattn.autotune import builds
from prefixattn.autotune.builds import (HOPPER, HOPPER_CLASSES, HOPPER_STAGES, PORTABLE, asking_for, class_build,
                                       hopper_num_warps, hopper_refusal)
from prefixattn.kernels import hopper_attention_kernel as hopper_module
from prefixattn.kernels.layout import CLASS_CHUNK, CLASS_DECODE, CLASS_SHARED
from prefixattn.planner import plans
from tests.prefix_batches import make_batch

SERVED = dict(is_hip=False, arch=90, dtype="bf16", kv_dtype=None, head_dim=128, v_head_dim=None, block_size=16,
              block_m=128, block_n=64)


def test_the_portable_build_is_the_default():
    b = _batch(torch.bfloat16)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always")
    for name in HOPPER_CLASSES:
        assert p.stats[f"{name}_build"] == PORTABLE and "PREFIXATTN_BUILD=hopper" in p.stats[f"{name}_build_why"]
    assert {p.build_of(c) for c in p.work_classes} == {PORTABLE} and p.work_classes[:2] == (CLASS_SHARED, CLASS_CHUNK)


def test_the_interpreter_keeps_the_portable_build():
    b = _batch(torch.bfloat16)
    with asking_for(HOPPER):
        p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always")
    assert p.shared_build == p.chunk_build == PORTABLE
    assert "interpreter" in p.stats["shared_build_why"] and "interpreter" in p.stats["chunk_build_why"]


@pytest.mark.parametrize("work_class", HOPPER_CLASSES)
def test_the_hopper_build_serves_16_bit_sm90_matrix_classes(work_class):
    switches = ("HAS_SOFT_CAP", "HAS_WINDOW", "HAS_SINKS")
    assert class_build(work_class, HOPPER, interpreted=False, **SERVED) == (HOPPER, class_build(
        work_class, HOPPER, interpreted=False, **{**SERVED, "features": switches})[1])
    for dtype, head_dim, block_size, block_n in (("fp16", 64, 32, 128), ("bf16", 128, 64, 64)):
        shapes = {**SERVED, "dtype": dtype, "head_dim": head_dim, "block_size": block_size, "block_n": block_n}
        assert hopper_refusal(work_class, **shapes) is None


@pytest.mark.parametrize("work_class,change,words", [
    ("shared", dict(arch=80), "sm_90 only"), ("chunk", dict(is_hip=True, arch="gfx942"), "sm_90 only"),
    ("shared", dict(dtype="fp32"), "16-bit"), ("chunk", dict(kv_dtype="fp8"), "16-bit"),
    ("shared", dict(head_dim=96), "head sizes"), ("chunk", dict(head_dim=256), "head sizes"),
    ("shared", dict(head_dim=192, v_head_dim=128), "head sizes"), ("chunk", dict(block_size=1), "block sizes"),
    ("shared", dict(block_size=64, block_n=32), "block sizes"), ("chunk", dict(features=("HAS_KV_SCALE",)),
                                                                  "HAS_KV_SCALE"),
    ("shared", dict(block_m=32), "whole warpgroups"), ("chunk", dict(kv_heads=2), "over one KV head"),
    # A chunk tile reads its last page whole: with the NaN guard its class stays portable (builds.HOPPER_FEATURES).
    ("chunk", dict(features=("USE_NAN_GUARD",)), "the chunk class not with USE_NAN_GUARD"),
    ("decode", {}, "the shared/chunk classes, not decode"),
])
def test_everything_else_stays_portable_and_says_why(work_class, change, words):
    build, why = class_build(work_class, HOPPER, interpreted=False, **{**SERVED, **change})
    assert build == PORTABLE and words in why


def test_the_nan_guard_keeps_the_shared_class():
    assert hopper_refusal("shared", **SERVED, features=("USE_NAN_GUARD",)) is None  # a shared node masks no key


def test_the_environment_asks_once_and_refuses_what_it_does_not_know(monkeypatch):
    monkeypatch.setattr(builds._switch, "_stack", [])
    monkeypatch.setenv(builds.BUILD_ENV, "gluon")
    with pytest.raises(ValueError, match="PREFIXATTN_BUILD: expected one of portable, hopper, got 'gluon'"):
        builds.requested_build()
    monkeypatch.setenv(builds.BUILD_ENV, HOPPER)
    assert builds.requested_build() == HOPPER
    monkeypatch.setenv(builds.BUILD_ENV, PORTABLE)  # read once: a later change does not move it
    assert builds.requested_build() == HOPPER
    with asking_for(PORTABLE):
        assert builds.requested_build() == PORTABLE
    assert builds.requested_build() == HOPPER
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
    monkeypatch.setattr(hopper_module, "hopper_attention_kernel", _Jit(hopper_module.hopper_attention_kernel, log))
    monkeypatch.setattr(launcher, "ALLOW_DIRECT", False)
    with asking_for(HOPPER):
        yield log


def test_the_matrix_classes_launch_their_hopper_build_with_the_scratch_it_lends(on_hopper):
    b = _batch(torch.bfloat16)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always", logits_soft_cap=30.0)
    assert p.work_classes == (CLASS_SHARED, CLASS_CHUNK, CLASS_DECODE), p.stats
    assert p.shared_build == p.chunk_build == HOPPER and p.build_of(CLASS_DECODE) == PORTABLE
    attention(b.q, b.k_cache, b.v_cache, p)
    assert [name for name, _, _ in on_hopper] == ["hopper_attention_kernel"] * 2 + ["prefix_attention_kernel"]
    options = hopper_module.hopper_attention_kernel.options
    for (_, args, allocator), own, is_shared in zip(on_hopper, options, (True, False)):
        assert args["IS_SHARED"] == is_shared and args["STAGES"] == HOPPER_STAGES and args["HAS_SOFT_CAP"]
        assert own == {"num_warps": hopper_num_warps(args["BLOCK_M"])}
        assert isinstance(allocator, launcher.ScratchBuffer)
    shared = on_hopper[0][1]
    for _, named, _ in on_hopper[1:]:  # one argument list: the same parameters, the same per-call tensors
        assert [n for n in named if n != "STAGES"] == [n for n in shared if n != "STAGES"]
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
    with pytest.raises(ValueError, match=r"k_scale/v_scale: the Hopper build \(PREFIXATTN_BUILD=hopper\)"):
        attention(b.q, b.k_cache, b.v_cache, p, v_scale=2.0)  # a float k_scale joins qk_scale: served
    assert on_hopper == []  # nothing launched


def _batch(dtype):
    """Three requests under one shared prefix: two decodes and a prefill chunk."""
    return make_batch(0, q_lens=[1, 1, 40], extra_lens=[3, 5, 42], paths=[("a",), ("a",), ("a",)],
                      level_blocks={"a": 2}, block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=128, dtype=dtype)
