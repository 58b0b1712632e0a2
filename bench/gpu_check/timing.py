"""The GPU check's timing step (driver: driver.py): every provider under the same conditions.

Per shape (cases.timing_shapes), per provider: prepare (host planning, not timed), one run checked against the
fp32 reference (a wrong output is a failure and is not timed), capture into a CUDA graph and check a replay too, then
time the replay (L2 flushed and warm) and the eager call (L2 flushed) with measure.py's :class:`Timer`.
Providers: prefixattn, prefixattn ``sharing="never"``, prefixattn ``overlap=True`` (where it overlaps), prefixattn with
the matrix classes' Hopper build (``prefixattn-hopper``, where the plan has a shared or chunk class it serves),
prefixattn with
decode programs packing several KV heads (``prefixattn-kv-heads``, a few decode steps, where the tile packs more),
every FlashInfer configuration of bench/peers/flashinfer.py (the cascades are handed the batch's prefix groups:
oracle), torch SDPA on pre-gathered KV. ``flashinfer-best`` per shape is the fastest correct FlashInfer
configuration by graph-replayed flushed median, with the one it was.
prefixattn's work classes are each timed alone too, in a graph of their own.

Rows (benchmark ``attention_gpu_time``): per provider ``correct``, ``max_abs_err``, ``<policy>_us_min`` /
``<policy>_us_median`` for the policies of measure.POLICIES, ``over_floor_overlapped`` / ``over_floor_serial``
(headline median over each floor), ``unique_kv_gbps``, ``unique_gbps`` (the memory floor's bytes over the headline
time) and ``under_hbm_floor`` (faster than the HBM floor allows: read from L2); ``not_run`` (value 1, the reason in
``unit``) where a provider did not run; prefixattn's ``class_<name>_us_min`` / ``_median`` and ``classes_sum_us``,
and its plans' ``modeled_step_us`` and ``modeled_class_<name>_us`` (the cost model's, on the planning GPU) and
``kv_heads`` (KV heads per decode program);
provider ``floor``: ``floor_<kind>_us`` and ``best_unique_gbps`` (``is_best_unique_rate`` on the provider that
reached it); provider ``gpu-state``: clocks, temperature, power after the shape; ``flashinfer-best`` the best's
numbers and, on the peer that was best, ``is_flashinfer_best`` = 1.
"""

from __future__ import annotations

import time

from gpu_check.clock import Clock, failure

TIMING = "attention_gpu_time"
#: The policy every ratio and floor comparison uses (measure.py's docstring says why).
HEADLINE = "graph_flushed"
OURS = ("prefixattn", "prefixattn-nosharing", "prefixattn-overlap", "prefixattn-hopper", "prefixattn-kv-heads",
        "prefixattn-pdl")
#: Ours that time after the peers (the budget cuts a shape's providers from the tail, and the peers are the
#: comparison the check is for): the matrix classes' Hopper build (its classes alone too: the shared and chunk classes'
#: times beside the portable build's, prefixattn's), then the packed decode programs, then the launches chained by
#: PDL.
AFTER_PEERS = ("prefixattn-hopper", "prefixattn-kv-heads", "prefixattn-pdl")
#: ``prefixattn-overlap`` runs where its plan overlaps the classes (bench/peers/ours.py) on these scenarios only: a
#: decode step under a shared prefix overlaps too (its shared and decode launches), but the step's time budget goes
#: to the mixed steps, where the classes in series cost the most (docs/gpu-check.md).
OVERLAP_SCENARIOS = ("mixed",)
#: ``prefixattn-kv-heads`` (decode programs packing several KV heads; bench/peers/ours.py) runs on these decode steps
#: only (~1-2 s each and a compile per KV-head layout, in the step's budget): without sharing at GQA 32:4 and MHA,
#: short and long (where the programs' fixed cost weighs most and least), one under a shared prefix, and FlashInfer's
#: batch of 256 at GQA 32:8 (Llama-3-8B) and MHA.
KV_HEADS_SHAPES = ("dry-run:decode", "decode256:0/256/1", "decode32:0/2048/1", "decode256:256/2048/all",
                   "flashinfer:256/1024/128:gqa32/8", "flashinfer:256/1024/512:gqa32/8", "flashinfer:256/1024/128")
#: ``prefixattn-pdl`` (the step's launches chained by programmatic dependent launch; bench/peers/ours.py) runs on the
#: mixed steps (three launches) and on these decode steps under a shared prefix (two), where the gap between launches
#: and the last wave of the first weigh most: a short prefix, and FlashInfer's smallest shared grid shape (~1-2 s a
#: shape and a compile per class binary, in the step's budget).
PDL_SCENARIOS = ("mixed",)
PDL_DECODE_SHAPES = ("dry-run:decode", "decode32:256/2048/all", "flashinfer:64/1024/128:gqa32/8")
#: A correct provider this much faster than the HBM floor allows is flagged as reading from L2 (``under_hbm_floor``):
#: run-to-run spread of the graph-replayed medians stays within ~1-2% (bench/results/gpu/nvidia-h200-74e5177.csv,
#: min against median), so 3% is outside the noise.
L2_MARGIN = 0.03
#: A provider that did not run on a shape gets a row with this metric, its reason in the ``unit`` column (the CSV
#: schema has no text column): ``reason: <why>``, at most NOT_RUN_CHARS characters.
NOT_RUN, NOT_RUN_UNIT, NOT_RUN_CHARS = "not_run", "reason: ", 240


def providers() -> list[str]:
    """In the order a shape times them: :data:`AFTER_PEERS` last."""
    from peers.flashinfer import PEERS

    return [*(p for p in OURS if p not in AFTER_PEERS), *PEERS, "torch-sdpa", *AFTER_PEERS]


def _prepare(provider: str, batch, fi_ready: dict):
    """The provider's Prepared, or raise peers.flashinfer.Unavailable with the reason."""
    import peers.ours
    from peers.flashinfer import Unavailable
    from peers.flashinfer import prepare as prepare_flashinfer
    from peers.gpu import prepare_sdpa

    if provider == "prefixattn-overlap" and batch.shape.scenario not in OVERLAP_SCENARIOS:
        raise Unavailable(f"timed on {', '.join(OVERLAP_SCENARIOS)} steps only (the step's time budget)")
    if provider == "prefixattn-kv-heads" and batch.shape.paper not in KV_HEADS_SHAPES:
        raise Unavailable("timed on a few decode steps only (the step's time budget: timing.KV_HEADS_SHAPES)")
    if provider == "prefixattn-pdl":
        from gpu_check.correctness import PDL_VERDICT

        if batch.shape.scenario not in PDL_SCENARIOS and batch.shape.paper not in PDL_DECODE_SHAPES:
            raise Unavailable("timed on the mixed steps and a few decode steps only (the step's time budget: "
                              "timing.PDL_SCENARIOS, timing.PDL_DECODE_SHAPES)")
        if not PDL_VERDICT or not PDL_VERDICT[0]:
            raise Unavailable("its correctness cases " + (f"did not pass: {PDL_VERDICT[1]}" if PDL_VERDICT else
                                                          "did not run in this call (the correctness step checks "
                                                          "them first)"))
    if provider == "prefixattn-hopper":
        from gpu_check.correctness import HOPPER_VERDICT

        if not HOPPER_VERDICT or not HOPPER_VERDICT[0]:
            raise Unavailable("its correctness cases " + (f"did not pass: {HOPPER_VERDICT[1]}" if HOPPER_VERDICT else
                                                          "did not run in this call (the correctness step checks "
                                                          "them first, in a child process)"))
    if provider in OURS:
        return peers.ours.prepare(batch, provider)
    if provider == "torch-sdpa":
        return prepare_sdpa(batch)
    if provider not in fi_ready:
        raise Unavailable(fi_ready.get("_why", "its JIT warm-up did not report it ready"))
    if fi_ready[provider] is not True:
        raise Unavailable(f"its JIT warm-up failed: {fi_ready[provider]}"[:300])
    return prepare_flashinfer(batch, provider)


def _correct(out, want, dtype) -> tuple[bool, float]:
    import torch

    from tests.tolerances import ATTENTION_TOL

    atol, rtol = ATTENTION_TOL[dtype]
    err = (out.float() - want).abs()
    return bool(torch.isfinite(out.float()).all() and (err <= atol + rtol * want.abs()).all()), float(err.max())


def time_provider(provider, batch, want, label, floors, timer, results, fi_ready) -> dict | None:
    """Check, capture, check the replay, time. Returns ``{policy: {"min", "median"}}`` or None (skipped/failed)."""
    import torch

    from peers.flashinfer import Unavailable

    dry = timer.dry_run
    try:
        prepared = _prepare(provider, batch, fi_ready)
        out = prepared.result(prepared.run())
        if not dry:
            torch.cuda.synchronize()
    except Unavailable as exc:
        print(f"[timing]   {provider:28s} skipped: {exc}", flush=True)
        results.add(TIMING, provider, label, NOT_RUN, 1.0, f"{NOT_RUN_UNIT}{exc}"[:NOT_RUN_CHARS])
        return None
    except Exception as exc:  # one provider failing (OOM, a peer's error) does not end the step
        why = failure(exc)
        print(f"[timing]   {provider:28s} FAILED to run: {why}", flush=True)
        # Ours failing is a failure of the check; a peer failing on a shape is a column without numbers.
        results.add(TIMING, provider, label, "correct" if provider in OURS else "ran", 0.0, "bool")
        results.add(TIMING, provider, label, NOT_RUN, 1.0, f"{NOT_RUN_UNIT}failed: {why}"[:NOT_RUN_CHARS])
        return None
    ok, err = _correct(out, want, batch.q.dtype)
    results.add(TIMING, provider, label, "max_abs_err", err, "abs")
    for key, value in prepared.extra.items():
        if key in ("oracle_groups", "graph_mode"):
            results.add(TIMING, provider, label, key, value, "bool")
        elif key == "kv_heads":  # KV heads per decode program of the plan
            results.add(TIMING, provider, label, key, value, "count")
        elif key.startswith("modeled_"):  # the plan's modeled times (peers.ours.modeled_times), labelled so
            results.add(TIMING, provider, label, key, value, "us")
    if not ok:
        results.add(TIMING, provider, label, "correct", 0.0, "bool")
        print(f"[timing]   {provider:28s} WRONG output (max abs err {err:.2e}): not timed", flush=True)
        return None
    results.add(TIMING, provider, label, "correct", 1.0, "bool")
    graph_fn, why = None, "dry run: no CUDA graphs on CPU"
    if not dry:
        try:
            from gpu_check.measure import capture

            graph, static = capture(prepared.run)
        except Exception as exc:  # a peer that syncs or allocates outside the pool cannot be captured: say so
            graph, why = None, f"capture failed: {failure(exc)}"
            torch.cuda.synchronize()
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
            replay_ok, err = _correct(prepared.result(static), want, batch.q.dtype)
            # A wrong replay of prefixattn is a failure of the check; of a peer, a column without graph times.
            results.add(TIMING, provider, label, "graph_replay_correct" if provider not in OURS else "graph_correct",
                        float(replay_ok), "bool")
            graph_fn = graph.replay if replay_ok else None
            why = "" if replay_ok else f"the replay's output is wrong (max abs err {err:.2e})"
    results.add(TIMING, provider, label, "graph_captured", float(graph_fn is not None), "bool")
    runs = timer.runs_for(prepared.run)
    times = {"eager_flushed": timer.repeat(prepared.run, runs, flush=True)}
    if graph_fn is not None:
        times["graph_flushed"] = timer.repeat(graph_fn, runs, flush=True)
        times["graph_warm"] = timer.repeat(graph_fn, runs, flush=False)
    elif dry:  # the code path of the headline rows, on the eager call (labelled DRY RUN in the summary)
        times["graph_flushed"] = times["graph_warm"] = times["eager_flushed"]
    _rows(results, provider, label, times, floors, batch)
    head = times.get(HEADLINE)
    print(f"[timing]   {provider:28s} " + "  ".join(f"{p} {t['median']:9.1f} us" for p, t in times.items())
          + (f"  {head['median'] * 1e-6 / floors['overlapped']:5.2f}x overlapped floor" if head else
             f"  (no graph: {why})"), flush=True)
    if prepared.parts and (graph_fn is not None or dry):
        time_parts(prepared, timer, results, provider, label)
    return times


def time_parts(prepared, timer, results, provider: str, label: str) -> dict:
    """Each of ``prepared.parts`` (prefixattn: a work class) alone, in a CUDA graph of its own (eagerly in the dry
    run), L2 flushed, ``prepared.reset`` before every run: rows ``class_<name>_us_min`` / ``_median`` and
    ``classes_sum_us`` (the medians' sum, beside the whole call's time). Returns ``{name: {"min", "median"}}``."""
    from gpu_check.measure import capture

    reset, out = prepared.reset, {}
    for name, fn in prepared.parts.items():
        try:
            run = fn
            if not timer.dry_run:
                if reset is not None:
                    reset()
                run = capture(fn)[0].replay
            out[name] = timer.repeat(run, timer.runs_for(run, before=reset), flush=True, before=reset)
        except Exception as exc:  # noqa: BLE001 - a class that cannot be timed alone leaves the others' times
            print(f"[timing]     class {name} alone: FAILED: {failure(exc)}", flush=True)
            continue
        for stat in ("min", "median"):
            results.add(TIMING, provider, label, f"class_{name}_us_{stat}", out[name][stat], "us")
    if reset is not None:
        reset()  # the plan's next call starts from zeroed counters, as every call of a whole plan leaves them
    if out:
        results.add(TIMING, provider, label, "classes_sum_us", sum(t["median"] for t in out.values()), "us")
        print(f"[timing]     {provider} classes alone: " + ", ".join(f"{n} {t['median']:.1f} us"
                                                             for n, t in out.items()), flush=True)
    return out


def _rows(results, provider, label, times, floors, batch) -> None:
    for policy, t in times.items():
        for stat in ("min", "median"):
            results.add(TIMING, provider, label, f"{policy}_us_{stat}", t[stat], "us")
    head = times.get(HEADLINE)
    if head:
        seconds = head["median"] * 1e-6
        for kind in ("overlapped", "serial"):
            results.add(TIMING, provider, label, f"over_floor_{kind}", seconds / floors[kind], "x")
        results.add(TIMING, provider, label, "unique_kv_gbps", batch.unique_kv_bytes() / seconds / 1e9, "GB/s")
        results.add(TIMING, provider, label, "unique_gbps", floors["bytes"] / seconds / 1e9, "GB/s")
        results.add(TIMING, provider, label, "under_hbm_floor", float(under_hbm_floor(seconds, floors)), "bool")


def under_hbm_floor(seconds: float, floors: dict) -> bool:
    """Whether a correct provider beat the HBM floor's time by more than :data:`L2_MARGIN`: it read part of the
    shape's distinct bytes from L2 (or its own unique bytes are fewer than the floor counts)."""
    return seconds < (1.0 - L2_MARGIN) * floors["memory"]


def record_best_rate(results, label: str, timed: dict, floors: dict) -> tuple[str, float] | None:
    """The highest rate of the floor's distinct bytes any correct provider reached (headline policy): rows
    ``best_unique_gbps`` (provider ``floor``) and ``is_best_unique_rate`` on that provider."""
    heads = {p: t[HEADLINE]["median"] for p, t in timed.items() if t and HEADLINE in t}
    if not heads:
        return None
    name = min(heads, key=heads.get)
    rate = floors["bytes"] / (heads[name] * 1e-6) / 1e9
    results.add(TIMING, "floor", label, "best_unique_gbps", rate, "GB/s")
    results.add(TIMING, name, label, "is_best_unique_rate", 1.0, "bool")
    return name, rate


def record_best(results, label, timed: dict) -> tuple[str, dict] | None:
    """The fastest FlashInfer configuration of a shape by the headline policy: rows and (name, times)."""
    fi = {p: t for p, t in timed.items() if p.startswith("flashinfer") and t and HEADLINE in t}
    if not fi:
        return None
    name = min(fi, key=lambda p: fi[p][HEADLINE]["median"])
    results.add(TIMING, name, label, "is_flashinfer_best", 1.0, "bool")
    for policy, t in fi[name].items():
        for stat in ("min", "median"):
            results.add(TIMING, "flashinfer-best", label, f"{policy}_us_{stat}", t[stat], "us")
    return name, fi[name]


def step_timing(args, results, skips, device, ceil, fi_ready) -> None:
    import torch

    from batches.shapes import build_batch
    from gpu_check import cases
    from gpu_check.floors import shape_floors
    from gpu_check.measure import Timer, record_state
    from prefixattn import reference_attention

    clock = Clock("timing", skips)
    if "_why" in fi_ready:
        clock.skip(f"FlashInfer columns: {fi_ready['_why']}")
    timer = Timer(args.dry_run, device)
    shapes = cases.timing_shapes(args.dry_run)
    for i, shape in enumerate(shapes):
        if clock.expired([s.paper for s in shapes[i:]]):
            return
        label = f"{shape.paper} [{shape.name}]"
        start = time.monotonic()
        try:
            batch = build_batch(shape, device=device)
            want = reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.qo_indptr, batch.kv_lens,
                                       batch.block_table)
        except torch.cuda.OutOfMemoryError as exc:
            clock.skip(f"{label}: out of memory building the batch or its reference ({str(exc)[:120]})")
            continue
        floors = shape_floors(batch, ceil["hbm_bytes_per_s"], ceil["attention_flops_per_s"])
        for kind in ("memory", "compute", "overlapped", "serial"):
            results.add(TIMING, "floor", label, f"floor_{kind}_us", floors[kind] * 1e6, "us")
        print(f"[timing] {label}: floors memory {floors['memory'] * 1e6:.1f} us, compute {floors['compute'] * 1e6:.1f}"
              f" us", flush=True)
        timed = {}
        for provider in providers():
            if clock.left() <= 0:
                break
            timed[provider] = time_provider(provider, batch, want, label, floors, timer, results, fi_ready)
        best = record_best(results, label, timed)
        record_best_rate(results, label, timed, floors)
        state = record_state(results, TIMING, label) if not args.dry_run else {}
        print(f"[timing]   ({time.monotonic() - start:.1f} s; best FlashInfer: {best[0] if best else '-'}; "
              f"{state or 'no clock reading'})", flush=True)
        del batch, want
        if device == "cuda":
            torch.cuda.empty_cache()
