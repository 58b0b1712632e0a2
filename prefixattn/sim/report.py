"""Presenting simulation results: a text table, JSON rows and the per-step plots (matplotlib, optional)."""

from __future__ import annotations

import json
import math

#: Keys every JSON row carries (the issue's contract), then the rest of :meth:`SimResult.row`.
JSON_KEYS = ("policy", "throughput_tok_s", "saving_ratio", "optimal_saving_ratio", "peak_kv_gib", "fraction_of_bound")

INSTALL_HINT = "install the bench extra: pip install 'prefixattn[bench]' (or: pip install matplotlib tqdm)"


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec)


def format_table(results: list, baseline: str | None = None) -> str:
    """Aligned text table of results, one row per policy; ``x base`` is throughput relative to ``baseline``
    (default: the first row). Headed by a line saying the numbers are modeled."""
    if not results:
        return "(no results)"
    base = next((r for r in results if r.policy == baseline), results[0])
    r0 = results[0]
    head = (f"MODELED (simulated, not measured): {r0.workload}, {r0.num_requests} requests, {r0.model} on {r0.gpu}; "
            f"optimal saving ratio {_fmt(r0.optimal_saving_ratio, '.3f')}")
    cols = ["policy", "tok/s", "req/s", f"x {base.policy}", "saving", "peak KV GiB", "preempt", "steps",
            "TECD s", "time s", "of T_o", "kernel", "backend"]
    rows = []
    for r in results:
        rows.append([r.policy, _fmt(r.throughput_tok_s, ",.0f"), _fmt(r.requests_per_s, ".2f"),
                     _fmt(r.throughput_tok_s / base.throughput_tok_s, ".2f"), _fmt(r.saving_ratio, ".3f"),
                     f"{r.peak_kv_gib:.1f}/{r.kv_capacity_gib:.1f}", str(r.preemptions), str(r.steps),
                     _fmt(r.tecd_s, ".1f"), _fmt(r.time_s, ".1f"), _fmt(r.fraction_of_bound, ".1%"), r.kernel,
                     r.backend])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths)))
    out = [head, line, "-" * len(line)]
    for row in rows:
        out.append("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))))
    return "\n".join(out)


def json_rows(results: list) -> list:
    """Results as a list of objects: the contract keys first, then every other scalar field."""
    out = []
    for r in results:
        row = r.row()
        ordered = {k: row.pop(k) for k in JSON_KEYS}
        ordered.update(row)
        out.append(ordered)
    return out


def write_json(results: list, path) -> None:
    with open(path, "w") as f:
        json.dump(json_rows(results), f, indent=2)
        f.write("\n")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError(f"plot: matplotlib is not installed; {INSTALL_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_steps(results: list, path) -> None:
    """Tokens per step over the run (BatchLLM Fig. 2 / 6 "valleys"), one panel per policy, plus KV blocks in use.

    A fast-forwarded decode stretch is drawn as the flat run of steps it stands for.
    """
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.4 * len(results)), squeeze=False, sharey=True)
    for ax, r in zip(axes[:, 0], results):
        tl = r.timeline
        steps = np.repeat(tl["start_step"], tl["count"]) + \
            np.concatenate([np.arange(c) for c in tl["count"]]) if len(tl["count"]) else np.array([])
        tokens = np.repeat(tl["tokens"], tl["count"])
        ax.plot(steps, tokens, lw=0.5, color="tab:blue")
        ax.set_ylabel("tokens/step")
        ax.set_title(f"{r.policy}: {r.throughput_tok_s:,.0f} tok/s modeled, {r.steps} steps, "
                     f"TECD {r.tecd_s:.0f} s", fontsize=9)
        twin = ax.twinx()
        twin.plot(steps, np.repeat(tl["used_blocks"], tl["count"]), lw=0.5, color="tab:red", alpha=0.5)
        twin.set_ylabel("KV blocks used", color="tab:red", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    r0 = results[0]
    fig.suptitle(f"MODELED tokens per step: {r0.workload} on {r0.model}/{r0.gpu}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
