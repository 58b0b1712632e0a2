"""The shared class's Hopper build (prefixattn/kernels/hopper_shared_kernel.py, Gluon): the contract it shares with the
portable kernel, what it serves, and its sm_90 binary (TMA, warpgroup MMAs, warp specialization, no spills). Gluon has
no interpreter: this build is compiled here, never run (a GPU runs it)."""

import pytest

from prefixattn.autotune.builds import HOPPER_STAGES
from prefixattn.autotune.targets import TARGETS
from prefixattn.tuning import compile_specs as cs
from prefixattn.tuning.compile_check import _hopper_jobs, _kernel_param_names, failures, run_jobs


def test_the_hopper_build_takes_the_portable_kernels_parameters():
    """One contract: the same parameters in the same order (a launch passes one argument list to either build),
    plus the Hopper build's own K/V stages."""
    names = _kernel_param_names()
    assert names[cs.HOPPER_SHARED_KERNEL] == names[cs.FUSED_KERNEL] + ["STAGES"]


def test_jobs_for_the_shapes_it_serves_only():
    """sm90, 16-bit, head sizes without padded lanes (builds.hopper_shared_refusal: tests/test_shared_build.py)."""
    names = _kernel_param_names()
    for dtype in ("fp16", "bf16"):
        for head_dim in (64, 128):
            jobs = _hopper_jobs(TARGETS["sm90"], dtype, head_dim, names)
            assert jobs and all(j.kernel == "hopper_shared" and j.require_hopper for j in jobs)
            assert {j.variant for j in jobs} == {"hopper", "hopper+lse", "hopper+lse+soft_cap+window+sinks"}
            assert all(j.constexprs["STAGES"] == HOPPER_STAGES and j.constexprs["IS_SHARED"] for j in jobs)
    assert _hopper_jobs(TARGETS["sm90"], "bf16", 96, names) == []  # padded lanes
    assert _hopper_jobs(TARGETS["sm90"], "bf16", 256, names) == []  # builds.HOPPER_HEAD_DIMS says why
    assert _hopper_jobs(TARGETS["sm90"], "fp32", 128, names) == []
    assert _hopper_jobs(TARGETS["sm80"], "bf16", 128, names) == _hopper_jobs(TARGETS["gfx942"], "bf16", 128, names) == []
    with pytest.raises(ValueError, match="hopper_shared_job: the Hopper build serves head sizes 64/128 "):
        cs.hopper_shared_job(target=TARGETS["sm90"], dtype="bf16", head_dim=96, config=None, has_lse=True)


def test_failures_require_tma_warpgroup_mma_and_setmaxnreg():
    ok = dict(ok=True, default=True, spills=0, registers=168, shared_bytes=98468, shared_limit=232448,
              require_hopper=True, hopper={"tma": 16, "wgmma": 12, "setmaxnreg": 8})
    assert failures(ok) == []
    portable = {**ok, "hopper": {"tma": 0, "wgmma": 12, "setmaxnreg": 0}}
    assert failures(portable) == ["no tma in the Hopper build", "no setmaxnreg in the Hopper build"]
    assert failures({**portable, "require_hopper": False}) == []


@pytest.mark.compile
def test_the_sm90_binary_loads_by_tma_specializes_warps_and_spills_nothing():
    """bf16, head_dim 128, the shipped shared tile, with every model switch it serves (compile-check's record, compiled
    in a worker process with the interpreter off)."""
    job = [j for j in _hopper_jobs(TARGETS["sm90"], "bf16", 128, _kernel_param_names(), lse=(True,))
           if "+soft_cap+window+sinks" in j.variant][0]
    [record] = run_jobs([job], workers=1)
    assert failures(record) == [], record
    assert record["spills"] == 0 and record["hopper"]["tma"] > 0 and record["hopper"]["setmaxnreg"] > 0
    assert record["shared_part_layouts"] == ["wgmma"] and record["shared_part_matrix"] is True
