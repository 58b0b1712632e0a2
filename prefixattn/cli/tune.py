"""``prefixattn tune``: time candidate configs on this GPU and store the winners in the user tuning cache.

What a tuning run does is :mod:`prefixattn.tuning.tuner`. ``--write-shipped`` instead rebuilds the package's shipped
tables from the analytic model (no GPU needed, :mod:`prefixattn.tuning.table_builder`); pass ``--exclude-report``
with a ``prefixattn compile-check --json`` report to skip configs that failed it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from prefixattn.autotune import lookup
from prefixattn.autotune.buckets import make_bucket
from prefixattn.autotune.config_space import DTYPE_BYTES, HEAD_DIMS
from prefixattn.autotune.targets import TARGETS, detect_target, get_target, parse_targets
from prefixattn.autotune.tuning_cache import TuningCache, cache_path
from prefixattn.cli.arg_types import int_list, positive_int
from prefixattn.tuning.tuner import (DEFAULT_GROUPS, DEFAULT_KV_LENS, DEFAULT_MAX_Q_LENS, DEFAULT_Q_ROWS,
                                     DEFAULT_TOP_K, candidates, gpu_time_fn, tune)

HELP = "time tile configs on this GPU and cache the fastest per shape bucket (or rebuild the shipped tables)"
#: The package's shipped tables (``--write-shipped`` writes here by default).
SHIPPED_DIR = Path(lookup.__file__).parent / "configs"


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
    parser.add_argument("--shipped-dir", type=Path, default=SHIPPED_DIR,
                        help="with --write-shipped: output directory (default: the package's configs/)")


def _write_shipped(args) -> int:
    from prefixattn.tuning import compile_check, table_builder

    names = list(TARGETS) if args.write_shipped == "all" else [t.name for t in parse_targets(args.write_shipped)]
    for name in names:
        target = get_target(name)
        path = args.shipped_dir / f"{name}.json"
        exclude = table_builder.exclusions_from_table(path)
        if args.exclude_report:
            for key, bad in compile_check.exclusions_from_report(args.exclude_report, name).items():
                exclude.setdefault(key, set()).update(bad)
        table = table_builder.build_table(target, exclude=exclude)
        out = table_builder.write_table(table, args.shipped_dir)
        print(f"prefixattn tune: wrote {out} ({len(table['tiles'])} tiles, {len(table['shared'])} buckets)")
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
