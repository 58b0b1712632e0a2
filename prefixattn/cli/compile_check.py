"""``prefixattn compile-check``: compile every kernel variant for GPU targets on this machine (no GPU needed).

What is compiled and what fails the check is :mod:`prefixattn.tuning.compile_check`; this module parses the
command line, prints a row per compile and the summary, and writes the JSON report. Exit status 1 when any compile
fails the check, 2 for a bad argument.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from prefixattn.autotune.config_space import DTYPE_BYTES, HEAD_DIMS
from prefixattn.autotune.targets import DEFAULT_CHECK_TARGETS, TARGETS, get_target, parse_targets
from prefixattn.cli.arg_types import int_list, positive_int
from prefixattn.tuning.compile_check import KERNELS, build_jobs, failures, run_jobs, worst_case_jobs

HELP = ("compile every kernel variant for sm80/sm90/gfx90a/gfx942 without a GPU; report registers, spills, "
        "shared memory, pipeline depth and matrix instructions")


def _csv(kind, cast=str):
    def parse(s):
        return [cast(x.strip()) for x in s.split(",") if x.strip()]
    parse.__name__ = kind
    return parse


def add_arguments(parser) -> None:
    parser.add_argument("--targets", default=",".join(DEFAULT_CHECK_TARGETS),
                        help=f"comma-separated targets (known: {', '.join(TARGETS)}; default %(default)s)")
    parser.add_argument("--json", dest="json_path", default=None, help="write every record to this JSON file")
    parser.add_argument("--worst-case", action="store_true",
                        help="CI's selection instead of the full run: every shipped binary (bf16, LSE) and, at the "
                             "smallest and largest head size, every feature switch at once over each fp8 type "
                             "(cannot be combined with the options below)")
    parser.add_argument("--kernels", type=_csv("kernels"), default=None,
                        help=f"comma-separated subset of {','.join(KERNELS)}")
    parser.add_argument("--dtypes", type=_csv("dtypes"), default=None,
                        help="comma-separated subset of fp16,bf16,fp32")
    parser.add_argument("--head-dims", type=int_list(HEAD_DIMS), default=None,
                        help="comma-separated head sizes (default: every supported one)")
    parser.add_argument("--head-dim-per-target", type=_csv("head_dim_per_target"), default=None,
                        help="TARGET=HEAD_DIM pairs: check only that head size on that target")
    parser.add_argument("--lse", choices=("both", "on", "off"), default=None,
                        help="compile the fused kernel with HAS_LSE on, off or both (default both)")
    parser.add_argument("--max-configs", type=positive_int, default=None,
                        help="at most this many default configs per (target, dtype, head_dim)")
    parser.add_argument("--jobs", type=positive_int, default=max(1, min(4, os.cpu_count() or 1)),
                        help="parallel compiler processes (default: CPU count, at most 4)")
    parser.add_argument("--quiet", action="store_true", help="print only failures and the summary")


def _row(r: dict) -> str:
    regs = r.get("registers")
    if r.get("agprs"):
        regs = f"{regs}+{r['agprs']}a"
    mma = "-" if r.get("shared_part_matrix") is None else ("yes" if r["shared_part_matrix"] else "NO")
    instrs = ",".join(f"{k}x{v}" for k, v in sorted(r.get("matrix_instrs", {}).items())) or "-"
    status = "ok" if not failures(r) else "FAIL"
    return (f"{status:4s} {r['target']:7s} {r['kernel']:17s} {r['variant']:21s} {r['dtype']:5s} d{r['head_dim']:<4d}"
            f" {r['config_name']:38s} regs={regs!s:>8s} spills={r.get('spills')!s:>5s} {_pipeline_cell(r):24s} "
            f"smem={r.get('shared_bytes')!s:>6s} shared_mma={mma:3s} [{instrs}]{_hopper_cell(r)} {r.get('compile_s')}s")


def _hopper_cell(r: dict) -> str:
    """`` tma=0 maxnreg=0 wgmma_wait=0`` on sm_90 and later (TMA loads, setmaxnreg, the depths warpgroup MMAs are
    waited at: :func:`~prefixattn.tuning.compile_analysis.hopper_features`), else empty."""
    h = r.get("hopper")
    if not h:
        return ""
    waits = ",".join(str(w) for w in h["wgmma_waits"]) or "-"
    return f" tma={h['tma']} maxnreg={h['setmaxnreg']} wgmma_wait={waits}"


def _pipeline_cell(r: dict) -> str:
    """``depth=2 bufs=3 wait=2/2`` (tiles in flight, K/V buffer copies, in-loop async_wait num / commit groups per
    iteration) on NVIDIA; ``depth=2 lds=1+pf`` (LDS buffers plus the stream pipeliner's register prefetch) on AMD."""
    p = r.get("pipeline")
    if not p:
        return "depth=-"
    bufs = min(p["kv_buffers"]) if p["kv_buffers"] else 0
    if p["waits"]:
        return f"depth={p['depth']} bufs={bufs} wait={min(p['waits'])}/{min(p['groups_per_iter'])}"
    if p["prefetch"]:
        return f"depth={p['depth']} lds={bufs}+pf"
    return f"depth={p['depth']} bufs={bufs}"


def run(args) -> int:
    from prefixattn.runtime import interpreter_enabled

    if interpreter_enabled():
        # The kernels this process and its workers import would be the interpreter's, which cannot be compiled.
        print("prefixattn compile-check: TRITON_INTERPRET=1 is set; compile-check compiles real kernels: unset "
              "TRITON_INTERPRET (or set TRITON_INTERPRET=0) and run it again", file=sys.stderr)
        return 2
    selection = ("kernels", "dtypes", "head_dims", "head_dim_per_target", "lse", "max_configs")
    try:
        targets = parse_targets(args.targets)
        given = [name for name in selection if getattr(args, name) is not None]
        if args.worst_case and given:
            raise ValueError(f"worst-case: expected no other selection, got --{given[0].replace('_', '-')} too "
                             "(--worst-case picks head sizes, dtypes and variants itself; --targets narrows it)")
        kernels = args.kernels or list(KERNELS)
        dtypes = args.dtypes or list(DTYPE_BYTES)
        for d in dtypes:
            if d not in DTYPE_BYTES:
                raise ValueError(f"dtypes: expected a subset of {','.join(DTYPE_BYTES)}, got {d!r}")
        for k in kernels:
            if k not in KERNELS:
                raise ValueError(f"kernels: expected a subset of {','.join(KERNELS)}, got {k!r}")
        per_target = {}
        for pair in args.head_dim_per_target or []:
            name, _, hd = pair.partition("=")
            if not hd.isdigit():
                raise ValueError(f"head-dim-per-target: expected TARGET=HEAD_DIM, got {pair!r}")
            if int(hd) not in HEAD_DIMS:
                raise ValueError(f"head-dim-per-target: expected a head_dim in {HEAD_DIMS}, got {hd} in {pair!r}")
            per_target[get_target(name).name] = int(hd)
    except ValueError as e:
        print(f"prefixattn compile-check: {e}", file=sys.stderr)
        return 2
    lse = {"both": (False, True), "on": (True,), "off": (False,)}[args.lse or "both"]
    jobs = worst_case_jobs(targets) if args.worst_case else []
    for t in targets if not args.worst_case else ():
        head_dims = [per_target[t.name]] if t.name in per_target else (args.head_dims or list(HEAD_DIMS))
        jobs += build_jobs(targets=[t], kernels=kernels, dtypes=dtypes, head_dims=head_dims, lse=lse,
                           max_configs=args.max_configs)
    print(f"prefixattn compile-check: {len(jobs)} compiles for {', '.join(t.name for t in targets)} "
          f"({args.jobs} processes)", flush=True)
    t0 = time.perf_counter()

    def progress(done, total, record):
        if not args.quiet or failures(record):
            print(f"[{done:>{len(str(total))}}/{total}] {_row(record)}", flush=True)

    records = run_jobs(jobs, workers=args.jobs, progress=progress)
    wall = time.perf_counter() - t0
    failed = [(r, failures(r)) for r in records if failures(r)]
    summary = {"compiles": len(records), "failed": len(failed), "wall_s": round(wall, 1),
               "targets": [t.name for t in targets]}
    if args.json_path:
        import triton

        Path(args.json_path).write_text(json.dumps({"summary": summary, "triton": triton.__version__,
                                                    "records": records}, indent=1))
    for r, why in failed:
        print(f"FAILED {r['target']} {r['kernel']} {r['variant']} {r['dtype']} d{r['head_dim']} {r['config_name']}: "
              f"{'; '.join(why)}", file=sys.stderr)
    print(f"prefixattn compile-check: {len(records) - len(failed)}/{len(records)} passed in {wall:.0f} s"
          + (f"; JSON: {args.json_path}" if args.json_path else ""))
    return 1 if failed else 0
