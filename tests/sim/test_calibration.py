"""The calibration table is the one place constants come from, and every entry carries a source."""

import ast
import dataclasses
import inspect

import pytest

from prefixattn.sim import calibration, engine, held_out, kvpool, l2_reuse, step_cost
from prefixattn.sim.calibration import TABLE, Calibration
from prefixattn.sim.policies import sglang, vllm
from prefixattn.sim.presets import HARDWARE, MODELS

#: Literals that are unit facts or indices, not tunable knobs.
_ALLOWED = {0, 1, 2, 3, 4, 0.0, 1.0, 2.0, 6}


def _numeric_literals(module):
    tree = ast.parse(inspect.getsource(module))
    docstrings = {id(n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Expr) and isinstance(getattr(n, "value", None), ast.Constant)}
    # module-level NAMED_CONSTANT = ... assignments are the documented exceptions (each with its reason)
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.lstrip("_").isupper()
                                                for t in node.targets):
            docstrings |= {id(n) for n in ast.walk(node.value)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docstrings and \
                isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            yield node.lineno, node.value


def test_every_constant_has_kind_and_source():
    assert len({c.name for c in TABLE}) == len(TABLE)
    for c in TABLE:
        assert c.kind in ("paper", "engine-default", "assumption", "fit"), c.name
        assert len(c.source) > 20, c.name


@pytest.mark.parametrize("module", [step_cost, engine, kvpool, vllm, sglang, l2_reuse, held_out])
def test_no_tunable_literals_outside_the_table(module):
    assert [(line, v) for line, v in _numeric_literals(module) if v not in _ALLOWED] == []


def test_cost_model_reads_the_table():
    base = step_cost.CostModel("a100", "mistral-7b")
    for c in TABLE:
        assert getattr(base.calib, c.name) == c.value
    changed = step_cost.CostModel("a100", "mistral-7b", Calibration({"host_step_overhead_s": 1.0}))
    import numpy as np
    step = step_cost.StepShape(q_lens=np.ones(4, dtype=np.int64), kv_lens=np.full(4, 64), num_sampled=4)
    assert changed.step_cost(step).total - base.step_cost(step).total == pytest.approx(1.0 - 2.0e-3)


def test_overrides_are_checked_and_marked():
    with pytest.raises(ValueError, match="overrides"):
        Calibration({"no_such_constant": 1})
    with pytest.raises(ValueError, match="gemm_efficiency"):
        Calibration({"gemm_efficiency": -1})
    rows = {r["name"]: r for r in Calibration({"gemm_efficiency": 0.5}).rows()}
    assert rows["gemm_efficiency"]["kind"] == "override" and rows["gemm_efficiency"]["value"] == 0.5
    with pytest.raises(AttributeError):
        Calibration().gemm_efficiency = 1.0
    assert "| `gemm_efficiency` |" in calibration.table_markdown()


def test_presets_have_sources():
    for hw in HARDWARE.values():
        assert set(hw.sources) >= {"peak_flops", "hbm_bandwidth", "memory_bytes", "num_sms", "launch_overhead_s",
                                   "l2_bytes", "l2_bandwidth"}
        assert "assumption" in hw.sources["launch_overhead_s"]
        # HBM reads pass through the L2, so its ceiling is at least HBM's peak (the fit's lower bound relies on it)
        assert hw.l2_bandwidth >= hw.hbm_bandwidth and hw.l2_bytes > 0
    with pytest.raises(ValueError, match="l2_bandwidth"):
        dataclasses.replace(HARDWARE["h200"], l2_bandwidth=1e12)
    for m in MODELS.values():
        assert m.source and m.num_heads % m.num_kv_heads == 0
    # parameter counts from the configs: ~7.2B Mistral, ~8.0B Llama-3, ~7.6B Qwen2
    assert 7.1e9 < MODELS["mistral-7b"].num_params < 7.3e9
    assert 7.9e9 < MODELS["llama-3-8b"].num_params < 8.1e9
    assert 7.5e9 < MODELS["qwen2-7b"].num_params < 7.7e9
