"""HBM bytes measured per kernel (GPU check step ``hbm_bytes``): Nsight Compute's DRAM counters on a subset of the
timing shapes, for each prefixattn work class and each FlashInfer configuration.

A child process (the driver with ``--hbm-bytes-child``) builds each shape of :data:`SHAPES`, prepares every provider
(prefixattn, each of its work classes alone, ``sharing="never"``, each FlashInfer configuration that takes the shape)
and runs each once unprofiled (compiles, module loads); then, between ``cudaProfilerStart`` and ``Stop``, it launches
a marker kernel (:data:`MARKER`) before each provider's one call. The parent runs the child under ``ncu
--profile-from-start off --clock-control none --cache-control all`` (caches flushed before every kernel: the L2 policy
of the timing step's headline) with the metrics of :data:`METRICS`, splits the kernel rows at the markers and sums
each provider's kernels. Rows (benchmark ``hbm_bytes``), per shape and provider: ``dram_read_bytes``,
``dram_write_bytes``, ``kernels``, ``read_over_unique`` (DRAM reads / the shape's distinct KV + q bytes); provider
``floor``: ``unique_bytes``; prefixattn also ``tile_kv_load_bytes`` (the KV bytes its tiles load into the SM, the
plan's count) beside what DRAM served of them. Where ncu is missing or cannot read the counters the step is skipped
with ncu's own words. The dry run runs the child's sequence in-process, without ncu (no counters on a CPU).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import tempfile
import time

BENCHMARK = "hbm_bytes"
#: Shapes measured (timing-shape labels, cases.timing_shapes): the GQA shape whose tiles load 8.5x its distinct KV
#: (compute-bound: do its bytes come from L2?), a long-prefix decode step, the no-sharing decode step that pays the
#: per-program tax, the mixed step POD wins, and a FlashInfer-grid decode step at GQA 32:8.
SHAPES = ("decode256:32768/128/256 [decode/256d/32768-128-all/h32:4/d128]",
          "decode256:8192/128/64 [decode/256d/8192-128-64/h32:4/d128]",
          "decode256:0/256/1 [decode/256d/0-256-1/h32:32/d128]",
          "mixed256:256/2048/all [mixed/7p+256d/256-2048-all/h32:32/d128]",
          "flashinfer:64/8192/512:gqa32/8 [decode/64d/8192-512-all/h32:8/d128]")
#: Nsight Compute metrics: DRAM bytes read and written, kernel duration.
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
#: The marker kernel's name: ncu lists it like any kernel; every row after one belongs to the provider it announces.
MARKER = "prefixattn_ncu_marker"
#: Units Nsight Compute may print (``--print-units base`` asks for the base ones; the others are scaled here).
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3,
         "second": 1.0}
#: Where the child writes its sequence of (shape, provider) announcements (the parent reads it after ncu exits).
SEQUENCE_ENV = "PREFIXATTN_HBM_BYTES_SEQUENCE"


def _marker_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def prefixattn_ncu_marker(x_ptr):  # [1] int32 out: a store, so the launch is not optimized away
        tl.store(x_ptr, tl.program_id(0))

    return prefixattn_ncu_marker


def _shapes(dry_run: bool) -> list:
    from gpu_check import cases

    shapes = cases.timing_shapes(dry_run)
    if dry_run:
        return shapes
    by_label = {f"{s.paper} [{s.name}]": s for s in shapes}
    return [by_label[label] for label in SHAPES if label in by_label]


def _providers(batch) -> tuple[dict, int]:
    """(``{provider: run}``, prefixattn's tile KV load bytes) for one batch: prefixattn whole and each work class alone
    (``prefixattn:<class>``, its merge counters reset first), ``sharing="never"``, every FlashInfer configuration that
    takes the batch (those that do not are left out)."""
    import peers.ours
    from peers.flashinfer import PEERS, Unavailable
    from peers.flashinfer import prepare as prepare_flashinfer

    ours = peers.ours.prepare(batch, "prefixattn")
    runs = {"prefixattn": ours.run, **{f"prefixattn:{name}": _after(ours.reset, fn) for name, fn in ours.parts.items()},
            "prefixattn-nosharing": peers.ours.prepare(batch, "prefixattn-nosharing").run}
    for name in PEERS:
        try:
            runs[name] = prepare_flashinfer(batch, name).run
        except Unavailable:
            continue
    return runs, ours.extra["tile_kv_load_bytes"]


def _after(reset, fn):
    """``fn`` preceded by ``reset`` (when there is one)."""
    if reset is None:
        return fn

    def run():
        reset()
        return fn()

    return run


def child(mode: str) -> int:
    """The profiled process: every shape's providers once unprofiled, then each once after a marker, profiled."""
    import torch

    from batches.shapes import build_batch

    dry = mode == "dry"
    device = "cpu" if dry else "cuda"
    marker, flag = _marker_kernel(), torch.zeros(1, dtype=torch.int32, device=device)
    sequence, extra = [], {}
    work = []
    for shape in _shapes(dry):
        label = f"{shape.paper} [{shape.name}]"
        batch = build_batch(shape, device=device)
        runs, tile_bytes = _providers(batch)
        extra[label] = dict(unique_bytes=batch.unique_kv_bytes() + batch.q.numel() * batch.q.element_size(),
                            tile_kv_load_bytes=tile_bytes)
        for fn in runs.values():
            fn()  # compiles, loads modules, first allocations: outside the profiled range
        work.append((label, batch, runs))
    if not dry:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    for label, _, runs in work:
        for provider, fn in runs.items():
            marker[(1,)](flag)
            fn()
            sequence.append((label, provider))
    if not dry:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    path = os.environ.get(SEQUENCE_ENV)
    if path:
        with open(path, "w") as f:
            json.dump(dict(sequence=sequence, extra=extra), f)
    return 0


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernel rows of ``ncu --csv --page raw``: ``[{"name", metric: value in base units}]`` in launch order. A second
    row of units (ncu prints one under the header) scales the values; thousands separators are dropped."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]  # ncu's own ==PROF== lines are not CSV
    rows = list(csv.reader(lines))
    if not rows:
        return []
    header, body = rows[0], rows[1:]
    units, id_col = {}, header.index("ID") if "ID" in header else 0
    if body and not body[0][id_col].strip().isdigit():
        units = dict(zip(header, body[0]))
        body = body[1:]
    out = []
    for r in body:
        cells = dict(zip(header, r))
        row = {"name": cells.get("Kernel Name", "")}
        for metric in METRICS:
            raw = cells.get(metric, "").replace(",", "").strip()
            try:
                row[metric] = float(raw) * UNITS.get(units.get(metric, ""), 1.0)
            except ValueError:
                row[metric] = None  # "n/a": the counter was not read for this kernel
        out.append(row)
    return out


def attribute(kernels: list[dict], sequence: list) -> dict:
    """``{(shape, provider): {"read", "write", "seconds", "kernels"}}``: the rows between the i-th marker and the
    next belong to ``sequence[i]``. Raises ValueError when the markers and the sequence disagree."""
    groups, current = [], None
    for k in kernels:
        if MARKER in k["name"]:
            current = []
            groups.append(current)
        elif current is not None:
            current.append(k)
    if len(groups) != len(sequence):
        raise ValueError(f"ncu rows: expected {len(sequence)} markers (one per provider run), got {len(groups)}")
    out = {}
    for key, rows in zip(sequence, groups):
        values = [(r["dram__bytes_read.sum"], r["dram__bytes_write.sum"], r["gpu__time_duration.sum"]) for r in rows]
        if any(v is None for row in values for v in row):
            continue  # a counter not read: no number rather than a partial sum
        out[tuple(key)] = dict(read=sum(v[0] for v in values), write=sum(v[1] for v in values),
                               seconds=sum(v[2] for v in values), kernels=len(rows))
    return out


def step_hbm_bytes(args, results, skips, driver, which, fi_ready: dict) -> None:
    """Run the child under ncu (the dry run: in-process, no counters) and record the rows."""
    from gpu_check.clock import Clock

    clock = Clock("hbm_bytes", skips)
    if args.dry_run:
        child("dry")
        return clock.skip("dry run: no DRAM counters on a CPU (the child's sequence ran in-process, unprofiled)")
    ncu = which("ncu")
    if ncu is None:
        return clock.skip("ncu (Nsight Compute) not found on PATH or in /usr/local/cuda/bin")
    with tempfile.TemporaryDirectory() as tmp:
        log, seq = os.path.join(tmp, "ncu.csv"), os.path.join(tmp, "sequence.json")
        cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "all", "--metrics",
               ",".join(METRICS), "--csv", "--page", "raw", "--print-units", "base", "--log-file", log,
               *driver, "--hbm-bytes-child", "gpu"]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, clock.left()),
                                  env=dict(os.environ, **{SEQUENCE_ENV: seq}))
        except subprocess.TimeoutExpired:
            return clock.skip(f"ncu did not finish within {clock.left():.0f} s")
        text = open(log).read() if os.path.exists(log) else ""
        if proc.returncode != 0 or not os.path.exists(seq):
            tail = (proc.stdout + proc.stderr + text).strip().splitlines()[-8:]
            return clock.skip(f"ncu exited {proc.returncode}: the counters were not read ({' | '.join(tail)})"[:600])
        done = json.load(open(seq))
    try:
        measured = attribute(parse_ncu_csv(text), done["sequence"])
    except ValueError as exc:
        return clock.skip(f"ncu's rows could not be attributed: {exc}")
    print(f"[hbm_bytes] ncu: {len(measured)} provider runs measured ({time.monotonic() - start:.0f} s)", flush=True)
    _record(results, measured, done["extra"])


def _record(results, measured: dict, extra: dict) -> None:
    for label, info in extra.items():
        results.add(BENCHMARK, "floor", label, "unique_bytes", info["unique_bytes"], "bytes")
        results.add(BENCHMARK, "prefixattn", label, "tile_kv_load_bytes", info["tile_kv_load_bytes"], "bytes")
    for (label, provider), m in measured.items():
        unique = extra[label]["unique_bytes"]
        for metric, value, unit in (("dram_read_bytes", m["read"], "bytes"), ("dram_write_bytes", m["write"], "bytes"),
                                    ("kernels", m["kernels"], "count"), ("read_over_unique", m["read"] / unique, "x"),
                                    ("profiled_us", m["seconds"] * 1e6, "us")):
            results.add(BENCHMARK, provider, label, metric, value, unit)
        print(f"[hbm_bytes]   {label.split(' [')[0]:32s} {provider:28s} read {m['read'] / 1e6:10.1f} MB "
              f"({m['read'] / unique:5.2f}x distinct), written {m['write'] / 1e6:8.1f} MB, {m['kernels']} kernels",
              flush=True)
