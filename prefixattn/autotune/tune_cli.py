"""``prefixattn tune``: time candidate configs on this GPU and store the winners in the user tuning cache.

For every bucket of the requested grid it builds a synthetic step of that shape (one shared prefix node of
``kv_len`` tokens under ``q_rows`` query tokens, requests of ``max_q_len`` query tokens each with their own suffix),
asks the cost model for its ``--top-k`` best survivors of the pruned space (every launch option reaches the launch:
``num_warps``, ``num_stages`` and on ROCm the HIP knobs), times each with
``triton.testing.do_bench`` through the public ``plan()``/``attention()`` under :func:`~prefixattn.autotune.lookup.
fixed_config`, and writes the fastest to the cache (after every bucket, so an interrupted run keeps its results).
The lookup then prefers these entries over the shipped table (``source == "user-cache"``).

``--write-shipped`` instead rebuilds the package's shipped tables from the analytic model (no GPU needed); pass
``--exclude-report`` with a ``prefixattn compile-check --json`` report to skip configs that failed it.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from prefixattn.autotune import cost_model, lookup
from prefixattn.autotune.buckets import Bucket, make_bucket
from prefixattn.autotune.config_space import DTYPE_BYTES, HEAD_DIMS, attention_space, prune
from prefixattn.autotune.targets import TARGETS, Target, detect_target, get_target, parse_targets
from prefixattn.autotune.tuning_cache import TuningCache, cache_path
from prefixattn.cli import int_list, positive_int

HELP = "time tile configs on this GPU and cache the fastest per shape bucket (or rebuild the shipped tables)"

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


class ProgressBar:
    """A one-line text progress bar on a stream (no dependency; tqdm is only in the bench extra)."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 30) -> None:
        self.total, self.stream, self.width = max(total, 1), stream, width
        self.done = 0
        self.t0 = time.perf_counter()

    def update(self, label: str = "") -> None:
        self.done += 1
        frac = self.done / self.total
        bar = "#" * int(frac * self.width)
        eta = (time.perf_counter() - self.t0) / self.done * (self.total - self.done)
        self.stream.write(f"\r[{bar:<{self.width}}] {self.done}/{self.total} eta {eta:4.0f}s {label[:60]:<60}")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def candidates(bucket: Bucket, target: Target, top_k: int) -> list:
    """The cost model's ``top_k`` best survivors of the pruned space for ``bucket``."""
    space = attention_space(target)
    survivors = prune(space, target, head_dim=bucket.head_dim, dtype=bucket.dtype, group=bucket.group,
                      q_rows=bucket.q_rows, max_q_len=bucket.max_q_len, kv_len=bucket.kv_len)
    ranked = [c for s, c in cost_model.rank(survivors, bucket, target) if math.isfinite(s)]
    return ranked[:top_k]


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


def _csv(cast):
    return lambda s: [cast(x.strip()) for x in s.split(",") if x.strip()]


def add_arguments(parser) -> None:
    parser.add_argument("--head-dims", type=int_list(HEAD_DIMS), default=[128], help="head sizes to tune (default 128)")
    parser.add_argument("--dtypes", type=_csv(str), default=["fp16", "bf16"], help="default fp16,bf16")
    parser.add_argument("--groups", type=int_list(positive=True), default=list(DEFAULT_GROUPS),
                        help="GQA group sizes")
    parser.add_argument("--q-rows", type=int_list(positive=True), default=list(DEFAULT_Q_ROWS),
                        help="query tokens per shared prefix node")
    parser.add_argument("--max-q-lens", type=int_list(positive=True), default=list(DEFAULT_MAX_Q_LENS),
                        help="query tokens per request (1 = decode)")
    parser.add_argument("--kv-lens", type=int_list(positive=True), default=list(DEFAULT_KV_LENS),
                        help="shared prefix lengths")
    parser.add_argument("--top-k", type=positive_int, default=DEFAULT_TOP_K,
                        help="candidates timed per bucket: the cost model's best survivors (default %(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="tuning cache directory (default $PREFIXATTN_TUNING_DIR or ~/.cache/prefixattn/tuning)")
    parser.add_argument("--dry-run", action="store_true", help="list buckets and candidates, time nothing")
    parser.add_argument("--target", default=None,
                        help=f"target to list candidates for in --dry-run without a GPU ({', '.join(TARGETS)})")
    parser.add_argument("--write-shipped", default=None, metavar="TARGETS",
                        help="rebuild the shipped tables of these targets (comma-separated, or 'all') from the "
                             "analytic model instead of timing")
    parser.add_argument("--exclude-report", type=Path, default=None,
                        help="with --write-shipped: a compile-check JSON report; configs failing it are skipped")
    parser.add_argument("--shipped-dir", type=Path, default=Path(__file__).parent / "configs",
                        help="with --write-shipped: output directory (default: the package's configs/)")


def _write_shipped(args) -> int:
    from prefixattn.autotune import compile_check, shipped_tables

    names = list(TARGETS) if args.write_shipped == "all" else [t.name for t in parse_targets(args.write_shipped)]
    for name in names:
        target = get_target(name)
        path = args.shipped_dir / f"{name}.json"
        exclude = shipped_tables.exclusions_from_table(path)
        if args.exclude_report:
            for key, bad in compile_check.exclusions_from_report(args.exclude_report, name).items():
                exclude.setdefault(key, set()).update(bad)
        table = shipped_tables.build_table(target, exclude=exclude)
        out = shipped_tables.write_table(table, args.shipped_dir)
        print(f"prefixattn tune: wrote {out} ({len(table['configs'])} configs, {len(table['buckets'])} buckets)")
    lookup.clear_caches()
    return 0


def run(args) -> int:
    try:
        if args.write_shipped:
            return _write_shipped(args)
        for d in args.dtypes:
            if d not in DTYPE_BYTES:
                raise ValueError(f"dtypes: expected a subset of {','.join(DTYPE_BYTES)}, got {d!r}")
        for h in args.head_dims:
            if h not in HEAD_DIMS:
                raise ValueError(f"head-dims: expected values in {HEAD_DIMS}, got {h}")
        if args.top_k < 1:
            raise ValueError(f"top-k: expected >= 1, got {args.top_k}")
        target = get_target(args.target) if args.target else detect_target()
    except ValueError as e:
        print(f"prefixattn tune: {e}", file=sys.stderr)
        return 2
    if target is None:
        print("prefixattn tune: no GPU with a known target here (tuning times kernels on the device; see "
              "--dry-run --target NAME to inspect candidates, --write-shipped for the analytic tables)",
              file=sys.stderr)
        return 2
    buckets = sorted({make_bucket(head_dim=h, dtype=d, group=g, q_rows=q, max_q_len=l, kv_len=kv)
                      for h in args.head_dims for d in args.dtypes for g in args.groups for q in args.q_rows
                      for l in args.max_q_lens for kv in args.kv_lens})
    if args.dry_run:
        for b in buckets:
            print(b.key(), " ".join(c.short() for c in candidates(b, target, args.top_k)))
        return 0
    import torch

    device_name = torch.cuda.get_device_name()
    cache = TuningCache(cache_path(target.name, args.cache_dir))
    total = sum(len(candidates(b, target, args.top_k)) for b in buckets)
    bar = ProgressBar(total)
    won = tune(buckets, target, gpu_time_fn(), cache, top_k=args.top_k, progress=bar.update,
               device_name=device_name)
    print(f"prefixattn tune: {len(won)} buckets tuned on {device_name} ({target.name}); cache: {cache.path}")
    return 0
