"""The GPU check's report: the summary markdown next to its CSV, and the README's performance section regenerated
from a CSV (:func:`main`: ``python bench/gpu_report.py bench/results/gpu/<gpu>-<commit>.csv [--steps
...-model-steps.json]``).

The fair columns: prefixattn against FlashInfer's best configuration for the shape, both graph-replayed with the L2
flushed (bench/gpu_check/measure.py says why that policy); each against both floors (bench/gpu_check/floors.py);
warm-L2 and eager times beside them; the model step's speedup over FlashInfer without sharing (what vLLM runs). Every
shape or step where prefixattn is slower is listed under "Where prefixattn loses". With ``--steps``, the simulator's
calibration (prefixattn/sim/fit.py) is appended.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from render.table import fixed, head, index, ratio_cell, read_rows

TIMING, MODEL, MLA, MLA_PREFILL = "attention_gpu_time", "model_step", "mla", "mla_prefill"
CLASS_RATE = "class_rate"
HEAD = "graph_flushed_us_median"


def _best_name(per_provider: dict) -> str | None:
    return next((p for p, m in per_provider.items() if m.get("is_flashinfer_best") == 1.0), None)


def kernel_rows(rows) -> list[dict]:
    """Per timing shape: prefixattn's and FlashInfer best's numbers, both cascades, the floors, the best rate of the
    floor's bytes, the providers under the HBM floor (L2), prefixattn's classes alone (None where absent)."""
    out = []
    for shape, prov in index(rows)[TIMING].items():
        ours, best, floor = prov.get("prefixattn", {}), prov.get("flashinfer-best", {}), prov.get("floor", {})
        out.append(dict(shape=shape.split(" [")[0], full=shape, ours=ours.get(HEAD), best=best.get(HEAD),
                        best_name=_best_name(prov), never=prov.get("prefixattn-nosharing", {}).get(HEAD),
                        overlap=prov.get("prefixattn-overlap", {}).get(HEAD),
                        cascade=prov.get("flashinfer-cascade2", {}).get(HEAD),
                        cascade_fa2=prov.get("flashinfer-cascade2-fa2", {}).get(HEAD),
                        floor_o=floor.get("floor_overlapped_us"), floor_s=floor.get("floor_serial_us"),
                        floor_m=floor.get("floor_memory_us"), floor_c=floor.get("floor_compute_us"),
                        best_rate=floor.get("best_unique_gbps"),
                        best_rate_name=next((p for p, m in prov.items() if m.get("is_best_unique_rate") == 1.0), None),
                        under_floor=[p for p, m in prov.items() if m.get("under_hbm_floor") == 1.0],
                        classes={k[len("class_"):-len("_us_median")]: v for k, v in ours.items()
                                 if k.startswith("class_") and k.endswith("_us_median")},
                        classes_sum=ours.get("classes_sum_us"),
                        modeled={k[len("modeled_class_"):-len("_us")]: v for k, v in ours.items()
                                 if k.startswith("modeled_class_")},
                        ours_warm=ours.get("graph_warm_us_median"), best_warm=best.get("graph_warm_us_median"),
                        ours_eager=ours.get("eager_flushed_us_median"), best_eager=best.get("eager_flushed_us_median"),
                        sm_clock=prov.get("gpu-state", {}).get("sm_clock_mhz"),
                        temp=prov.get("gpu-state", {}).get("temperature_c")))
    return out


def kernel_table(rows) -> list[str]:
    lines = head("shape", "prefixattn us", "FlashInfer best us (config)", "prefixattn speedup",
                 "prefixattn over floor (overlapped / serial)", "best over floor", "warm L2 us (ours / best)",
                 "eager us (ours / best)", "never-share / overlap us", "cascade fa2 / auto us", "SM MHz, C")
    for r in kernel_rows(rows):
        lines.append(
            f"| {r['shape']} | {fixed(r['ours'])} | {fixed(r['best'])} ({r['best_name'] or '-'}) | "
            f"{ratio_cell(r['best'], r['ours'])} | "
            f"{ratio_cell(r['ours'], r['floor_o'])} / {ratio_cell(r['ours'], r['floor_s'])} | "
            f"{ratio_cell(r['best'], r['floor_o'])} / {ratio_cell(r['best'], r['floor_s'])} | "
            f"{fixed(r['ours_warm'])} / {fixed(r['best_warm'])} | "
            f"{fixed(r['ours_eager'])} / {fixed(r['best_eager'])} | "
            f"{fixed(r['never'])} / {fixed(r['overlap'])} | {fixed(r['cascade_fa2'])} / {fixed(r['cascade'])} | "
            f"{fixed(r['sm_clock'], 0)}, "
            f"{fixed(r['temp'], 0)} |")
    return lines


def _modeled(us) -> str:
    """A modeled time in parentheses after a measured one (nothing where the run has none: older CSVs)."""
    return "" if us is None else f" ({fixed(us)})"


def floor_table(rows) -> list[str]:
    """Per shape: the floors, the best rate any correct provider reached on the floor's bytes, the providers faster
    than the HBM floor allows (reading from L2), prefixattn's work classes each alone."""
    kernel = kernel_rows(rows)
    if not any(r["best_rate"] is not None for r in kernel):  # runs before the HBM floor's sweep have no such rows
        return []
    lines = head("shape", "floor memory / compute us", "best rate of the floor's bytes, GB/s (provider)",
                 "under the HBM floor (L2)", "prefixattn classes alone us (modeled)", "their sum / whole")
    for r in kernel:
        classes = ", ".join(f"{n} {fixed(v)}{_modeled(r['modeled'].get(n))}" for n, v in r["classes"].items()) or "-"
        lines.append(f"| {r['shape']} | {fixed(r['floor_m'])} / {fixed(r['floor_c'])} | {fixed(r['best_rate'], 0)} "
                     f"({r['best_rate_name'] or '-'}) | {', '.join(r['under_floor']) or '-'} | {classes} | "
                     f"{ratio_cell(r['classes_sum'], r['ours'])} |")
    return lines


def not_run(rows) -> list[str]:
    """Per provider, each reason it did not run and on how many shapes (rows ``not_run``, the reason in ``unit``)."""
    counts: dict = defaultdict(int)
    for r in rows:
        if r["benchmark"] == TIMING and r["metric"] == "not_run":
            counts[(r["provider"], r["unit"].removeprefix("reason: "))] += 1
    return [f"- `{p}` on {n} shape{'s' if n > 1 else ''}: {why}" for (p, why), n in sorted(counts.items())]


def bytes_table(rows) -> list[str]:
    """Nsight Compute's DRAM bytes per (shape, provider) over the shape's distinct bytes (step ``hbm_bytes``)."""
    table = index(rows).get("hbm_bytes", {})
    if not table:
        return []
    lines = head("shape", "provider", "DRAM read MB", "read / distinct", "DRAM written MB", "kernels",
                 "prefixattn tile loads / distinct")
    for shape, prov in table.items():
        unique = prov.get("floor", {}).get("unique_bytes")
        tiles = prov.get("prefixattn", {}).get("tile_kv_load_bytes")
        for provider, m in prov.items():
            if "dram_read_bytes" not in m:
                continue
            lines.append(f"| {shape.split(' [')[0]} | {provider} | {fixed(m['dram_read_bytes'] / 1e6)} | "
                         f"{ratio_cell(m['dram_read_bytes'], unique)} | {fixed(m.get('dram_write_bytes', 0) / 1e6)} | "
                         f"{fixed(m.get('kernels'), 0)} | "
                         f"{ratio_cell(tiles, unique) if provider == 'prefixattn' else ''} |")
    return lines


def whole_batch_table(rows) -> list[str]:
    """Whole batches run to completion per policy (step ``whole_batch``): wall time, tokens/s, the shares."""
    table = index(rows).get("whole_batch", {})
    if not table:
        return []
    lines = head("workload", "prefixattn s", "prefixattn's schedule + FlashInfer s",
                 "arrival order + LRU cache + FlashInfer s", "kernel's share", "scheduler's share", "total")
    for name, prov in table.items():
        wall = [prov.get(p, {}).get("wall_s") for p in ("prefixattn", "prefixattn-scheduler+flashinfer",
                                                        "arrival+flashinfer")]
        ratio = prov.get("ratio", {})
        share = lambda k: "-" if k not in ratio else f"{ratio[k]:.2f}x"  # noqa: E731
        lines.append(f"| {name} | " + " | ".join(fixed(w, 2) for w in wall)
                     + f" | {share('kernel_share')} | {share('scheduler_share')} | {share('total')} |")
    return lines


def model_rows(rows) -> list[dict]:
    out = []
    for shape, prov in index(rows)[MODEL].items():
        get = lambda p, m: prov.get(p, {}).get(m)  # noqa: E731
        out.append(dict(step=shape, ours=get("prefixattn", "step_us_median"),
                        never=get("prefixattn-nosharing", "step_us_median"),
                        overlap=get("prefixattn-overlap", "step_us_median"),
                        pdl=get("prefixattn-pdl", "step_us_median"),
                        best=get("flashinfer-best", "step_us_median"), best_name=_best_name(prov),
                        cascade=get("flashinfer-cascade2", "step_us_median"),
                        cascade_fa2=get("flashinfer-cascade2-fa2", "step_us_median"),
                        bound=get("prefixattn", "bound_us"), l2=get("floor", "l2_reread_fraction"),
                        share_ours=get("prefixattn", "attention_share"),
                        share_best=get("flashinfer-best", "attention_share"),
                        tok_ours=get("prefixattn", "tokens_per_s"), tok_best=get("flashinfer-best", "tokens_per_s"),
                        graph=get("prefixattn", "graph"),
                        classes={m[len("class_"):-len("_layer_us")]: v for m, v in prov.get("prefixattn", {}).items()
                                 if m.startswith("class_") and m.endswith("_layer_us")},
                        modeled={m[len("modeled_class_"):-len("_us")]: v for m, v in prov.get("prefixattn", {}).items()
                                 if m.startswith("modeled_class_")},
                        layer=get("prefixattn", "layer_us"), layer_modeled=get("prefixattn", "modeled_step_us")))
    return out


def model_table(rows) -> list[str]:
    lines = head("step", "prefixattn ms", "bound ms", "never-share / overlap / PDL ms",
                 "FlashInfer best, no sharing ms (config)", "cascade fa2 / auto ms", "speedup vs best",
                 "attention share (ours / best)", "unshared reads an L2 could serve", "tokens/s (ours / best)")
    ms = lambda v: None if v is None else v / 1e3  # noqa: E731
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    for r in model_rows(rows):
        lines.append(f"| {r['step']}{' (graph)' if r['graph'] else ''} | {fixed(ms(r['ours']), 2)} | "
                     f"{fixed(ms(r['bound']), 2)} | {fixed(ms(r['never']), 2)} / {fixed(ms(r['overlap']), 2)} / "
                     f"{fixed(ms(r['pdl']), 2)} | "
                     f"{fixed(ms(r['best']), 2)} "
                     f"({r['best_name'] or '-'}) | {fixed(ms(r['cascade_fa2']), 2)} / {fixed(ms(r['cascade']), 2)} | "
                     f"{ratio_cell(r['best'], r['ours'])} | {pct(r['share_ours'])} / {pct(r['share_best'])} | "
                     f"{pct(r['l2'])} | {fixed(r['tok_ours'], 0)} / {fixed(r['tok_best'], 0)} |")
    return lines


def model_class_lines(rows) -> list[str]:
    """prefixattn's work classes alone on one layer of each model step, beside the whole layer; the cost model's
    times in parentheses (modeled)."""
    out = []
    for r in model_rows(rows):
        if r["classes"]:
            out.append(f"- {r['step']}: one layer {fixed(r['layer'])} us{_modeled(r['layer_modeled'])}; alone: "
                       + ", ".join(f"{n} {fixed(v)} us{_modeled(r['modeled'].get(n))}"
                                   for n, v in r["classes"].items()))
    return out


def mla_rows(rows) -> list[dict]:
    """Per MLA shape (step ``mla``): each provider's graph-replayed flushed median, correctness, the memory floor."""
    out = []
    for shape, prov in index(rows).get(MLA, {}).items():
        get = lambda p, m: prov.get(p, {}).get(m)  # noqa: E731
        out.append(dict(shape=shape, ours=get("prefixattn", HEAD), never=get("prefixattn-nosharing", HEAD),
                        flashinfer=get("flashinfer-mla", HEAD), typhoon=get("typhoon-mla", HEAD),
                        naive=get("prefixattn-naive", HEAD), kept=get("prefixattn-naive-kept", HEAD),
                        floor=get("floor", "floor_memory_us"),
                        warm=get("prefixattn", "graph_warm_us_median"),
                        correct=all(m.get("correct", 1.0) == 1.0 and m.get("graph_correct", 1.0) == 1.0
                                    for m in prov.values())))
    return out


def mla_table(rows) -> list[str]:
    lines = head("shape", "prefixattn us", "never-share us", "FlashInfer MLA us", "TyphoonMLA-style us",
                 "prefixattn naive-form us", "naive form, prefix kept us", "speedup vs FlashInfer",
                 "speedup vs TyphoonMLA-style", "naive form vs TyphoonMLA-style", "prefix kept vs TyphoonMLA-style",
                 "speedup vs never-share", "prefixattn over memory floor", "warm L2 us", "correct")
    for r in mla_rows(rows):
        lines.append(f"| {r['shape']} | {fixed(r['ours'])} | {fixed(r['never'])} | {fixed(r['flashinfer'])} | "
                     f"{fixed(r['typhoon'])} | {fixed(r['naive'])} | {fixed(r['kept'])} | "
                     f"{ratio_cell(r['flashinfer'], r['ours'])} | {ratio_cell(r['typhoon'], r['ours'])} | "
                     f"{ratio_cell(r['typhoon'], r['naive'])} | {ratio_cell(r['typhoon'], r['kept'])} | "
                     f"{ratio_cell(r['never'], r['ours'])} | "
                     f"{ratio_cell(r['ours'], r['floor'])} | {fixed(r['warm'])} | {'yes' if r['correct'] else 'NO'} |")
    return lines


def mla_prefill_table(rows) -> list[str]:
    """Per prefill-context shape (the ``mla`` step's): the vLLM backend's path and vLLM's own, and which one the
    backend's modeled rule takes; empty without rows."""
    shapes = index(rows).get(MLA_PREFILL, {})
    if not shapes:
        return []
    lines = head("shape", "prefixattn context us", "vLLM-style us", "speedup", "rule takes prefixattn's", "correct")
    for shape, prov in shapes.items():
        ours, theirs = (prov.get(p, {}) for p in ("prefixattn-context", "vllm-context"))
        rule = ours.get("rule_takes_this_path")
        correct = all(m.get("correct", 1.0) == 1.0 and m.get("graph_correct", 1.0) == 1.0 for m in prov.values())
        lines.append(f"| {shape} | {fixed(ours.get(HEAD))} | {fixed(theirs.get(HEAD))} | "
                     f"{ratio_cell(theirs.get(HEAD), ours.get(HEAD))} | "
                     f"{'-' if rule is None else ('yes' if rule else 'no')} | {'yes' if correct else 'NO'} |")
    return lines


def class_rate_table(rows) -> list[str]:
    """Per class-rates shape: prefixattn's causal TFLOP/s (the portable build and the Hopper build) beside FlashInfer's
    prefill on fa3 and fa2 (``-``: did not run; the CSV's ``not_run`` row says why); empty without rows."""
    shapes = index(rows).get(CLASS_RATE, {})
    if not shapes:
        return []
    lines = head("shape", "prefixattn TFLOP/s", "Hopper build TFLOP/s", "fa3 TFLOP/s", "fa2 TFLOP/s",
                 "prefixattn / fa3", "Hopper build / fa3", "prefixattn / fa2")
    for shape, prov in shapes.items():
        ours, hopper, fa3, fa2 = (prov.get(p, {}).get("attention_tflops") for p in
                                  ("prefixattn", "prefixattn-hopper", "flashinfer-prefill-fa3",
                                   "flashinfer-prefill-fa2"))
        lines.append(f"| {shape} | {fixed(ours)} | {fixed(hopper)} | {fixed(fa3)} | {fixed(fa2)} | "
                     f"{ratio_cell(ours, fa3)} | {ratio_cell(hopper, fa3)} | {ratio_cell(ours, fa2)} |")
    return lines


def kv_heads_table(rows) -> list[str]:
    """Per timing shape where decode programs packed several KV heads (``prefixattn-kv-heads``): prefixattn's
    headline time, the packed plan's and how many heads it packed; empty where it ran nowhere."""
    lines = []
    for shape, prov in index(rows).get(TIMING, {}).items():
        packed = prov.get("prefixattn-kv-heads", {})
        if packed.get(HEAD) is not None:
            ours = prov.get("prefixattn", {}).get(HEAD)
            lines.append(f"| {shape.split(' [')[0]} | {fixed(ours)} | {fixed(packed[HEAD])} | "
                         f"{fixed(packed.get('kv_heads'), 0)} | {ratio_cell(ours, packed[HEAD])} |")
    return head("shape", "prefixattn us", "packed us", "KV heads a program", "speedup") + lines if lines else []


def pdl_table(rows) -> list[str]:
    """Per timing shape where the step's launches ran chained by PDL (``prefixattn-pdl``): prefixattn's headline
    time (its launches in series) and the chained one's, each with its modeled time in parentheses; empty where it
    ran nowhere."""
    lines = []
    for shape, prov in index(rows).get(TIMING, {}).items():
        pdl = prov.get("prefixattn-pdl", {})
        if pdl.get(HEAD) is not None:
            ours = prov.get("prefixattn", {})
            lines.append(f"| {shape.split(' [')[0]} | {fixed(ours.get(HEAD))}{_modeled(ours.get('modeled_step_us'))} | "
                         f"{fixed(pdl[HEAD])}{_modeled(pdl.get('modeled_pdl_us'))} | "
                         f"{ratio_cell(ours.get(HEAD), pdl[HEAD])} |")
    return head("shape", "prefixattn us (in series)", "chained by PDL us", "speedup") + lines if lines else []


def hopper_table(rows) -> list[str]:
    """Per timing shape where the Hopper build ran for a class (``prefixattn-hopper``): the whole step and the shared
    and chunk classes alone (median, graph-replayed, L2 flushed) with the portable build (``prefixattn``) and with
    it; empty where it ran nowhere."""
    lines = []
    for shape, prov in index(rows).get(TIMING, {}).items():
        hopper, ours = prov.get("prefixattn-hopper", {}), prov.get("prefixattn", {})
        if hopper.get(HEAD) is not None:
            cells = [fixed(ours.get(HEAD)), fixed(hopper[HEAD]), ratio_cell(ours.get(HEAD), hopper[HEAD])]
            for work_class in ("shared", "chunk"):
                alone = [x.get(f"class_{work_class}_us_median") for x in (ours, hopper)]
                cells += [fixed(alone[0]), fixed(alone[1]), ratio_cell(*alone)]
            lines.append(f"| {shape.split(' [')[0]} | " + " | ".join(cells) + " |")
    return head("shape", "portable us", "Hopper build us", "speedup", "shared class alone, portable us",
                "Hopper build us", "speedup", "chunk class alone, portable us", "Hopper build us",
                "speedup") + lines if lines else []


def losses(rows) -> list[str]:
    """Every shape and model step where prefixattn is slower than FlashInfer's best (or has no number)."""
    out = []
    for r in kernel_rows(rows):
        if r["ours"] is None:
            out.append(f"- {r['shape']}: no graph-replayed prefixattn time")
        elif r["best"] is not None and r["ours"] > r["best"]:
            out.append(f"- {r['shape']}: prefixattn {fixed(r['ours'])} us vs FlashInfer {r['best_name']} "
                       f"{fixed(r['best'])} us ({r['ours'] / r['best']:.2f}x slower)")
    for r in model_rows(rows):
        if r["ours"] is not None and r["best"] is not None and r["ours"] > r["best"]:
            out.append(f"- model {r['step']}: prefixattn {r['ours'] / 1e3:.2f} ms vs FlashInfer {r['best_name']} "
                       f"{r['best'] / 1e3:.2f} ms ({r['ours'] / r['best']:.2f}x slower)")
    for r in mla_rows(rows):
        for peer, label in (("flashinfer", "FlashInfer MLA"), ("typhoon", "TyphoonMLA-style")):
            if r["ours"] is not None and r[peer] is not None and r["ours"] > r[peer]:
                out.append(f"- MLA {r['shape']}: prefixattn {fixed(r['ours'])} us vs {label} "
                           f"{fixed(r[peer])} us ({r['ours'] / r[peer]:.2f}x slower)")
    return out or ["- nowhere in this run"]


def checks(rows, device: str) -> list[str]:
    """The correctness, graph, plan-ahead and sanitizer lines of the summary."""
    by = lambda bench, metric: [r for r in rows if r["benchmark"] == bench and r["metric"] == metric]  # noqa: E731
    lines = []
    for bench, what in (("gpu_check_correctness", "correctness cases (fp64 reference, NaN-poisoned outputs, 3 runs "
                                                  "bit-identical)"),
                        ("gpu_check_sanitizer_cases", "sanitizer cases checked against the reference"),
                        ("gpu_check_graphs", "CUDA-graph wrapper batches"),
                        ("gpu_check_plan_ahead", "plan-ahead checks (step N+1 planned while N is queued)")):
        passed = by(bench, "passed")
        if passed:
            bad = [f"{r['provider']}:{r['shape']}" for r in passed if float(r["value"]) != 1.0]
            lines.append(f"- {what}: {len(passed) - len(bad)}/{len(passed)} passed"
                         + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    for r in rows:
        if r["benchmark"] in ("gpu_check_sanitizer", "gpu_ceiling", "gpu_check_plan_ahead", "flashinfer_jit") and \
                r["metric"] not in ("passed",):
            lines.append(f"- {r['benchmark']}: {r['provider']} {r['shape']} {r['metric']} = {float(r['value']):.4g} "
                         f"{r['unit']}")
    return lines


def summary(rows, *, device: str, commit: str, versions: str, seconds: float, skips) -> str:
    """The GPU check's .md: where prefixattn loses first, then the checks, skips, the fair kernel table, the floors,
    the configurations not run, the model steps and the measured bytes."""
    dry = device == "cpu-interpreter"
    lines = [f"# GPU check: {device}", "", f"commit {commit}; {versions}; {seconds:.0f} s", ""]
    lines += ["## Where prefixattn loses", ""] + losses(rows) + [""] + checks(rows, device)
    if skips:
        lines += ["", "## Skipped", ""] + [f"- {step}: {reason}" for step, reason in skips]
    kind = ("DRY RUN, CPU interpreter, FlashInfer's stand-in: one interpreted run's wall clock stands for every "
            "statistic, not kernel times" if dry else
            "medians of 3 repetitions; CUDA-graph replay, L2 flushed before each run")
    lines += ["", f"## Attention kernels ({kind})", ""] + kernel_table(rows)
    if floor := floor_table(rows):
        lines += ["", "## Floors, the best rate reached, L2, prefixattn's classes alone", "",
                  "The memory floor's bytes are the distinct KV, q and out; a provider faster than that at the HBM "
                  "floor's rate by more than 3% read part of them from L2. prefixattn's work classes each run alone "
                  "in a graph of their own (the cost model's time in parentheses, modeled).", ""] + floor
    if missing := not_run(rows):
        lines += ["", "## Configurations that did not run (not in \"FlashInfer best\" there)", ""] + missing
    lines += ["", f"## Model steps ({'DRY RUN' if dry else 'Llama-3.1-8B shape, 32 layers'})", "",
              "*bound*: the step with attention at its sharing floor (distinct KV + q + out per layer at the HBM rate, "
              "or the attention FLOPs at the attention rate).", ""] + model_table(rows)
    if classes := model_class_lines(rows):
        lines += ["", "prefixattn's work classes alone, one layer (graph-replayed, L2 flushed; the cost model's times "
                  "in parentheses, modeled):", ""] + classes
    if rates := class_rate_table(rows):
        lines += ["", f"## Causal attention rates{' (DRY RUN)' if dry else ''}", "",
                  "The matrix classes' rate: causal prefill FLOPs over the median eager time (L2 warm; the KV is past "
                  "the L2), each output checked against the reference first.", ""] + rates
    if packed := kv_heads_table(rows):
        lines += ["", f"## Decode programs with several KV heads{' (DRY RUN)' if dry else ''}", "",
                  "The decode steps again with the shipped decode tile packing as many KV heads into a program as "
                  "its lanes hold (a tile's `kv_heads`, which no shipped table sets: docs/tuning.md), both "
                  "graph-replayed, L2 flushed.", ""] + packed
    if chained := pdl_table(rows):
        lines += ["", f"## Launches chained by PDL{' (DRY RUN)' if dry else ''}", "",
                  "The steps with two launches or more again with each launch after the first started as its "
                  "predecessor's dependent (`PREFIXATTN_PDL=1`: programmatic dependent launch), each output checked "
                  "against the reference first, both graph-replayed, L2 flushed; the cost model's times in "
                  "parentheses (modeled).", ""] + chained
    if hopper := hopper_table(rows):
        lines += ["", f"## The matrix classes' Hopper build{' (DRY RUN)' if dry else ''}", "",
                  "The steps with a shared or chunk class again with the Hopper build (`PREFIXATTN_BUILD=hopper`: "
                  "TMA loads, a loading warp apart from two computing warpgroups), each output checked against the "
                  "reference first; the whole step and each class alone, graph-replayed, L2 flushed.",
                  ""] + hopper
    if mla_rows(rows):
        lines += ["", f"## MLA decode steps ({'DRY RUN' if dry else 'DeepSeek-V3 shape, bf16, one layer'})", "",
                  "prefixattn's `mla_attention` against FlashInfer's MLA wrapper (absorbed, no sharing) and a "
                  "TyphoonMLA-style split built from FlashInfer (the shared prefix up-projected once, attended in the "
                  "naive form; its time includes W_UV of its absorbed half) and the same split on prefixattn's kernels "
                  "(`mla_naive_attention`, the prefix up-projected in the timed run), graph-replayed, L2 flushed; the "
                  "memory floor is the distinct latent bytes with q and out at the HBM floor's rate.",
                  ""] + mla_table(rows)
    if contexts := mla_prefill_table(rows):
        lines += ["", f"## MLA prefill contexts ({'DRY RUN' if dry else 'DeepSeek-V3 shape, bf16, one layer'})", "",
                  "A step's prefills over one cached prompt, their attention over it: the vLLM MLA backend's path (the "
                  "distinct context up-projected once, `prefixattn.attention`) against vLLM's own way (each prefill's "
                  "context up-projected, FlashInfer fa3 single prefill per prefill), graph-replayed, L2 flushed; "
                  "*rule*: whether the backend's modeled rule takes its path there.", ""] + contexts
    if batches := whole_batch_table(rows):
        lines += ["", "## Whole batches to completion (eager steps, host planning included)", "",
                  "Shares above 1 are prefixattn's gain: *kernel's* = FlashInfer over prefixattn on prefixattn's "
                  "schedule; *scheduler's* = arrival order over prefixattn's order, both on FlashInfer.", ""] + batches
    if measured := bytes_table(rows):
        lines += ["", "## HBM bytes (Nsight Compute, caches flushed before each kernel)", ""] + measured
    lines += ["", "The simulator's calibration against these model steps (host only, minutes): "
              "`python bench/gpu_report.py <this .csv> --steps <its -model-steps.json>`."]
    return "\n".join(lines) + "\n"


def readme_section(rows, *, source: str, fit_markdown: str = "") -> str:
    """The README's performance section, from one GPU check CSV."""
    r0 = rows[0] if rows else {}
    dry = r0.get("device") == "cpu-interpreter"
    lines = [f"## Performance (measured on {r0.get('device', '?')}, commit {r0.get('commit', '?')}"
             f"{'; DRY RUN: not measurements' if dry else ''})", "",
             f"From `{source}` (`python bench/gpu_report.py` regenerates this section). Attention per call, "
             "CUDA-graph replayed for every provider, L2 flushed before each run, median of 3 repetitions; "
             "\"speedup\" is FlashInfer's best configuration for the shape over prefixattn (above 1: prefixattn is "
             "faster); floors: distinct KV + q + out at the read-only streaming rate, and the attention FLOPs at the "
             "measured causal-prefill rate (overlapped = max, serial = sum). The FlashInfer cascade was handed the "
             "prefix groups (oracle); prefixattn finds them.", ""]
    lines += kernel_table(rows)
    lines += ["", "Model step (Llama-3.1-8B shape, random weights, batches from prefixattn's TokenBatcher on a "
              "BatchLLM case-1-shaped workload; decode steps graph-replayed, mixed steps eager):", ""]
    lines += model_table(rows)
    lines += ["", "Where prefixattn loses:", ""] + losses(rows)
    if fit_markdown:
        lines += ["", fit_markdown]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_report.py", description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="a GPU check CSV (bench/results/gpu/<gpu>-<commit>.csv)")
    ap.add_argument("--steps", help="its -model-steps.json: append the simulator's calibration")
    ap.add_argument("--table1-requests", type=int, default=3000, help="Table 1's workload size with --steps")
    ap.add_argument("--no-held-out", action="store_true",
                    help="with --steps: skip the leave-one-step-out judgement (a fit per step: minutes)")
    args = ap.parse_args(argv)
    rows = read_rows(args.csv)
    fit_md = ""
    if args.steps:
        import json

        from prefixattn.sim import fit

        records = json.loads(Path(args.steps).read_text())
        if records:
            steps, hw, model = fit.load_steps(records)
            result = fit.fit(steps, hw, model)
            table = fit.table1(result.overrides, args.table1_requests) if args.table1_requests else None
            held = None if args.no_held_out else fit.held_out(steps, hw, model)
            fit_md = fit.markdown(result, table, device=records[0]["device"], held=held)
    print(readme_section(rows, source=args.csv, fit_markdown=fit_md), end="")
    return 0
