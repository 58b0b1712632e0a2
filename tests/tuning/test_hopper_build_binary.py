"""The matrix classes' Hopper build (prefixattn/kernels/hopper_attention_kernel.py, Gluon): the contract it shares with
the portable kernel, what it serves, and its sm_90 binaries (TMA, warpgroup MMAs, warp specialization, no spills). Gluon
has no interpreter: this build is compiled here, never run (a GPU runs it)."""

import pytest

from prefixattn.autotune.builds import HOPPER_STAGES
from prefixattn.autotune.targets import TARGETS
from prefixattn.tuning import compile_specs as cs
from prefixattn.tuning.compile_check import (_hopper_jobs, _kernel_param_names, default_attention_configs, failures,
                                             run_jobs)


def test_the_hopper_build_takes_the_portable_kernels_parameters():
    """One contract: the same parameters in the same order (a launch passes one argument list to either build),
    plus the Hopper build's own K/V stages."""
    names = _kernel_param_names()
    assert names[cs.HOPPER_KERNEL] == names[cs.FUSED_KERNEL] + ["STAGES"]


def test_jobs_for_the_shapes_it_serves_only():
    """sm90, 16-bit, head sizes without padded lanes (builds.hopper_refusal: tests/test_hopper_build.py); the shared
    and the chunk tiles, not the decode tile."""
    names = _kernel_param_names()
    for dtype in ("fp16", "bf16"):
        for head_dim in (64, 128):
            jobs = _hopper_jobs(TARGETS["sm90"], dtype, head_dim, names)
            assert jobs and all(j.kernel == "hopper" and j.require_hopper for j in jobs)
            assert sorted(j.variant for j in jobs) == sorted(
                f"hopper-{c}{v}" for c in ("shared", "chunk") for v in ("", "+lse", "+lse+soft_cap+window+sinks"))
            assert all(j.constexprs["STAGES"] == HOPPER_STAGES for j in jobs)
            assert all(j.constexprs["IS_SHARED"] == ("shared" in j.variant) for j in jobs)
    assert _hopper_jobs(TARGETS["sm90"], "bf16", 96, names) == []  # padded lanes
    assert _hopper_jobs(TARGETS["sm90"], "bf16", 256, names) == []  # builds.HOPPER_HEAD_DIMS says why
    assert _hopper_jobs(TARGETS["sm90"], "fp32", 128, names) == []
    for target in ("sm80", "gfx942"):
        assert _hopper_jobs(TARGETS[target], "bf16", 128, names) == []
    config = default_attention_configs(TARGETS["sm90"], 96, "bf16")[0][1]
    with pytest.raises(ValueError, match="hopper_job: the Hopper build serves head sizes 64/128 "):
        cs.hopper_job(target=TARGETS["sm90"], dtype="bf16", head_dim=96, config=config, has_shared=True, has_lse=True)
    assert cs.hopper_job(target=TARGETS["sm90"], dtype="bf16", head_dim=96, config=config, has_shared=True,
                         has_lse=True, strict=False) is None


def test_failures_require_tma_warpgroup_mma_and_setmaxnreg():
    ok = dict(ok=True, default=True, spills=0, registers=168, shared_bytes=98468, shared_limit=232448,
              require_hopper=True, hopper={"tma": 16, "wgmma": 12, "setmaxnreg": 8})
    assert failures(ok) == []
    portable = {**ok, "hopper": {"tma": 0, "wgmma": 12, "setmaxnreg": 0}}
    assert failures(portable) == ["no tma in the Hopper build", "no setmaxnreg in the Hopper build"]
    assert failures({**portable, "require_hopper": False}) == []


@pytest.mark.compile
@pytest.mark.parametrize("work_class", ["shared", "chunk"])
def test_the_sm90_binary_loads_by_tma_specializes_warps_and_spills_nothing(work_class):
    """bf16, head_dim 128, the shipped tile of the class, with every model switch it serves (compile-check's record,
    compiled in a worker process with the interpreter off)."""
    job = [j for j in _hopper_jobs(TARGETS["sm90"], "bf16", 128, _kernel_param_names(), lse=(True,))
           if j.variant == f"hopper-{work_class}+lse+soft_cap+window+sinks"][0]
    [record] = run_jobs([job], workers=1)
    assert failures(record) == [], record
    assert record["spills"] == 0 and record["hopper"]["tma"] > 0 and record["hopper"]["setmaxnreg"] > 0
    if work_class == "shared":  # the portable shared binary's dot check, run on this one's (its job's shared_dots)
        assert record["shared_part_layouts"] == ["wgmma"] and record["shared_part_matrix"] is True
    # Each tile's softmax under the previous tile's P @ V: the scores waited for with one product still in flight.
    assert 1 in record["hopper"]["wgmma_waits"], record["hopper"]
