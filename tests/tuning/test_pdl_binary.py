"""The binaries of launches chained by programmatic dependent launch (prefixattn/autotune/pdl.py): grid dependency
control in the PTX, nothing else changed. Compiled here, never run (an sm_90 GPU runs them)."""

import pytest

from prefixattn.autotune.targets import TARGETS
from prefixattn.tuning import compile_specs as cs
from prefixattn.tuning.compile_check import class_binaries, default_attention_configs, failures, run_jobs


def test_failures_require_both_halves_of_grid_dependency_control():
    ok = dict(ok=True, default=True, spills=0, registers=82, shared_bytes=37888, shared_limit=232448,
              require_pdl=True, pdl={"launch_dependents": 1, "wait": 1})
    assert failures(ok) == []
    assert failures({**ok, "pdl": {"launch_dependents": 1, "wait": 0}}) == ["no griddepcontrol.wait in a PDL launch"]
    assert failures({**ok, "pdl": {"launch_dependents": 0, "wait": 0}, "require_pdl": False}) == []


def test_a_pdl_job_is_launched_as_a_dependent():
    mode, cfg, has_shared = class_binaries(default_attention_configs(TARGETS["sm90"], 128, "bf16"))[0]
    common = dict(target=TARGETS["sm90"], dtype="bf16", head_dim=128, config=cfg, variant=mode, has_lse=True,
                  has_shared=has_shared)
    job, plain = cs.fused_job(pdl=True, **common), cs.fused_job(**common)
    assert job.constexprs["USE_PDL"] is True and job.options == {**plain.options, "launch_pdl": True}
    assert job.require_pdl and job.variant == plain.variant + "+pdl"
    assert plain.constexprs["USE_PDL"] is False and not plain.require_pdl


@pytest.mark.compile
def test_the_sm90_decode_binary_gains_grid_dependency_control_and_nothing_else():
    """The shipped decode tile (bf16, head_dim 128, LSE): the same registers with and without PDL (the wait sits at
    the start of the grid's last program; program 0 waiting at its end kept the program id alive in every program:
    82 -> 97 registers)."""
    target = TARGETS["sm90"]
    mode, cfg, has_shared = [b for b in class_binaries(default_attention_configs(target, 128, "bf16"))
                             if b[0] == "decode" and not b[2]][0]
    jobs = [cs.fused_job(target=target, dtype="bf16", head_dim=128, config=cfg, variant=mode, has_lse=True,
                         has_shared=has_shared, pdl=pdl) for pdl in (False, True)]
    plain, chained = run_jobs(jobs, workers=1)
    assert failures(plain) == [] and failures(chained) == [], (plain, chained)
    assert plain["pdl"] == {"launch_dependents": 0, "wait": 0}
    assert chained["pdl"] == {"launch_dependents": 1, "wait": 1}
    assert chained["registers"] == plain["registers"] and chained["spills"] == 0
