"""The binaries of launches chained by programmatic dependent launch (prefixattn/autotune/pdl.py): their compile
jobs and the check's rule (tests/tuning/test_compile_check.py's worst case compiles them: grid dependency control in
the PTX, the registers of the same binary without PDL). Never run here (an sm_90 GPU runs them)."""

from prefixattn.autotune.targets import TARGETS
from prefixattn.tuning import compile_specs as cs
from prefixattn.tuning.compile_check import class_binaries, default_attention_configs, failures


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
