"""The simulator's one table of constants: every number the cost model and the engine emulations use, with its source.

Each entry has a ``kind``:

``paper``
    taken from a published paper or spec (the ``source`` names where);
``engine-default``
    the default of the engine being emulated (vLLM / SGLang) or the value a paper states it ran with;
``assumption``
    chosen a priori, with the reason in ``source``; **not** tuned to make any paper's ratio come out;
``fit``
    fitted to a measurement (``source`` names the measurement). The table holds none: :mod:`prefixattn.sim.fit` fits
    constants to a GPU run and applies them as overrides, labelled fitted in its report.

Nothing else in :mod:`prefixattn.sim` holds a tunable number: the cost model and the policies read them from a
:class:`Calibration` (one object, built from :data:`TABLE`, optionally with overrides for what-if runs). The
efficiency factors are global: the same value for every policy, every workload.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    name: str
    value: float
    unit: str
    kind: str
    source: str


_KINDS = ("paper", "engine-default", "assumption", "fit")

TABLE: tuple[Constant, ...] = (
    # ----------------------------------------------------------------- cost model: efficiencies
    Constant("gemm_efficiency", 0.75, "fraction of peak", "assumption",
             "large bf16 GEMMs in cuBLAS/hipBLASLt reach roughly 70-80% of the dense tensor peak; middle of that range"),
    Constant("hbm_efficiency", 0.85, "fraction of peak", "assumption",
             "streaming reads reach roughly 80-90% of the spec-sheet HBM bandwidth on A100/H100-class parts"),
    Constant("attn_prefill_efficiency", 0.60, "fraction of peak", "paper",
             "FlashAttention-2 (Dao 2023, arXiv:2307.08691): forward pass reaches 50-73% of A100 peak; 0.60 taken "
             "below the middle because chunked prefill runs shorter query blocks than the paper's benchmark"),
    Constant("attn_decode_bw_efficiency", 0.70, "fraction of peak", "assumption",
             "paged decode attention gathers 16-token blocks through a block table, which streams worse than a "
             "contiguous copy; placed below hbm_efficiency"),
    Constant("triton_attention_factor", 0.85, "multiplier", "assumption",
             "BatchLLM sec. 6.3.3: Triton FlashAttention is slower than the CUDA one even after autotuning (no figure "
             "value in the text); applied to every Triton attention kernel (BatchLLM's and prefixattn's)"),
    Constant("l2_bw_efficiency", 0.6, "fraction of the preset's L2 ceiling", "assumption",
             "cache microbenchmarks reach roughly half to three quarters of a cache's peak read bandwidth; binds "
             "only where prefix groups re-read their KV from L2 (the preset's ceiling is at least the HBM peak)"),
    Constant("l2_usable_fraction", 0.5, "fraction of l2_bytes", "assumption",
             "the L2 is two partitions and each caches the lines its own SMs read (NVIDIA A100 whitepaper: each L2 "
             "partition localizes and caches data for memory accesses from SMs in the GPCs directly connected to it), "
             "so a prefix read by SMs on both sides is held twice: half the L2 holds distinct prefix lines"),
    Constant("cascade_attention_factor", 1.0, "multiplier", "assumption",
             "a cascade without KV splitting (FlashInfer's fa3 prefill wrappers; split_k=False) streams KV at this "
             "factor times the paged kernels' byte rates; 1 assumes it streams like them, a fit to a run where it "
             "streams decode-shaped levels slower finds less; FLOP rates are not scaled (fa3 is a fast prefill "
             "kernel) and a cascade with split_k (fa2 wrappers) always streams at the paged rates"),
    Constant("overlap_efficiency", 0.85, "multiplier", "assumption",
             "only for the NanoFlow-style overlapped backend: compute and memory operators sharing SMs interfere; "
             "BlendServe sec. 5.2 reports a polynomial interference fit without its coefficients"),
    # ----------------------------------------------------------------- cost model: tiling and occupancy
    Constant("gemm_tile_m", 128, "rows", "assumption", "common cuBLAS/CUTLASS output tile (128x128) for bf16 GEMMs"),
    Constant("gemm_tile_n", 128, "cols", "assumption", "common cuBLAS/CUTLASS output tile (128x128) for bf16 GEMMs"),
    Constant("attn_block_m", 128, "query rows", "assumption",
             "FlashAttention-2 query tile for head_dim 128; also the tile prefill work is quantized to"),
    Constant("attn_ctas_per_sm", 2, "CTAs", "assumption", "attention kernels at head_dim 128 fit two CTAs per SM"),
    Constant("sm_bandwidth_boost", 4.0, "multiplier", "assumption",
             "one SM streaming alone draws several times its 1/num_sms share of HBM bandwidth; bounds the tail of a "
             "kernel whose last CTA reads a long KV run"),
    Constant("split_k_min_tokens", 256, "KV tokens", "engine-default",
             "prefixattn.planner.options.MIN_SPLIT_TOKENS: shortest split-k chunk of this library's fused kernel "
             "(split only when the unsplit grid leaves SMs idle; BatchLLM sec. 6.3.3 names the bad case split-k fixes)"),
    # ----------------------------------------------------------------- cost model: per-step fixed costs
    Constant("elementwise_kernels_per_layer", 5, "launches", "assumption",
             "vLLM-style layer: 2 fused add+RMSNorm, rotary, KV-cache write, SiLU-and-mul (GEMMs counted apart)"),
    Constant("host_step_overhead_s", 2.0e-3, "s/step", "assumption",
             "Python scheduler + input preparation + sampler sync per iteration in vLLM 0.5-era engines; same for "
             "every policy (cf. the vLLM v0.6.0 release blog, which found the v0.5 GPU idle much of the time)"),
    Constant("host_per_seq_overhead_s", 1.0e-5, "s/seq/step", "assumption",
             "per-sequence block-table and metadata work on the host, same for every policy"),
    Constant("sampler_passes", 3, "passes over fp32 logits", "assumption",
             "logits write, softmax/argmax read+write: greedy ('max') sampling as in BlendServe sec. 5.1"),
    Constant("sampler_logit_copies", 3, "fp32 copies", "assumption",
             "sampler memory: logits, probabilities and a temporary per sampled sequence (the ElasticBatch draft's "
             "point that sampler memory competes with the KV cache)"),
    Constant("activation_copies", 2, "copies", "assumption",
             "peak activation memory: two live intermediate buffers of the widest layer output per batched token"),
    # ----------------------------------------------------------------- engine defaults
    Constant("block_size", 16, "tokens", "engine-default", "vLLM default KV block size"),
    Constant("vllm_gpu_memory_utilization", 0.90, "fraction", "engine-default", "vLLM default gpu_memory_utilization"),
    Constant("vllm_max_num_batched_tokens", 2048, "tokens", "engine-default",
             "BatchLLM sec. 6.1: chunk 2048 for the vLLM baseline (vLLM community's recommended throughput size)"),
    Constant("vllm_max_num_seqs", 256, "sequences", "engine-default",
             "vLLM default max_num_seqs; BatchLLM sec. 4.3.3"),
    Constant("vllm_watermark", 0.01, "fraction of blocks", "engine-default",
             "vLLM default block-manager watermark held back when admitting new prompts"),
    Constant("sglang_mem_fraction_static", 0.88, "fraction", "engine-default",
             "SGLang server_args default mem_fraction_static at TP1"),
    Constant("sglang_chunked_prefill_size", 8192, "tokens", "engine-default",
             "SGLang server_args: 8192 for GPUs with < 160 GB (A100/H100/H200)"),
    Constant("sglang_chunked_prefill_size_large", 16384, "tokens", "engine-default",
             "SGLang server_args: 16384 for GPUs with >= 160 GB (MI300X)"),
    Constant("sglang_large_gpu_bytes", 160 * 1024 ** 3, "bytes", "engine-default",
             "SGLang server_args memory threshold for the larger chunked_prefill_size"),
    Constant("sglang_max_prefill_tokens", 16384, "tokens", "engine-default", "SGLang default max_prefill_tokens"),
    Constant("sglang_lpm_fcfs_threshold", 128, "waiting requests", "engine-default",
             "SGLang schedule_policy.py: LPM falls back to FCFS when more than 128 requests wait"),
    Constant("sglang_init_new_token_ratio", 0.7, "fraction", "engine-default",
             "SGLang default init new_token_ratio (decode-memory reservation for running requests)"),
    Constant("sglang_min_new_token_ratio_factor", 0.14, "fraction", "engine-default",
             "SGLang default min_new_token_ratio = init x 0.14"),
    Constant("sglang_new_token_ratio_decay_steps", 600, "steps", "engine-default",
             "SGLang default: the ratio decays from init to min over 600 decode steps"),
    Constant("sglang_clip_max_new_tokens", 4096, "tokens", "engine-default",
             "SGLang CLIP_MAX_NEW_TOKENS_ESTIMATION: cap on one request's reserved output"),
    Constant("batchllm_chunk_tokens", 2048, "tokens", "paper",
             "BatchLLM sec. 4.3.3: S_chunk aligned with vLLM's 2048"),
    Constant("batchllm_memory_threshold", 0.95, "fraction of KV pool", "assumption",
             "BatchLLM Algorithm 2's M_threshold is not given in the paper; 5% headroom for decode growth"),
    Constant("prefixattn_token_budget", 8192, "tokens", "assumption",
             "the prefixattn policy's tokens per step: SGLang's default chunk for 35-160 GB GPUs; a larger dense "
             "batch amortizes the weight reads and GEMM wave tails. A design choice of this library's policy, made "
             "once for every workload (the 2048-token variant is reported beside it)"),
    Constant("prefixattn_reservation_clip", 4096, "tokens", "assumption",
             "the prefixattn policy reserves KV for at most this many estimated output tokens per request (SGLang "
             "clips its reservation at the same 4096), so a few 16K-token outputs cannot reserve the whole pool; "
             "chosen once for every workload"),
    Constant("output_sample_rate", 0.01, "fraction of requests", "paper",
             "BlendServe sec. 3.2: output lengths estimated by running 1% of the requests first (used by the "
             "policies that sample: blendserve, nanoflow-dfs, prefixattn)"),
    Constant("blendserve_batch_multiple", 128, "requests", "paper",
             "BlendServe sec. 4: batch sizes in multiples of 128"),
    Constant("blendserve_reserved_bytes", 20 * 10 ** 9, "bytes", "paper",
             "BlendServe Fig. 5: 20 GB reserved for weights and temporary buffers on an A100 80GB (Llama-3.1-8B)"),
)


class Calibration:
    """Read-only view of :data:`TABLE`, optionally with overrides (what-if studies; never per policy).

    Parameters
    ----------
    overrides : dict, optional
        ``name -> value`` replacing table entries. Unknown names raise ``ValueError``.

    Examples
    --------
    >>> Calibration().gemm_efficiency
    0.75
    >>> Calibration({"gemm_efficiency": 0.5}).gemm_efficiency
    0.5
    """

    def __init__(self, overrides: dict | None = None) -> None:
        values = {c.name: c.value for c in TABLE}
        for name, value in (overrides or {}).items():
            if name not in values:
                raise ValueError(f"overrides: expected names from the calibration table, got unknown {name!r}")
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"overrides[{name!r}]: expected a non-negative number, got {value!r}")
            values[name] = value
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "overrides", dict(overrides or {}))

    def __getattr__(self, name: str):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"calibration table has no constant {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError("Calibration is read-only; build a new one with overrides")

    def replace(self, **overrides) -> "Calibration":
        return Calibration({**self.overrides, **overrides})

    def rows(self) -> list[dict]:
        """The table as dicts (name, value, unit, kind, source), overrides applied and marked."""
        out = []
        for c in TABLE:
            row = dict(name=c.name, value=self._values[c.name], unit=c.unit, kind=c.kind, source=c.source)
            if c.name in self.overrides:
                row["kind"] = "override"
            out.append(row)
        return out


def table_markdown() -> str:
    """The calibration table as a Markdown table (for README and ``prefixattn simulate --calibration``)."""
    lines = ["| constant | value | unit | kind | source |", "|---|---|---|---|---|"]
    for c in TABLE:
        lines.append(f"| `{c.name}` | {c.value:g} | {c.unit} | {c.kind} | {c.source} |")
    return "\n".join(lines)


def _check_table() -> None:
    names = [c.name for c in TABLE]
    if len(set(names)) != len(names):
        raise RuntimeError("calibration table: duplicate constant names")
    for c in TABLE:
        if c.kind not in _KINDS or not c.source:
            raise RuntimeError(f"calibration table: {c.name} needs a kind in {_KINDS} and a source")


_check_table()
