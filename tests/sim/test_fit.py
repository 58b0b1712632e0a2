"""prefixattn.sim.fit: the cost model fitted to measured steps recovers constants it was generated with, reports the
error before and after, and re-runs BatchLLM Table 1 case 1 side by side (modeled)."""

import numpy as np

from prefixattn.sim.calibration import Calibration
from prefixattn.sim.fit import FIT_CONSTANTS, fit, load_steps, markdown, modeled, table1
from prefixattn.sim.step_cost import CostModel

TRUE = {"gemm_efficiency": 0.55, "hbm_efficiency": 0.7, "attn_decode_bw_efficiency": 0.45,
        "attn_prefill_efficiency": 0.35, "triton_attention_factor": 0.9}


def _records(overrides):
    """Steps shaped like the GPU check's model steps (decode and mixed, four kernel kinds), timed by the cost model
    with ``overrides`` standing in for a GPU."""
    rng = np.random.default_rng(0)
    out = []
    for step, (n_dec, n_pre) in enumerate([(256, 0), (128, 0), (200, 6), (64, 3)]):
        q = [1] * n_dec + [int(x) for x in rng.integers(100, 400, n_pre)]
        kv = [int(x) for x in rng.integers(1200, 1800, len(q))]
        for provider, kernel, split_k, shared in (("prefixattn", "fused", True, True),
                                                  ("prefixattn-nosharing", "fused", True, False),
                                                  ("flashinfer-best", "paged", False, False),
                                                  ("flashinfer-cascade2", "cascade", False, True)):
            rec = dict(step=step, kind="mixed" if n_pre else "decode", provider=provider, kernel=kernel,
                       split_k=split_k, q_lens=q, kv_lens=kv, num_sampled=len(q),
                       shared_lens=[1100] * len(q) if shared else [0] * len(q),
                       shared_runs=[[1100, sum(q[i::8])] for i in range(8)] if shared else [],
                       model="llama-3.1-8b", device="NVIDIA H100 80GB HBM3")
            steps, hw, model = load_steps([dict(rec, step_s=1.0, attention_s=1.0)])
            step_s, attn_s = modeled(CostModel(hw, model, Calibration(overrides)), steps[0])
            out.append(dict(rec, step_s=step_s, attention_s=attn_s))
    return out


def test_fit_recovers_the_constants_the_steps_were_timed_with():
    steps, hw, model = load_steps(_records(TRUE))
    assert (hw, model) == ("h100", "llama-3.1-8b")
    r = fit(steps, hw, model)
    assert r.rms_before > 0.1, "the default constants are not the generating ones: there is something to fit"
    assert r.rms_after < 0.01
    assert set(r.overrides) == set(FIT_CONSTANTS)
    for name in ("gemm_efficiency", "hbm_efficiency", "attn_decode_bw_efficiency"):
        assert abs(r.overrides[name] / TRUE[name] - 1) < 0.05, (name, r.overrides[name])
    md = markdown(r, None, device="NVIDIA H100 80GB HBM3")
    assert "calibrated" in md and md.count("\n| decode step") == 8


def test_table1_side_by_side_has_every_paper_row():
    rows = table1({"gemm_efficiency": 0.6}, num_requests=40)
    assert [r["policy"] for r in rows if r["in_paper"]] == ["vllm-plain", "vllm-nocp", "vllm-nopc", "vllm",
                                                           "batchllm"]
    assert all(r["before_ratio"] > 0 and r["calibrated_ratio"] > 0 for r in rows)
    assert rows[0]["before_ratio"] == rows[0]["calibrated_ratio"] == 1.0  # vllm-plain is the unit
