"""Tile-config sweep on a GPU: the GPU check's timing shapes (cases.py) under a set of candidate configs of
the fused kernel, each checked against the reference and timed: the evidence behind a target's measured overrides
(``prefixattn/autotune/configs/<target>.measured.json``); ``prefixattn tune`` times synthetic steps instead.

    PYTHONPATH=bench python -m gpu_check.tile_sweep [--out DIR] [--budget SECONDS]   # on the GPU machine, ~4 minutes
    PYTHONPATH=bench python -m gpu_check.tile_sweep --suite plain    # no sharing: the suffix-only launch's tiles
    PYTHONPATH=bench python -m gpu_check.tile_sweep --dry-run        # any CPU machine: tiny shapes, interpreter

(from the repository root).

Suites: ``shared`` (default), the timing shapes, eager ``do_bench`` as the GPU check times them (shapes under
~150 us measure the host's launch overhead more than the kernel: rank on the larger ones); ``plain``, batches without
a shared prefix (decode at GQA 1/4/8, chunked prefill, prefill chunks with decodes) under suffix-tile candidates,
timed as CUDA-graph replays (``do_bench_cudagraph``), so the kernel's time is what is ranked.

Phase 1 compiles every (config, shape) binary in parallel worker processes (Triton's on-disk cache then serves the
timing process: the fused kernel takes seconds per variant to compile and a sweep needs ~100 variants); phase 2
times each config on each shape in one process (medians). Writes
``<out>/<gpu>-<commit>-tiles.csv`` (shape, family, config, median us, correct) row by row, so a run cut short keeps
what it measured, and prints each family's ranking: per config, the geometric mean over the family's shapes of its
time over the shape's best time.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
#: Compile workers of phase 1: each holds one full-size batch at a time (up to ~10 GB for 256 requests x 2.3K tokens
#: at MHA 32:32), so 6 fit an 80 GB card with room for the cache allocator.
COMPILE_WORKERS = 6
#: Seconds phase 1 may take before its workers are stopped (the rest compile in phase 2, one at a time).
COMPILE_LIMIT_S = 200
#: do_bench windows (ms) per (shape, config): ~50 shapes x ~16 configs fit the call.
BENCH_WARMUP_MS, BENCH_REP_MS = 10, 30
FIELDS = ("shape", "family", "config", "median_us", "correct", "max_abs_err", "has_shared", "items")


def candidates() -> list:
    """The candidate configs (head_dim 128, fp16): the shipped sm90 decode and prefill configs, the cost model's
    leaders for decode and chunked prefill, and suffix tiles from 16 to 128 rows under the 128x64 shared tile (a mixed
    step's decode items sit in the suffix tile of its prefill chunks). Suffix-only launches keep the shipped 4 warps."""
    from prefixattn.autotune.config_space import AttentionConfig, LaunchOptions, Tiles

    def cfg(sh, sf, warps, stages, sf_warps=4, sf_stages=3):
        return AttentionConfig(shared=Tiles(*sh), suffix=Tiles(*sf), launch=LaunchOptions(warps, stages),
                               suffix_launch=LaunchOptions(sf_warps, sf_stages))

    return [
        cfg((128, 64), (16, 32), 8, 3),  # shipped decode
        cfg((128, 32), (128, 64), 8, 3, 8, 3),  # shipped chunked prefill
        cfg((128, 64), (16, 64), 8, 3),
        cfg((128, 64), (16, 128), 8, 3),
        cfg((128, 64), (16, 128), 8, 2),
        cfg((64, 128), (16, 64), 8, 3),
        cfg((64, 64), (16, 64), 4, 3),
        cfg((64, 64), (16, 32), 4, 3),
        cfg((64, 64), (16, 64), 4, 4),
        cfg((128, 32), (16, 64), 8, 4),
        cfg((128, 64), (32, 64), 8, 3),
        cfg((128, 64), (64, 64), 8, 3),
        cfg((128, 64), (128, 64), 8, 3, 8, 3),
        cfg((128, 64), (128, 64), 8, 2, 8, 2),
        cfg((64, 64), (64, 64), 4, 3),
        cfg((128, 64), (32, 128), 8, 3),
    ]


def plain_candidates() -> list:
    """Suffix-only launches (``HAS_SHARED=False``): the suffix tile and its launch options; the shared tile is the
    shipped decode one (compiled out of these launches). Decode tiles with several KV heads per program
    (``(block_m, block_n, kv_heads)``; a plan fits them to each shape's heads: 16 lanes hold 2 KV heads at GQA 8, 4
    at GQA 4) beside the shipped one head."""
    from prefixattn.autotune.config_space import AttentionConfig, LaunchOptions, Tiles

    def cfg(sf, warps, stages):
        return AttentionConfig(shared=Tiles(128, 64), suffix=Tiles(*sf), launch=LaunchOptions(8, 3),
                               suffix_launch=LaunchOptions(warps, stages))

    return [cfg(sf, w, st) for sf, w, st in (((16, 32), 4, 3), ((16, 64), 4, 3), ((16, 128), 4, 3), ((16, 64), 8, 3),
                                               ((32, 64), 4, 3), ((64, 64), 4, 3), ((64, 64), 8, 3),
                                               ((128, 64), 8, 3), ((128, 32), 8, 3), ((64, 128), 8, 3),
                                               ((16, 32, 4), 4, 3), ((16, 64, 4), 4, 3), ((16, 64, 16), 4, 3))]


def plain_shapes(dry_run: bool) -> list:
    """No shared prefix, fp16, head_dim 128, 32 query heads, at GQA 1, 4 and 8: decode (128 requests x 4K tokens and
    32 x 16K: ~9 GB of MHA cache each, so the reference and the compile workers fit the card), 7 prefill chunks of 2K
    tokens with 256 decodes of 2K, and 8 prompts of 1K tokens."""
    from batches.shapes import Shape

    if dry_run:
        return [Shape(scenario="decode", num_decode=3, num_prefill=0, shared=0, distinct=20, per_group=0,
                      num_qo_heads=4, num_kv_heads=1, head_dim=64, paper="dry-run:plain-decode")]
    common = dict(shared=0, per_group=0, num_qo_heads=32, head_dim=128)
    out = []
    for kv_heads in (32, 8, 4):
        for requests, length in ((128, 4096), (32, 16384)):
            out.append(Shape(scenario="decode", num_decode=requests, num_prefill=0, distinct=length,
                             num_kv_heads=kv_heads, paper=f"plain-decode{requests}:{length}", **common))
        out.append(Shape(scenario="mixed", num_decode=256, num_prefill=7, distinct=2048, num_kv_heads=kv_heads,
                         paper="plain-mixed7p+256d:2048", **common))
        out.append(Shape(scenario="mixed", num_decode=0, num_prefill=8, distinct=1024, num_kv_heads=kv_heads,
                         paper="plain-prefill8:1024", **common))
    return out


def timing_shapes(dry_run: bool) -> list:
    """The GPU check's timing shapes (imported here: the caller sets ``TRITON_INTERPRET`` before torch loads)."""
    from gpu_check.cases import timing_shapes as shapes_of_the_check

    return shapes_of_the_check(dry_run)


SUITES = {"shared": (candidates, timing_shapes), "plain": (plain_candidates, plain_shapes)}


#: ``--only-configs`` / ``--only-shapes`` (set by main, read by the workers too): a sweep of part of a suite.
ONLY: dict = {"configs": None, "shapes": None}


def configs_of(suite: str) -> list:
    """The suite's candidates, or those ``--only-configs`` names."""
    names = ONLY["configs"]
    return [c for c in SUITES[suite][0]() if names is None or c.short() in names]


def shapes(suite: str, dry_run: bool) -> list:
    """The suite's shapes (the GPU check's timing shapes, their dry-run pair on the CPU, or :func:`plain_shapes`),
    or those whose name contains one of ``--only-shapes``."""
    parts = ONLY["shapes"]
    return [s for s in SUITES[suite][1](dry_run) if parts is None or any(p in s.paper for p in parts)]


def family(shape) -> str:
    """What a shipped table tells apart: the GQA group and decode vs a step with prefill chunks."""
    group = shape.num_qo_heads // shape.num_kv_heads
    return f"g{group}-{'decode' if shape.num_prefill == 0 else 'mixed'}"


def _plan(batch, cfg):
    import prefixattn
    from prefixattn.autotune.lookup import fixed_config

    s = batch.shape
    with fixed_config(cfg):
        return prefixattn.plan(batch.qo_indptr, batch.kv_lens, batch.block_table, block_size=s.block_size,
                               num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                               q_dtype=batch.q.dtype, num_blocks=batch.num_blocks)


def compile_worker(suite: str, pairs: list[tuple[int, int]], device: str) -> int:
    """Phase 1, in a child process: one launch per (config, shape) index pair on random inputs, unchecked (only the
    binaries matter here); prints ``compiled <config> <shape>`` per launch."""
    import torch

    import prefixattn
    from batches.shapes import build_batch

    configs = configs_of(suite)
    for j, shape in enumerate(shapes(suite, dry_run=device == "cpu")):
        indices = [i for i, jj in pairs if jj == j]
        if not indices:
            continue
        batch = build_batch(shape, device=device, metadata_only=True)
        rows, s, dtype = int(batch.qo_indptr[-1]), shape, batch.dtype
        batch.q = torch.empty(rows, s.num_qo_heads, s.head_dim, dtype=dtype, device=device).normal_()
        batch.k_cache = torch.empty(batch.num_blocks, s.block_size, s.num_kv_heads, s.head_dim, dtype=dtype,
                                    device=device).normal_()
        batch.v_cache = torch.empty_like(batch.k_cache).normal_()
        for i in indices:
            try:
                p = _plan(batch, configs[i])
                prefixattn.attention(batch.q, batch.k_cache, batch.v_cache, p)
                if device != "cpu":
                    torch.cuda.synchronize()
                print(f"compiled {i} {shape.paper}", flush=True)
            except Exception as exc:  # a config this card cannot run fails again in phase 2, where it is recorded
                print(f"failed {i} {shape.paper}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        del batch
        if device != "cpu":
            torch.cuda.empty_cache()
    return 0


def compile_all(suite: str, dry_run: bool, workers: int, limit_s: float) -> None:
    # Config-major pairs dealt round-robin: each worker gets a share of the configs and of the shapes.
    pairs = [(i, j) for i in range(len(configs_of(suite))) for j in range(len(shapes(suite, dry_run)))]
    device = "cpu" if dry_run else "cuda"
    only = [f"--only-{k}={','.join(v)}" for k, v in ONLY.items() if v is not None]
    # The workers inherit the working directory and PYTHONPATH that found this package.
    procs = [subprocess.Popen([sys.executable, "-m", "gpu_check.tile_sweep", "--suite", suite, *only,
                               "--compile-worker", ",".join(f"{i}:{j}" for i, j in pairs[w::workers]),
                               "--device", device],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w in range(min(workers, len(pairs)))]
    start = time.monotonic()
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, limit_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            print(f"[compile] a worker stopped at the {limit_s:.0f} s limit", flush=True)
        lines = text.splitlines()
        done = sum(ln.startswith("compiled") for ln in lines)
        print(f"[compile] worker: {done} launches; " + " | ".join(ln for ln in lines if not ln.startswith("compiled"))
              [-400:], flush=True)
    print(f"[compile] {time.monotonic() - start:.0f} s", flush=True)


def _timer(fn, dry_run: bool, graph: bool) -> float:
    if dry_run:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=BENCH_REP_MS, return_mode="median")
    return triton.testing.do_bench(fn, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, return_mode="median")


def sweep(suite: str, dry_run: bool, out_csv: Path, deadline: float) -> list[dict]:
    import torch

    import prefixattn
    from batches.shapes import build_batch
    from tests.tolerances import ATTENTION_TOL

    device = "cpu" if dry_run else "cuda"
    configs = configs_of(suite)
    rows = []
    with out_csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for shape in shapes(suite, dry_run):
            if time.monotonic() > deadline:
                print(f"[sweep] deadline: stopped before {shape.paper}", flush=True)
                break
            batch = build_batch(shape, device=device)
            want = prefixattn.reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.qo_indptr,
                                                  batch.kv_lens, batch.block_table)
            atol, rtol = ATTENTION_TOL[batch.q.dtype]
            out = torch.empty_like(batch.q)
            label = f"{shape.paper} h{shape.num_qo_heads}:{shape.num_kv_heads}"
            times = []
            for cfg in configs:
                row = dict(shape=label, family=family(shape), config=cfg.short())
                try:
                    p = _plan(batch, cfg)
                    out.fill_(float("nan"))
                    run = lambda: prefixattn.attention(batch.q, batch.k_cache, batch.v_cache, p, out=out)  # noqa: E731
                    run()
                    err = (out.float() - want).abs()
                    correct = bool(torch.isfinite(out).all() and (err <= atol + rtol * want.abs()).all())
                    row.update(correct=int(correct), max_abs_err=f"{float(err.max()):.3e}",
                               has_shared=int(p.has_shared), items=p.num_items,
                               median_us=f"{_timer(run, dry_run, suite == 'plain') * 1e3:.2f}" if correct else "")
                except Exception as exc:  # out of resources on this card, say: recorded, not a winner
                    row.update(correct=0, median_us="", max_abs_err=f"{type(exc).__name__}: {str(exc)[:80]}")
                writer.writerow(row)
                f.flush()
                rows.append(row)
                times.append(f"{row['median_us'] or 'x'}")
            print(f"[sweep] {label:42s} " + " ".join(f"{t:>8s}" for t in times), flush=True)
            del batch, want, out
            if device != "cpu":
                torch.cuda.empty_cache()
    return rows


def ranking(rows: list[dict]) -> dict[str, list[tuple[float, str, int]]]:
    """Per family: ``(geomean of time / the shape's best, config, shapes measured)``, best first; a config that
    failed or was wrong on a shape scores inf there (so inf over the family)."""
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault((r["family"], r["shape"]), {})[r["config"]] = float(r["median_us"]) if r["median_us"] \
            else math.inf
    out: dict = {}
    for (fam, _), times in by_shape.items():
        best = min(times.values())
        for name, t in times.items():
            out.setdefault(fam, {}).setdefault(name, []).append(t / best)
    return {fam: sorted((math.exp(sum(map(math.log, r)) / len(r)), name, len(r)) for name, r in per.items())
            for fam, per in out.items()}


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_check.tile_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes in the Triton interpreter (CPU)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results/gpu; dry-run: bench/results)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for both phases (default %(default)s)")
    ap.add_argument("--suite", choices=sorted(SUITES), default="shared", help="shapes and candidates (see above)")
    ap.add_argument("--only-configs", default=None, help="comma-separated config names (AttentionConfig.short())")
    ap.add_argument("--only-shapes", default=None, help="comma-separated parts of shape names (e.g. mixed)")
    ap.add_argument("--compile-worker", default=None, help=argparse.SUPPRESS)  # child: "config:shape" index pairs
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    interpret = args.dry_run or args.device == "cpu"
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"  # before anything imports triton
    sys.path[1:1] = [str(ROOT)]
    ONLY.update(configs=args.only_configs and args.only_configs.split(","),
                shapes=args.only_shapes and args.only_shapes.split(","))
    from tests.memcheck import checked

    with checked():  # interpreted (dry-run) launches are bounds-checked as in the tests
        if args.compile_worker is not None:
            pairs = [tuple(int(x) for x in p.split(":")) for p in args.compile_worker.split(",") if p]
            return compile_worker(args.suite, pairs, args.device)
        return _sweep_main(args)


def _sweep_main(args) -> int:
    start = time.monotonic()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("tile sweep: no CUDA device here (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    from gpu_check.driver import _results_class, device_slug

    info = _results_class()()  # the device, versions and commit, as the GPU check names its files
    out_dir = Path(args.out) if args.out else BENCH / "results" / ("gpu" if not args.dry_run else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.suite == "shared" else "-" + args.suite
    out_csv = out_dir / f"{device_slug(info.device)}-{info.commit}-tiles{suffix}.csv"
    print(f"tile sweep ({args.suite}): {info.device}; {info.versions}; commit {info.commit}; "
          f"{len(configs_of(args.suite))} configs", flush=True)
    compile_all(args.suite, args.dry_run, 1 if args.dry_run else COMPILE_WORKERS,
                min(COMPILE_LIMIT_S, args.budget / 2))
    rows = sweep(args.suite, args.dry_run, out_csv, start + args.budget)
    print(f"\ntile sweep: {time.monotonic() - start:.0f} s; {out_csv}")
    for fam, ranked in sorted(ranking(rows).items()):
        print(f"{fam}: " + ", ".join(f"{name} {g:.3f} ({n})" for g, name, n in ranked[:6]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
