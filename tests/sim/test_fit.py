"""prefixattn.sim.fit: the loader reads old and new model-step records, the fit recovers constants it was generated with
and keeps every constant inside its physical bounds, the held-out judgement runs on the committed H200 run, and Table 1
re-runs side by side (modeled)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from prefixattn.sim.calibration import Calibration
from prefixattn.sim.fit import (FIT_CONSTANTS, PAIRS, bounds, fit, held_out, load_steps, markdown, modeled, table1)
from prefixattn.sim.presets import get_hardware
from prefixattn.sim.step_cost import CostModel

TRUE = {"gemm_efficiency": 0.55, "hbm_efficiency": 0.7, "attn_decode_bw_efficiency": 0.45,
        "attn_prefill_efficiency": 0.35, "triton_attention_factor": 0.9, "l2_bw_efficiency": 0.8,
        "cascade_attention_factor": 0.4}
H200_STEPS = Path(__file__).resolve().parents[2] / "bench/results/gpu/nvidia-h200-74e5177-model-steps.json"
#: Search effort for tests: enough to move every constant, a fraction of the command's.
QUICK = dict(sweeps=1, golden_steps=8)
PROVIDERS = (("prefixattn", "fused", True, True), ("prefixattn-nosharing", "fused", True, False),
             ("flashinfer-best", "paged", False, False), ("flashinfer-cascade2", "cascade", False, True))


def _records(overrides, new_format=True):
    """Steps shaped like the GPU check's model steps (decode and mixed, four providers, groups of 8 over an 1100-token
    prefix), timed by the cost model with ``overrides`` standing in for a GPU."""
    rng = np.random.default_rng(0)
    raw = []
    for step, (n_dec, n_pre) in enumerate([(96, 0), (48, 0), (64, 3)]):
        q = [1] * n_dec + [int(x) for x in rng.integers(100, 400, n_pre)]
        kv = [int(x) for x in rng.integers(1200, 1800, len(q))]
        groups = [1100 if i < len(q) - len(q) % 8 else 0 for i in range(len(q))]
        runs = [[1100, sum(q[i:i + 8])] for i in range(0, len(q) - len(q) % 8, 8)]
        for provider, kernel, split_k, shares in PROVIDERS:
            rec = dict(step=step, kind="mixed" if n_pre else "decode", provider=provider, kernel=kernel,
                       split_k=split_k, q_lens=q, kv_lens=kv, num_sampled=len(q),
                       shared_lens=groups if shares else [0] * len(q), shared_runs=runs if shares else [],
                       model="llama-3.1-8b", device="NVIDIA H100 80GB HBM3", step_s=1.0, attention_s=1.0)
            if new_format:
                rec.update(group_lens=groups, group_runs=runs, workload="batchllm-case1", l2_bytes=50 * 2 ** 20,
                           hbm_bytes_per_s=2.9e12)
            raw.append(rec)
    steps, hw, model = load_steps(raw)
    cost = CostModel(hw, model, Calibration(overrides))
    out = []
    for rec, m in zip(raw, steps):
        step_s, attn_s = modeled(cost, m)
        out.append(dict(rec, step_s=step_s, attention_s=attn_s))
    return out


def test_loader_reads_old_and_new_records_alike():
    new_steps, hw, model = load_steps(_records({}))
    old_steps, hw_old, _ = load_steps(_records({}, new_format=False))
    assert (hw, hw_old, model) == ("h100", "h100", "llama-3.1-8b")  # the records' L2 is the preset's: no replacement
    for new, old in zip(new_steps, old_steps):
        # an old record of an unshared provider takes its groups from the sharing record of its step
        assert np.array_equal(new.shape.group_lens, old.shape.group_lens)
        assert [(r.kv_len, r.num_queries) for r in new.shape.group_runs] == \
            [(r.kv_len, r.num_queries) for r in old.shape.group_runs]
        assert new.shape.group_lens.sum() > 0
    nosharing = next(m for m in new_steps if m.provider == "prefixattn-nosharing")
    assert nosharing.shape.shared_nodes == [] and nosharing.hbm_bytes_per_s == 2.9e12
    assert nosharing.step == "batchllm-case1 decode step 0" and nosharing.workload == "batchllm-case1"
    assert old_steps[0].hbm_bytes_per_s is None and old_steps[0].step == "decode step 0"
    # a run's L2 that differs from the preset's replaces it
    other = [dict(r, l2_bytes=40 * 2 ** 20) for r in _records({})]
    _, hw_other, _ = load_steps(other)
    assert hw_other.l2_bytes == 40 * 2 ** 20 and hw_other.hbm_bandwidth == get_hardware("h100").hbm_bandwidth


def test_loader_rejects_bad_records():
    recs = _records({})
    with pytest.raises(ValueError, match="records"):
        load_steps({"not": "a list"})
    with pytest.raises(ValueError, match=r"records\[0\].*step_s"):
        load_steps([{k: v for k, v in recs[0].items() if k != "step_s"}] + recs[1:])
    with pytest.raises(ValueError, match=r"records\[1\]\.kv_lens"):
        load_steps([recs[0], dict(recs[1], kv_lens=recs[1]["kv_lens"][:-1])])


def test_fit_recovers_the_constants_the_steps_were_timed_with():
    steps, hw, model = load_steps(_records(TRUE))
    r = fit(steps, hw, model, sweeps=6, golden_steps=16)
    assert r.rms_before > 0.1, "the default constants are not the generating ones: there is something to fit"
    assert r.rms_after < 0.01
    assert set(r.overrides) == set(FIT_CONSTANTS)
    for name in ("gemm_efficiency", "hbm_efficiency", "attn_decode_bw_efficiency", "cascade_attention_factor"):
        assert abs(r.overrides[name] / TRUE[name] - 1) < 0.05, (name, r.overrides[name])
    md = markdown(r, None, device="NVIDIA H100 80GB HBM3")
    assert "calibrated" in md and md.count("\n| batchllm-case1 decode step") == 8
    assert "| `triton_attention_factor` | 0.85 | [0.2, 1] |" in md
    assert r.hbm_bytes_per_s == 2.9e12 and "the run's measured HBM floor rate 2.90 TB/s" in md


def test_fit_stays_inside_physical_bounds_and_says_which_sit_at_one():
    # steps timed with constants outside the bounds (Triton faster than FlashAttention, an efficiency above 1): the
    # fit must stop at the bounds and report them there
    past = dict(TRUE, triton_attention_factor=3.0, attn_decode_bw_efficiency=1.6)
    steps, hw, model = load_steps(_records(past))
    r = fit(steps, hw, model, **QUICK)
    box = bounds(hw)
    assert box["triton_attention_factor"][1] <= 1.0 and box["attn_decode_bw_efficiency"][1] <= 1.0
    assert box["l2_bw_efficiency"][0] == pytest.approx(get_hardware("h100").hbm_bandwidth /
                                                       get_hardware("h100").l2_bandwidth)
    for name, value in r.overrides.items():
        lo, hi = box[name]
        assert lo <= value <= hi, (name, value, (lo, hi))
    assert {"triton_attention_factor", "attn_decode_bw_efficiency"} <= set(r.at_bound)
    md = markdown(r, None, device="NVIDIA H100 80GB HBM3")
    assert "| `triton_attention_factor` | 0.85 | [0.2, 1] | 1 | **yes** |" in md and "At a bound:" in md
    with pytest.raises(ValueError, match="sweeps"):
        fit(steps, hw, model, sweeps=0)
    with pytest.raises(ValueError, match="steps"):
        fit([], hw, model)


@pytest.fixture(scope="module")
def h200():
    records = json.loads(H200_STEPS.read_text())
    return records, load_steps(records)


def test_held_out_on_the_committed_h200_run(h200):
    records, (steps, hw, model) = h200
    assert (hw, model) == ("h200", "llama-3.1-8b")
    # old records: the unshared providers take their groups from the prefixattn record of their step
    for m in steps:
        assert m.shape.group_lens is not None and m.shape.group_lens.sum() > 0 and m.shape.group_runs
    held = held_out(steps, hw, model, **QUICK)
    ids = list(dict.fromkeys(m.step for m in steps))
    assert [f.step for f in held.folds] == ids and len(ids) == 4
    box = bounds(hw)
    for f in held.folds:
        assert {r["provider"] for r in f.rows} == {"prefixattn", "prefixattn-nosharing", "flashinfer-best",
                                                   "flashinfer-cascade2"}
        assert [(p["a"], p["b"]) for p in f.pairs] == list(PAIRS[:4])  # the run has no fa2 cascade
        for name, value in f.overrides.items():
            assert box[name][0] <= value <= box[name][1], (f.step, name, value)
        for r in f.rows:
            assert r["predicted_s"] > 0 and math.isclose(r["error"], r["predicted_s"] / r["measured_s"] - 1)
        for p in f.pairs:
            assert p["judged"] == (p["margin"] > 0.05)
    judged = [p for f in held.folds for p in f.pairs if p["judged"]]
    assert held.judged == len(judged) > 0 and 0 <= held.named <= held.judged
    assert held.max_error == max(abs(r["error"]) for f in held.folds for r in f.rows)
    assert ("NOT met" in held.verdict) == (not (held.error_met and held.winner_met))
    md = markdown(fit(steps, hw, model, **QUICK), None, device=records[0]["device"], held=held)
    assert "Held out (leave one step out" in md and "**Held-out verdict:" in md
    assert md.count("| decode step 132 | ") == 4 + 4
    with pytest.raises(ValueError, match="steps"):
        held_out([m for m in steps if m.step == ids[0]], hw, model, **QUICK)


def test_table1_side_by_side_has_every_paper_row():
    rows = table1({"gemm_efficiency": 0.6}, num_requests=40)
    assert [r["policy"] for r in rows if r["in_paper"]] == ["vllm-plain", "vllm-nocp", "vllm-nopc", "vllm",
                                                           "batchllm"]
    assert all(r["before_ratio"] > 0 and r["calibrated_ratio"] > 0 for r in rows)
    assert rows[0]["before_ratio"] == rows[0]["calibrated_ratio"] == 1.0  # vllm-plain is the unit
