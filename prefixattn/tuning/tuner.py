"""Tuning on a GPU: time candidate configs and store the winners in the user tuning cache.

For every bucket of the requested grid it builds a synthetic step of that shape (one shared prefix node of
``kv_len`` tokens under ``q_rows`` query tokens, requests of ``max_q_len`` query tokens each with their own suffix),
asks the cost model for its ``top_k`` best survivors of the pruned space (every launch option reaches the launch:
``num_warps``, ``num_stages`` and on ROCm the HIP knobs; for a decode bucket also the best one with several KV heads
per decode program), times each with
``triton.testing.do_bench`` through the public ``plan()``/``attention()`` under :func:`~prefixattn.autotune.lookup.
fixed_config`, and writes the fastest to the cache (after every bucket, so an interrupted run keeps its results).
The lookup then prefers these entries over the shipped table (``source == "user-cache"``).

The command is ``prefixattn tune`` (:mod:`prefixattn.cli.tune`); ``--write-shipped`` there rebuilds the shipped
tables instead (:mod:`prefixattn.tuning.table_builder`).
"""
from __future__ import annotations

import math
import sys
from dataclasses import replace

from prefixattn.autotune import cost_model, lookup
from prefixattn.autotune.buckets import Bucket
from prefixattn.autotune.config_space import AttentionConfig, attention_space, block_d, fitted_kv_heads, prune
from prefixattn.autotune.targets import Target
from prefixattn.autotune.tuning_cache import TuningCache

#: Default grid of a tuning run (a few minutes on one GPU with the default top-k).
DEFAULT_GROUPS = (1, 4, 8)
DEFAULT_Q_ROWS = (16, 256, 2048)
DEFAULT_MAX_Q_LENS = (1, 512)
DEFAULT_KV_LENS = (1024, 8192)
DEFAULT_TOP_K = 12
#: Distinct (suffix) KV tokens per request in the synthetic step, beyond its query tokens.
SUFFIX_TOKENS = 256
#: KV heads of the synthetic step (query heads = group x this).
NUM_KV_HEADS = 8
BLOCK_SIZE = 16


def candidates(bucket: Bucket, target: Target, top_k: int) -> list:
    """The cost model's ``top_k`` best survivors of the pruned space for ``bucket``, then, for a decode bucket, the
    first of them with 2, 4, ... KV heads per decode program (:func:`kv_heads_variants`): the analytic model does not
    rank those, the clock does."""
    space = attention_space(target)
    survivors = prune(space, target, head_dim=bucket.head_dim, dtype=bucket.dtype, group=bucket.group,
                      q_rows=bucket.q_rows, max_q_len=bucket.max_q_len, kv_len=bucket.kv_len)
    ranked = [c for s, c in cost_model.rank(survivors, bucket, target) if math.isfinite(s)][:top_k]
    if ranked and bucket.max_q_len == 1:
        ranked += kv_heads_variants(ranked[0], bucket)
    return ranked


def kv_heads_variants(cfg: AttentionConfig, bucket: Bucket) -> list[AttentionConfig]:
    """``cfg`` with each power of two from 2 KV heads per decode program (at most its tile's ``BLOCK_N``) that a plan
    of the synthetic step (:data:`NUM_KV_HEADS`) keeps whole
    (:func:`~prefixattn.autotune.config_space.fitted_kv_heads`)."""
    out, heads = [], 2
    while heads <= cfg.suffix.block_n and fitted_kv_heads(
            heads, num_kv_heads=NUM_KV_HEADS, group=bucket.group, block_m=cfg.suffix.block_m,
            block_d=block_d(bucket.head_dim), nan_guard=False) == heads:
        out.append(replace(cfg, suffix=replace(cfg.suffix, kv_heads=heads)))
        heads *= 2
    return out


def tune(buckets, target: Target, time_fn, cache: TuningCache, *, top_k: int = DEFAULT_TOP_K, progress=None,
         device_name: str | None = None) -> dict:
    """Time the candidates of every bucket with ``time_fn(bucket, config) -> seconds`` and cache each winner.

    A candidate whose timing raises (out of resources on this device, say) is skipped. Returns
    ``{bucket: (config, seconds)}``; the cache file is saved after every bucket.
    """
    won = {}
    for bucket in buckets:
        best = None
        for cfg in candidates(bucket, target, top_k):
            try:
                seconds = float(time_fn(bucket, cfg))
            except Exception as e:  # noqa: BLE001 - a config this device cannot run is just not a winner
                print(f"\nprefixattn tune: {bucket.key()} {cfg.short()} failed: {type(e).__name__}: {e}",
                      file=sys.stderr)
                seconds = math.inf
            if progress:
                progress(f"{bucket.key()} {cfg.short()}")
            if math.isfinite(seconds) and (best is None or seconds < best[1]):
                best = (cfg, seconds)
        if best is not None:
            cache.put(bucket, best[0], best[1])
            cache.save(target_name=target.name, device_name=device_name, triton_version=_triton_version())
            won[bucket] = best
    lookup.clear_caches()
    return won


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:  # pragma: no cover
        return None


def gpu_time_fn(device: str = "cuda"):
    """``time_fn`` for :func:`tune`: a synthetic step of the bucket's shape, timed with ``triton.testing.do_bench``.

    The CLI is a top-level tool like ``prefixattn bench``: it times the public ``plan()``/``attention()`` (what users
    run), with the candidate forced through :func:`~prefixattn.autotune.lookup.fixed_config`.
    """
    import torch
    import triton.testing

    import prefixattn

    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    steps: dict = {}

    def make_step(bucket: Bucket):
        dtype = dtypes[bucket.dtype]
        num_req = max(2, bucket.q_rows // bucket.max_q_len)
        prefix_blocks = -(-bucket.kv_len // BLOCK_SIZE)
        own_tokens = bucket.max_q_len + SUFFIX_TOKENS
        own_blocks = -(-own_tokens // BLOCK_SIZE)
        num_blocks = prefix_blocks + num_req * own_blocks
        table = torch.empty((num_req, prefix_blocks + own_blocks), dtype=torch.int32)
        table[:, :prefix_blocks] = torch.arange(prefix_blocks, dtype=torch.int32)
        for r in range(num_req):
            start = prefix_blocks + r * own_blocks
            table[r, prefix_blocks:] = torch.arange(start, start + own_blocks, dtype=torch.int32)
        kv_lens = torch.full((num_req,), prefix_blocks * BLOCK_SIZE + own_tokens, dtype=torch.int32)
        qo_indptr = torch.arange(num_req + 1, dtype=torch.int32) * bucket.max_q_len
        hq = NUM_KV_HEADS * bucket.group
        q = torch.randn(num_req * bucket.max_q_len, hq, bucket.head_dim, dtype=dtype, device=device)
        k = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, bucket.head_dim, dtype=dtype, device=device)
        v = torch.randn_like(k)
        meta = (qo_indptr.to(device), kv_lens.to(device), table.to(device))
        return q, k, v, meta, hq

    def time_fn(bucket: Bucket, cfg) -> float:
        if bucket not in steps:
            steps.clear()  # one step's tensors at a time
            steps[bucket] = make_step(bucket)
        q, k, v, meta, hq = steps[bucket]
        with lookup.fixed_config(cfg):
            p = prefixattn.plan(*meta, block_size=BLOCK_SIZE, num_qo_heads=hq, num_kv_heads=NUM_KV_HEADS,
                                head_dim=bucket.head_dim, q_dtype=q.dtype)
        return triton.testing.do_bench(lambda: prefixattn.attention(q, k, v, p)) * 1e-3  # ms -> s

    return time_fn
