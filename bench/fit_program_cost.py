"""Fit the fused kernel's program-cost model to the committed H100 tile sweeps: the numbers behind
``prefixattn/autotune/configs/<target>.program_cost.json`` (:mod:`prefixattn.autotune.program_cost`).

    python bench/fit_program_cost.py             # fit, print the error per binary, write the JSON
    python bench/fit_program_cost.py --check     # fit and compare with the committed JSON (exit 1 if it differs)

The model: a launch runs its programs (work item x KV head) in table order on ``SMs x occupancy`` slots, each program
taking the next free slot (list scheduling); a program costs a fixed time (one per item kind) plus a time per KV
tile it reads (per binary: its tile, warps and stages, hence its occupancy), plus a constant per launch that holds
what the measurement adds around the kernel (host dispatch for an eager ``do_bench``, the graph launch for a
replay). The makespan of the slot that finishes last is a sum of its programs' costs, linear in the parameters for
a fixed schedule: the fit alternates a least-squares solve of the relative error with a new schedule until the
parameters stop moving.

The measurements are of the kernel as it was at each sweep's commit (one binary for shared and suffix items, the
old item order and split rule), so the work lists and occupancies are rebuilt there: the script checks each sweep's
commit out into a temporary git worktree and runs itself there (``--dump``), planning every row of the sweep on the
CPU and compiling the binaries it ran for sm_90 (Triton's compiler and ptxas, no GPU). Each fused binary's
shared-item costs are the shared class's (the same tiles and warps as one class's launch today), and each
suffix-only binary's costs are those of a chunk or decode class with its tiles.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results" / "gpu"
SLUG = "nvidia-h100-80gb-hbm3"
#: The sweeps: (suite, commit the sweep ran, CSV, how it timed). The shared suite timed eager ``do_bench`` (L2
#: flushed, host dispatch inside the window); the plain suite CUDA-graph replays.
SWEEPS = (("shared", "82be9f2", f"{SLUG}-82be9f2-tiles.csv", "eager"),
          ("plain", "cb8f3ad", f"{SLUG}-cb8f3ad-tiles-plain.csv", "graph"))
#: Held-out check: the GPU check's timing shapes at this commit, CUDA-graph replays of its fused kernel (not used by
#: the fit), against the model of that commit's plans under the fitted costs of the binaries it ran.
VALIDATION = ("ba41bb7", f"{SLUG}-ba41bb7.csv")
TARGET = "sm90"
NUM_SMS = 132
#: The sweeps' kernels: fp16, head_dim 128 (gpu_check/tile_sweep.py).
HEAD_DIM, DTYPE = 128, "fp16"
#: Rows faster than this measured the host more than the kernel (eager launches of tiny shapes): left out of the fit.
MIN_MEASURED_US = 60.0
#: H100 SXM per SM: 64 Ki registers, 228 KiB shared memory (1 KiB of it reserved per program), 2048 threads.
REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED, THREADS_PER_SM, REG_ALLOC_UNIT = 65536, 233472, 1024, 2048, 256
FIT_ITERATIONS = 40
#: Suffix tiles of at most this many lanes are decode-class binaries: fitted on decode steps only (prefill chunks in
#: 16-lane tiles re-read their KV from L2, tile after tile: another cost than the decode class ever sees).
DECODE_TILE_MAX_M = 32


def _decode_shape(shape: str) -> bool:
    """A sweep shape of decodes only (``decode32:...``, ``plain-decode128:...``, ``flashinfer:...``)."""
    return shape.startswith(("decode", "plain-decode", "flashinfer:"))
OUT = ROOT / "prefixattn" / "autotune" / "configs" / f"{TARGET}.program_cost.json"


def occupancy(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Resident programs per H100 SM of a binary (registers allocated per warp in units of 256)."""
    per_warp = -(-registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = REGS_PER_SM // (per_warp * num_warps)
    by_smem = SMEM_PER_SM // (shared_bytes + SMEM_RESERVED)
    return max(1, min(by_regs, by_smem, THREADS_PER_SM // (32 * num_warps)))


# ---------------------------------------------------------------------------------------------------------------
# --dump: runs inside a checkout of the sweep's commit
# ---------------------------------------------------------------------------------------------------------------

def dump(suite: str, csv_name: str, out: Path) -> None:
    """Plan every row of the sweep and compile every binary it ran (this checkout's kernel): pickle of ``rows``
    (suite, shape, config, has_shared, item kinds and KV lengths in table order, KV heads) and ``binaries``."""
    os.environ["TRITON_INTERPRET"] = "1"
    tree = Path.cwd()  # the sweep's checkout (evidence() runs this there)
    sys.path[:0] = [str(tree / "bench"), str(tree)]
    import torch

    # The checkout's own modules, by their names then (bench/ was flat: bench/gpu_tile_sweep.py, bench/shapes.py).
    import gpu_tile_sweep
    import prefixattn
    from prefixattn.autotune.lookup import fixed_config
    from prefixattn.kernels import layout as K
    from shapes import build_batch

    # The sweep's own candidates and shapes (its first version had one suite and no SUITES table).
    suites = getattr(gpu_tile_sweep, "SUITES", {"shared": (gpu_tile_sweep.candidates, gpu_tile_sweep.shapes)})
    configs = {c.short(): c for c in suites[suite][0]()}
    shapes = {f"{s.paper} h{s.num_qo_heads}:{s.num_kv_heads}": s for s in suites[suite][1](False)}
    rows, batch, used = [], None, set()
    for r in csv.DictReader((RESULTS / csv_name).open()):
        s = shapes[r["shape"]]
        if batch is None or batch.shape != s:
            batch = build_batch(s, metadata_only=True)
        with fixed_config(configs[r["config"]]):
            p = prefixattn.plan(batch.qo_indptr, batch.kv_lens, batch.block_table, block_size=s.block_size,
                                num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                q_dtype=torch.float16, num_blocks=batch.num_blocks, num_sms=NUM_SMS)
        it = p.work.items.astype(np.int64)
        if r.get("items") and int(r["items"]) != p.num_items:
            raise RuntimeError(f"{r['shape']} {r['config']}: {p.num_items} items planned, the sweep had {r['items']}")
        rows.append(dict(suite=suite, shape=r["shape"], config=r["config"], has_shared=bool(p.has_shared),
                         us=float(r["median_us"]) if r["median_us"] else None, kv_heads=s.num_kv_heads,
                         kind=it[:, K.ITEM_KIND].astype(np.int8),
                         kv=(it[:, K.ITEM_KV_END] - it[:, K.ITEM_KV_START]).astype(np.int32)))
        used.add((r["config"], bool(p.has_shared)))
    pickle.dump(dict(rows=rows, binaries=_compile(configs, used)), out.open("wb"))


def dump_validation(csv_name: str, out: Path) -> None:
    """Plan the GPU check's timing shapes as the checkout planned them for an H100 (its sm90 tables): pickle of rows
    (label, config, has_shared, item kinds and KV lengths, KV heads, measured graph-replay microseconds)."""
    os.environ["TRITON_INTERPRET"] = "1"
    tree = Path.cwd()
    sys.path[:0] = [str(tree / "bench"), str(tree)]
    import torch

    # The checkout's own modules, by their names then (bench/ was flat: bench/gpu_cases.py, bench/shapes.py).
    import gpu_cases
    import prefixattn
    from prefixattn.autotune.config_space import AttentionConfig, Tiles
    from prefixattn.autotune.lookup import planning_target
    from prefixattn.kernels import layout as K
    from shapes import build_batch

    measured = {}  # by the GPU check's label, "<paper> [<shape name>]" (the name tells the head counts apart)
    for r in csv.DictReader((RESULTS / csv_name).open()):
        if r["provider"] == "prefixattn" and r["metric"] == "time_us_cudagraph":
            measured[r["shape"]] = float(r["value"])
    rows = []
    for s in gpu_cases.timing_shapes(False):
        label = s.paper + ("" if s.num_qo_heads == s.num_kv_heads else f" h{s.num_qo_heads}:{s.num_kv_heads}")
        us = measured.get(f"{s.paper} [{s.name}]")
        if us is None:
            continue
        batch = build_batch(s, metadata_only=True)
        with planning_target(TARGET):
            p = prefixattn.plan(batch.qo_indptr, batch.kv_lens, batch.block_table, block_size=s.block_size,
                                num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                q_dtype=torch.float16, num_blocks=batch.num_blocks, num_sms=NUM_SMS)
        t = p.tiles
        config = AttentionConfig(Tiles(t.block_m_shared, t.block_n_shared), Tiles(t.block_m_suffix, t.block_n_suffix),
                                 t.launch_shared, t.launch_suffix)
        it = p.work.items.astype(np.int64)
        rows.append(dict(shape=label, config=config, has_shared=bool(p.has_shared), kv_heads=s.num_kv_heads,
                         us=us, kind=it[:, K.ITEM_KIND].astype(np.int8),
                         kv=(it[:, K.ITEM_KV_END] - it[:, K.ITEM_KV_START]).astype(np.int32)))
    pickle.dump(rows, out.open("wb"))


def _compile(configs: dict, used: set) -> dict:
    """``(config, has_shared) -> registers, shared bytes, warps`` of the binaries the rows ran (sm_90)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from prefixattn.tuning.compile_check import _worker_init, compile_one
    from prefixattn.tuning.compile_specs import fused_job
    from prefixattn.autotune.targets import get_target

    target = get_target(TARGET)
    keys = sorted(used)
    # The workers import the package (and its kernels) before their initializer runs: compile, not interpret.
    os.environ["TRITON_INTERPRET"] = "0"
    jobs = [fused_job(target=target, dtype=DTYPE, head_dim=HEAD_DIM, config=configs[name], variant="decode",
                      has_lse=False, has_shared=has_shared) for name, has_shared in keys]
    with ProcessPoolExecutor(2, mp_context=get_context("spawn"), initializer=_worker_init) as pool:
        records = list(pool.map(compile_one, jobs))
    out = {}
    for key, rec in zip(keys, records):
        if not rec.get("ok"):
            raise RuntimeError(f"{key}: {rec.get('error')}")
        out[key] = dict(registers=rec["registers"], shared_bytes=rec["shared_bytes"],
                        num_warps=rec["options"]["num_warps"], num_stages=rec["options"]["num_stages"])
    return out


def evidence(suite: str, commit: str, csv_name: str, cache: Path):
    """:func:`dump` of one sweep (``suite`` ``"validation"``: :func:`dump_validation`), run in a temporary worktree
    of ``commit`` (cached in ``cache``)."""
    path = cache / f"{suite}-{commit}.pkl"
    if not path.exists():
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True,
                           capture_output=True)
            try:
                env = {**os.environ, "PYTHONPATH": str(tree)}
                subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dump", suite, csv_name, str(path)],
                               cwd=tree, env=env, check=True)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
    return pickle.load(path.open("rb"))


# ---------------------------------------------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------------------------------------------

def _tiles(config: str) -> tuple[int, int, int, int]:
    return tuple(int(x) for x in re.match(r"sh(\d+)x(\d+)_sf(\d+)x(\d+)", config).groups())


def _schedule(dur: np.ndarray, slots: int) -> tuple[float, np.ndarray]:
    """List scheduling in program order: the makespan and a mask of the programs on the slot that ends last."""
    end, slot_of, last = _list_schedule(np.ascontiguousarray(dur, dtype=np.float64), slots)
    return end, slot_of == last


def _list_schedule_py(dur: np.ndarray, slots: int):
    import heapq

    heap = [(0.0, s) for s in range(slots)]
    slot_of = np.empty(dur.shape[0], dtype=np.int64)
    for i, d in enumerate(dur.tolist()):
        t, s = heapq.heappop(heap)
        slot_of[i] = s
        heapq.heappush(heap, (t + d, s))
    end, last = max(heap)
    return end, slot_of, last


try:  # the bench extra has numba: ~50x faster than heapq over the ~900 rows x fit iterations
    from numba import njit

    @njit(cache=True)
    def _list_schedule(dur, slots):
        free = np.zeros(slots)
        slot_of = np.empty(dur.shape[0], dtype=np.int64)
        for i in range(dur.shape[0]):
            s = np.argmin(free)  # the first free slot (ties to the lowest index, as the heap's)
            free[s] += dur[i]
            slot_of[i] = s
        last = np.argmax(free)
        return free[last], slot_of, last
except ImportError:
    _list_schedule = _list_schedule_py


def binary_name(kind: str, block_m: int, block_n: int, num_warps: int, num_stages: int) -> str:
    """A binary's key in the JSON: its item kind, tile and launch (``shared 128x64 w8 s3``)."""
    return f"{kind} {block_m}x{block_n} w{num_warps} s{num_stages}"


def fit_joint(groups: dict, occupancy_of: dict, block_n_of: dict) -> tuple[dict, dict]:
    """One least-squares fit over every group (a binary and the rows that ran it): the fixed cost of a program is
    one per item kind (shared, suffix) over all binaries (a program start and its epilogue; per binary the sweeps
    cannot tell it from the launch constant), the cost per KV tile one per (binary, kind), and each group has one
    constant per timing method. Returns ``(parameters, errors per group)``: ``parameters["fixed"]`` (shared,
    suffix), ``["tile"][group]`` (shared, suffix) and ``["const"][group][timing]``."""
    from prefixattn.autotune.program_cost import residency

    keys = sorted(groups)
    timings = {k: sorted({r["timing"] for r in groups[k]}) for k in keys}
    col, n = {}, 2  # 0, 1: fixed cost of a shared / suffix program
    for k in keys:
        col[k] = n
        n += 2 + len(timings[k])  # tile (shared, suffix), one constant per timing
    rows, progs = [], []
    for k in keys:
        occ = occupancy_of[k]
        for r in groups[k]:
            kind = np.repeat(r["kind"], r["kv_heads"])
            bn = np.where(kind == 0, block_n_of[k][0], block_n_of[k][1])
            share = residency(kind.shape[0], num_sms=NUM_SMS, slots_per_sm=occ) / occ
            tiles = -(-np.repeat(r["kv"].astype(np.int64), r["kv_heads"]) // bn) * share
            rows.append((k, r))
            progs.append((kind == 0, tiles))
    theta = np.full(n, 1.0)
    theta[:2] = 5.0
    for _ in range(FIT_ITERATIONS):
        x = np.zeros((len(rows), n))
        for i, ((k, r), (sh, tiles)) in enumerate(zip(rows, progs)):
            c = col[k]
            dur = np.where(sh, theta[0] + theta[c] * tiles, theta[1] + theta[c + 1] * tiles)
            _, chain = _schedule(dur, NUM_SMS * occupancy_of[k])
            x[i, 0], x[i, 1] = (chain & sh).sum(), (chain & ~sh).sum()
            x[i, c], x[i, c + 1] = (tiles * (chain & sh)).sum(), (tiles * (chain & ~sh)).sum()
            x[i, c + 2 + timings[k].index(r["timing"])] = 1.0
            x[i] /= r["us"]
        used = x.any(axis=0)
        solved = np.zeros_like(theta)
        solved[used] = np.maximum(np.linalg.lstsq(x[:, used], np.ones(len(rows)), rcond=None)[0], 0.0)
        if np.allclose(solved, theta, rtol=1e-4, atol=1e-6):
            break
        theta = 0.5 * theta + 0.5 * solved
    errors: dict = {k: [] for k in keys}
    for (k, r), (sh, tiles) in zip(rows, progs):
        c = col[k]
        span, _ = _schedule(np.where(sh, theta[0] + theta[c] * tiles, theta[1] + theta[c + 1] * tiles),
                            NUM_SMS * occupancy_of[k])
        errors[k].append((span + theta[c + 2 + timings[k].index(r["timing"])]) / r["us"] - 1.0)
    params = dict(fixed=(float(theta[0]), float(theta[1])),
                  tile={k: (float(theta[col[k]]), float(theta[col[k] + 1])) for k in keys},
                  const={k: dict(zip(timings[k], theta[col[k] + 2:col[k] + 2 + len(timings[k])].tolist()))
                         for k in keys})
    return params, errors


def fit(evidences: list[dict]) -> dict:
    """Per binary of the sweeps: its fitted costs, occupancy and fit error."""
    from prefixattn.autotune.config_space import AttentionConfig

    sys.path.insert(0, str(BENCH))
    from gpu_check import tile_sweep

    configs = {c.short(): c for suite in tile_sweep.SUITES for c in tile_sweep.SUITES[suite][0]()}
    groups: dict = {}
    binaries: dict = {}
    for ev, (_, _, _, timing) in zip(evidences, SWEEPS):
        binaries.update(ev["binaries"])
        for r in ev["rows"]:
            if r["us"] is None or r["us"] < MIN_MEASURED_US:
                continue
            cfg: AttentionConfig = configs[r["config"]]
            lo = cfg.launch_for(r["has_shared"])
            if r["has_shared"]:  # the fused binary: its shared part is a shared class's binary
                key = ("fused", r["config"])
            else:  # a suffix-only binary, whichever config named it (a decode-class one on decode steps only)
                if cfg.suffix.block_m <= DECODE_TILE_MAX_M and not _decode_shape(r["shape"]):
                    continue
                key = ("suffix", binary_name("suffix", cfg.suffix.block_m, cfg.suffix.block_n, lo.num_warps,
                                             lo.num_stages))
            groups.setdefault(key, []).append(dict(r, timing=timing, binary=(r["config"], r["has_shared"])))
    occupancy_of, block_n_of = {}, {}
    for key, rows in groups.items():
        b = binaries[rows[0]["binary"]]
        occupancy_of[key] = occupancy(b["registers"], b["shared_bytes"], b["num_warps"])
        cfg = configs[rows[0]["config"]]
        block_n_of[key] = (cfg.shared.block_n, cfg.suffix.block_n)
    params, errors = fit_joint(groups, occupancy_of, block_n_of)
    fit.last = (params, occupancy_of, block_n_of)  # for validate()
    out = {}
    for (what, name), rows in sorted(groups.items()):
        key = (what, name)
        b = binaries[rows[0]["binary"]]
        cfg = configs[rows[0]["config"]]
        err = np.asarray(errors[key])
        stats = dict(rows=len(rows), rms_error=round(float(np.sqrt(np.mean(err ** 2))), 4),
                     max_error=round(float(np.max(np.abs(err))), 4))
        common = dict(slots_per_sm=occupancy_of[key], registers=b["registers"], shared_bytes=b["shared_bytes"],
                      **stats)
        if what == "fused":
            lo = cfg.launch
            entry_key = binary_name("shared", cfg.shared.block_m, cfg.shared.block_n, lo.num_warps, lo.num_stages)
            entry = dict(fixed_us=round(params["fixed"][0], 3), tile_us=round(params["tile"][key][0], 4),
                         block_n=cfg.shared.block_n, measured_as=f"fused {name}", **common)
        else:
            entry_key = name
            entry = dict(fixed_us=round(params["fixed"][1], 3), tile_us=round(params["tile"][key][1], 4),
                         block_n=cfg.suffix.block_n, measured_as="suffix-only", **common)
        # Two configs with the same shared binary: keep the better-determined fit (more rows, then lower error).
        old = out.get(entry_key)
        if old is None or (entry["rows"], -entry["rms_error"]) > (old["rows"], -old["rms_error"]):
            out[entry_key] = entry
    return out


def validate(rows: list[dict], params: dict, occupancy_of: dict, block_n_of: dict) -> dict:
    """The fit's error on the held-out measurements (:data:`VALIDATION`): per shape whose binary the sweeps
    measured, the model of that commit's plan (the fused binary's fitted costs; the median fitted graph-replay
    constant) against its measured graph replay."""
    graph_const = float(np.median([c["graph"] for c in params["const"].values() if "graph" in c]))
    out = {}
    for r in rows:
        cfg = r["config"]
        lo = cfg.launch_for(r["has_shared"])
        key = ("fused", cfg.short()) if r["has_shared"] else (
            "suffix", binary_name("suffix", cfg.suffix.block_m, cfg.suffix.block_n, lo.num_warps, lo.num_stages))
        if key not in params["tile"] or r["us"] is None:
            continue
        occ = occupancy_of[key]
        kind = np.repeat(r["kind"], r["kv_heads"])
        bn = np.where(kind == 0, cfg.shared.block_n, cfg.suffix.block_n)
        from prefixattn.autotune.program_cost import residency

        share = residency(kind.shape[0], num_sms=NUM_SMS, slots_per_sm=occ) / occ
        tiles = -(-np.repeat(r["kv"].astype(np.int64), r["kv_heads"]) // bn) * share
        tile_sh, tile_sf = params["tile"][key]
        dur = np.where(kind == 0, params["fixed"][0] + tile_sh * tiles, params["fixed"][1] + tile_sf * tiles)
        span, _ = _schedule(dur, NUM_SMS * occ)
        modeled = span + graph_const
        out[r["shape"]] = dict(measured_us=round(r["us"], 1), modeled_us=round(modeled, 1),
                               error=round(modeled / r["us"] - 1.0, 4),
                               binary=key[1] if key[0] == "suffix" else f"fused {key[1]}")
    return out


def document(binaries: dict, validation: dict, graph_const: float) -> dict:
    errors = [b["rms_error"] for b in binaries.values()]
    held_out = np.array([v["error"] for v in validation.values()])
    return {
        "format": 1, "target": TARGET, "head_dim": HEAD_DIM, "dtype": DTYPE, "num_sms": NUM_SMS,
        "sources": [f"bench/results/gpu/{csv_name} ({timing}, commit {commit})"
                    for _, commit, csv_name, timing in SWEEPS],
        "model": ("program = fixed_us + tile_us x KV tiles of block_n x residency; list-scheduled on num_sms x "
                  "slots_per_sm (prefixattn.autotune.program_cost)"),
        "rms_error_median": round(float(np.median(errors)), 4),
        "binaries": dict(sorted(binaries.items())),
        "validation": {
            "source": f"bench/results/gpu/{VALIDATION[1]} (CUDA-graph replays, commit {VALIDATION[0]}; not fitted)",
            "graph_launch_us": round(graph_const, 2),
            "rms_error": round(float(np.sqrt(np.mean(held_out ** 2))), 4) if held_out.size else None,
            "shapes": validation,
        },
    }


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="bench/fit_program_cost.py", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed JSON instead of writing it")
    ap.add_argument("--cache", default=None, help="folder for the rebuilt work lists (default: a temporary one)")
    ap.add_argument("--dump", nargs=3, metavar=("SUITE", "CSV", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dump:
        if args.dump[0] == "validation":
            dump_validation(args.dump[1], Path(args.dump[2]))
        else:
            dump(args.dump[0], args.dump[1], Path(args.dump[2]))
        return 0
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(args.cache) if args.cache else Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        evidences = [evidence(suite, commit, csv_name, cache) for suite, commit, csv_name, _ in SWEEPS]
        held_out = evidence("validation", *VALIDATION, cache)
    binaries = fit(evidences)
    params, occupancy_of, block_n_of = fit.last
    validation = validate(held_out, params, occupancy_of, block_n_of)
    doc = document(binaries, validation, float(np.median([c["graph"] for c in params["const"].values()
                                                           if "graph" in c])))
    print(f"{'binary':24s} {'slots':>5s} {'fixed us':>9s} {'us/tile':>8s} {'rows':>5s} {'rms':>6s} {'max':>6s}  "
          "(modeled from the H100 sweeps)")
    for name, b in doc["binaries"].items():
        print(f"{name:24s} {b['slots_per_sm']:5d} {b['fixed_us']:9.2f} {b['tile_us']:8.3f} {b['rows']:5d} "
              f"{b['rms_error']:6.1%} {b['max_error']:6.1%}")
    v = doc["validation"]
    print(f"held out: {len(v['shapes'])} GPU-check shapes at {VALIDATION[0]} (graph replays), model error "
          f"{v['rms_error']:.1%} rms (modeled)")
    text = json.dumps(doc, indent=1) + "\n"
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("the committed fit is current" if same else f"{OUT} differs from this fit")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
