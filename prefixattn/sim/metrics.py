"""What a simulation run reports: throughput, saving ratio vs optimal, memory, preemptions, TECD, the T_o bound.

All numbers are **modeled** (simulated on the cost model), never measured; every report labels them so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from prefixattn.sim.presets import GIB


@dataclass
class SimResult:
    """One policy on one workload.

    Attributes
    ----------
    throughput_tok_s : float
        (input + output tokens of all requests) / simulated time (BlendServe sec. 5.2's definition).
    requests_per_s : float
        Requests / simulated time (BatchLLM Table 1's unit).
    saving_ratio : float
        BatchLLM Eq. 2: 1 - prompt tokens computed / prompt tokens of all requests (first attempts; recomputation
        after preemption is reported apart, as BlendServe sec. 5.3 excludes it).
    optimal_saving_ratio : float or None
        The same with every shared prefix computed once (:func:`prefixattn.scheduling.optimal_saving_ratio`).
    bound_s : float
        BlendServe's optimum ``T_o = max((1 - s_o) T_comp, T_mem)`` at the calibrated GEMM and HBM rates.
    fraction_of_bound : float
        ``bound_s / time_s``.
    tecd_s : float
        Time excluding cool-down (BatchLLM sec. 6.3.2): until the last step that still prefilled prompt tokens.
    """

    policy: str
    workload: str
    model: str
    gpu: str
    num_requests: int
    time_s: float
    throughput_tok_s: float
    requests_per_s: float
    saving_ratio: float
    optimal_saving_ratio: float | None
    peak_kv_gib: float
    kv_capacity_gib: float
    preemptions: int
    recomputed_tokens: int
    steps: int
    tecd_s: float
    bound_s: float
    fraction_of_bound: float
    mean_tokens_per_step: float
    peak_seqs_per_step: int
    kernel: str
    backend: str
    breakdown_s: dict = field(default_factory=dict)
    modeled: bool = True
    timeline: dict = field(default_factory=dict, repr=False)

    def row(self) -> dict:
        """The result without its timeline (one table/JSON row)."""
        d = asdict(self)
        d.pop("timeline")
        return d


def blendserve_bound(workload, cost, saving: float) -> float:
    """BlendServe sec. 2.3-2.4 ``T_o = max((1 - s_o) T_comp, T_mem)`` at peak x calibrated efficiency.

    One refinement keeps it a true lower bound of the modeled time: BlendServe's ``(p + d) * P_model * 2`` charges
    every parameter for every token; here the decoder GEMM weights are charged per token and the LM head only per
    generated token (embeddings are a gather). ``(1 - s_o)`` applies to the prompt-side compute, as sharing saves
    prompt tokens only. The modeled time also pays weight reads, launches and host work, so the fraction stays < 1.
    """
    m, hw, c = cost.model, cost.hw, cost.calib
    p = np.fromiter((r.prompt_len for r in workload.requests), dtype=np.float64, count=len(workload.requests))
    d = np.fromiter((r.output_len for r in workload.requests), dtype=np.float64, count=len(workload.requests))
    decoder_params = m.decoder_active_params
    prompt_flops = (p * decoder_params * 2 + p * p * m.hidden_size * m.num_layers * 4).sum()
    output_flops = (d * (decoder_params + m.hidden_size * m.vocab_size) * 2).sum()
    nbytes = ((p * d + d * d / 2) * m.kv_width * m.num_layers * m.dtype_bytes).sum()
    rate = hw.peak_flops * c.gemm_efficiency
    t_comp = ((1 - saving) * prompt_flops + output_flops) / rate
    t_mem = nbytes / (hw.hbm_bandwidth * c.hbm_efficiency)
    return max(t_comp, t_mem)


def optimal_saving_ratio(workload) -> float | None:
    """Optimal saving ratio of the workload from :mod:`prefixattn.scheduling` (cached on the workload)."""
    if "optimal_saving_ratio" in workload.info:
        return workload.info["optimal_saving_ratio"]
    try:
        from prefixattn.scheduling import optimal_saving_ratio as _optimal
    except ImportError:
        return None
    value = float(_optimal([r.prompt for r in workload.requests]))
    workload.info["optimal_saving_ratio"] = value
    return value


def collect(engine) -> SimResult:
    """Build the result of a finished :class:`prefixattn.sim.engine.Engine` run."""
    w, cost, pol = engine.workload, engine.cost, engine.policy
    logical = sum(s.prompt_len for s in engine.seqs)
    first = sum(s.prompt_len - max(s.first_hit, 0) for s in engine.seqs) + \
        sum(h.prompt_len - max(h.first_hit, 0) for h in engine.holders if h.first_hit >= 0)
    saving = 1.0 - first / logical if logical else 0.0
    total_tokens = logical + sum(s.output_len for s in engine.seqs)
    t = engine.clock
    opt = optimal_saving_ratio(w)
    bound = blendserve_bound(w, cost, opt if opt is not None else saving)
    tl = engine.timeline
    steps = int(sum(tl.count))
    block_bytes = engine.block_size * cost.kv_bytes_per_token
    timeline = {k: np.asarray(v) for k, v in vars(tl).items()}
    return SimResult(
        policy=pol.name, workload=w.name, model=cost.model.name, gpu=cost.hw.name, num_requests=len(engine.seqs),
        time_s=t, throughput_tok_s=total_tokens / t if t else math.inf,
        requests_per_s=len(engine.seqs) / t if t else math.inf,
        saving_ratio=saving, optimal_saving_ratio=opt,
        peak_kv_gib=engine.pool.peak_used * block_bytes / GIB,
        kv_capacity_gib=engine.pool.num_blocks * block_bytes / GIB,
        preemptions=engine.preemptions, recomputed_tokens=engine.prefill_executed - first,
        steps=steps, tecd_s=engine.last_prefill_clock, bound_s=bound, fraction_of_bound=bound / t if t else 0.0,
        mean_tokens_per_step=(engine.prefill_executed + engine.decode_executed) / steps if steps else 0.0,
        peak_seqs_per_step=engine.peak_seqs, kernel=pol.kernel, backend=pol.backend,
        breakdown_s={k: round(v, 3) for k, v in engine.breakdown.items()}, timeline=timeline)
