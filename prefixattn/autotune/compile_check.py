"""``prefixattn compile-check``: compile every kernel variant for GPU targets on this machine (no GPU needed).

For each target, kernel variant, dtype, head size and default config it runs ``triton.compile`` for the target and
reports: compile ok, registers (ptxas ``-v`` on NVIDIA; ``.vgpr_count`` (+ AGPRs) on AMD), spills (ptxas spill
store + load bytes; ``.vgpr_spill_count`` plus scratch-memory instructions on AMD), shared memory / LDS, the pipeline
depth of the KV loops in the TTGIR (:func:`parse_pipeline`: K/V tiles in flight, from the K/V buffer copies and the
in-loop ``async_wait`` nums on NVIDIA, LDS buffers plus the stream pipeliner's prefetch on AMD), and whether the
shared-node part of the fused kernel issues matrix instructions: its ``tt.dot`` ops got a tensor-core layout in the
TTGIR
(``nvidia_mma`` v2 = ``mma.sync``, v3 = ``wgmma``; ``amd_mfma``) and the assembly contains them. Dots are attributed
to the shared part by their shapes, ``[BLOCK_M_SHARED, BLOCK_D] x [BLOCK_D, BLOCK_N_SHARED]`` and
``[BLOCK_M_SHARED, BLOCK_N_SHARED] x [BLOCK_N_SHARED, BLOCK_D]`` (a suffix dot of the same shapes gets the same
layout, so sharing a shape cannot hide a fallback).

Exit status 1 when any compile fails, any default config spills, uses more shared memory than the target has, keeps
fewer than ``MIN_PIPELINE_DEPTH`` K/V tiles in flight on NVIDIA (the fused kernel), a decode suffix-only binary
the tables placed under the register budget uses more (``shipped_tables.DECODE_SUFFIX_MAX_REGS``), or
(fp16/bf16, and fp32 on AMD) its shared-node part has no matrix instructions. Compiles run in worker processes with
``TRITON_INTERPRET=0`` (a kernel defined under the interpreter cannot be compiled), ``--jobs`` at a time. What is
read out of the compiler's output (TTGIR, PTX, ptxas log, AMDGCN) is :mod:`prefixattn.autotune.compile_analysis`.

The default run compiles every binary of every default config (:func:`build_jobs`); ``--worst-case`` is CI's
selection (:func:`worst_case_jobs`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

from prefixattn.autotune.compile_analysis import (count_matrix_instrs, count_private_memory_ops, parse_amdgcn,
                                                 parse_dots, parse_pipeline, parse_ptxas)
from prefixattn.autotune.config_space import DTYPE_BYTES, HEAD_DIMS, NUM_STAGES_CUDA, block_d
from prefixattn.cli import int_list, positive_int
from prefixattn.autotune.targets import DEFAULT_CHECK_TARGETS, TARGETS, get_target, parse_targets

HELP = ("compile every kernel variant for sm80/sm90/gfx90a/gfx942 without a GPU; report registers, spills, "
        "shared memory, pipeline depth and matrix instructions")

KERNELS = ("prefix_attention", "merge")


# ---------------------------------------------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------------------------------------------

def _worker_init() -> None:
    # Must precede any kernel import in this process: @triton.jit decides at decoration time.
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning


def _ptxas_log(ptx: str, arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        # The flags Triton's make_cubin passes (ptxas 13 needs --regAllocOptLevel=2 there too).
        cmd = [get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}",
               str(src), "-o", str(Path(d) / "k.o")]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


def compile_one(job) -> dict:
    """Compile one job (in a worker process) and measure it. Never raises: failures become ``ok: False``."""
    import importlib

    record = {k: v for k, v in asdict(job).items() if k not in ("signature", "constexprs", "attrs", "fn")}
    record["serves"] = list(job.serves)
    record["shared_dots"] = [list(d) for d in job.shared_dots]
    target = TARGETS[job.target]
    t0 = time.perf_counter()
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        module, attr = job.fn.split(":")
        fn = getattr(importlib.import_module(module), attr)
        gpu = GPUTarget(target.backend, target.arch, target.warp_size)
        src = ASTSource(fn=fn, signature=dict(job.signature), constexprs=dict(job.constexprs),
                        attrs={tuple(k): v for k, v in job.attrs.items()})
        log = io.StringIO()
        if target.backend == "cuda":
            triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas -v output; captured below
        with contextlib.redirect_stdout(log):
            ck = triton.compile(src, target=gpu, options=dict(job.options))
    except Exception as e:  # noqa: BLE001 - any compiler error is a result to report, not a crash
        record.update(ok=False, error=f"{type(e).__name__}: {str(e).strip()[:2000]}",
                      compile_s=round(time.perf_counter() - t0, 2))
        return record
    record["compile_s"] = round(time.perf_counter() - t0, 2)
    record["ok"] = True
    record["shared_bytes"] = int(ck.metadata.shared)
    record["shared_limit"] = target.max_shared_bytes
    if target.backend == "cuda":
        text = log.getvalue()
        stats = parse_ptxas(text)
        if stats["registers"] is None:  # cache hit: Triton did not run ptxas this time
            stats = parse_ptxas(_ptxas_log(ck.asm["ptx"], target.arch))
        record.update(stats)
        record["spills"] = stats["spill_bytes"]
        asm = ck.asm["ptx"]
    else:
        asm = ck.asm["amdgcn"]
        stats = parse_amdgcn(asm)
        record.update(stats)
        # Spilled VGPRs, plus any instruction touching scratch memory (an SGPR spill that ran out of VGPR lanes).
        # SGPR spills into VGPR lanes and a reserved but unused scratch slot are reported, not counted.
        record["private_memory_ops"] = count_private_memory_ops(asm)
        record["spills"] = (stats["vgpr_spills"] or 0) + record["private_memory_ops"]
    record["register_limit"] = target.max_regs_per_thread
    record["matrix_instrs"] = count_matrix_instrs(asm, target.backend)
    dots = parse_dots(ck.asm["ttgir"])
    record["dots"] = dots
    record["pipeline"] = parse_pipeline(ck.asm["ttgir"])
    if job.shared_dots:
        wanted = {tuple(d) for d in job.shared_dots}
        shared = [d for d in dots if (d["m"], d["k"], d["n"]) in wanted]
        record["shared_part_layouts"] = sorted({d["layout"] for d in shared})
        record["shared_part_matrix"] = bool(shared) and all(d["layout"] != "fma" for d in shared) \
            and bool(record["matrix_instrs"])
    else:
        record["shared_part_layouts"] = []
        record["shared_part_matrix"] = None
    return record


def failures(record: dict) -> list[str]:
    """Why ``record`` fails the check (empty when it passes)."""
    if not record.get("ok"):
        return [f"compile failed: {record.get('error', '?')[:300]}"]
    why = []
    if record.get("default", True):
        if record.get("spills"):
            why.append(f"spills ({record['spills']})")
        if record.get("registers") is None:
            why.append("no register count reported")
    if record.get("shared_bytes", 0) > record.get("shared_limit", float("inf")):
        why.append(f"shared memory {record['shared_bytes']} B > limit {record['shared_limit']} B")
    wanted = record.get("min_pipeline_depth", 0)
    depth = (record.get("pipeline") or {}).get("depth")
    if wanted and (depth is None or depth < wanted):
        why.append(f"pipeline depth {depth} < {wanted} K/V tiles in flight")
    budget = record.get("max_registers", 0)
    if budget and record.get("registers") is not None and record["registers"] > budget:
        why.append(f"{record['registers']} registers > {budget} (decode suffix-only budget)")
    if record.get("require_matrix") and record.get("shared_part_matrix") is False:
        why.append(f"shared-node part without matrix instructions (layouts {record.get('shared_part_layouts')})")
    return why



def exclusions_from_report(report_path: Path, target_name: str) -> dict:
    """(head_dim, dtype) -> names of default configs that failed a compile-check report for ``target_name``."""
    data = json.loads(Path(report_path).read_text())
    out: dict = {}
    for r in data["records"]:
        if r["target"] == target_name and r["kernel"] == "prefix_attention" and failures(r):
            # Head sizes with the same padded BLOCK_D compile to the same binary, and fp16/bf16 use the same
            # registers and shared memory: a failure with one excludes the config for its twins too.
            dtypes = {"fp16", "bf16"} if r["dtype"] in ("fp16", "bf16") else {r["dtype"]}
            for head_dim in HEAD_DIMS:
                if block_d(head_dim) == block_d(r["head_dim"]):
                    for dt in dtypes:
                        out.setdefault((head_dim, dt), set()).add(r["config_name"])
                        if "suffix-only" not in r.get("variant", ""):
                            # The launch with shared items is the same binary whatever the suffix-only options.
                            out[(head_dim, dt)].update(_same_binary_patterns(r))
    return out


def _same_binary_patterns(record: dict) -> set:
    """Names (``fnmatch`` patterns) of the configs a failed launch with shared items rules out: the same binary under
    any suffix-only options (``<name>_sfw*``), and after a spill the same tiles and warps at more stages too (deeper
    pipelines keep more loop-carried state; sm_90 128x64 + 128x64 at 8 warps with LSE: 255 registers and 108 bytes
    spilled at 3 stages and at 4)."""
    base = record["config_name"].split("_sfw")[0]
    out = {base, base + "_sfw*"}
    m = re.fullmatch(r"(.*_w\d+)_s(\d+)(_.*)?", base)
    if record.get("spills") and m:
        head, stages, tail = m.group(1), int(m.group(2)), m.group(3) or ""
        for more in range(stages + 1, max(NUM_STAGES_CUDA) + 1):
            out.update({f"{head}_s{more}{tail}", f"{head}_s{more}{tail}_sfw*"})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Job lists
# ---------------------------------------------------------------------------------------------------------------

def _kernel_param_names() -> dict:
    """Argument names of the kernels (read from their source, no import: the parent may run the interpreter)."""
    import ast
    import importlib.util

    from prefixattn.autotune import compile_specs as cs

    names = {}
    for fn in (cs.FUSED_KERNEL, cs.MERGE_PAIR_KERNEL, cs.MERGE_N_KERNEL):
        module, attr = fn.split(":")
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            continue
        tree = ast.parse(Path(spec.origin).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == attr:
                names[fn] = [a.arg for a in node.args.args]
    return names


def default_attention_configs(target, head_dim: int, dtype: str) -> list[tuple[str, object]]:
    """``(mode, config)`` pairs the lookup hands out for this target, head size and dtype, deduplicated.

    From the shipped table when the target has one (every config it maps a bucket of this head size and dtype
    to), else the cost model's and the heuristic's choice for a decode and a chunked-prefill bucket.
    """
    from prefixattn.autotune import lookup
    from prefixattn.autotune.buckets import make_bucket

    table = lookup.load_shipped(target.name)
    pairs: dict = {}
    for bucket, cfg in sorted(table.items()):
        if bucket.head_dim == head_dim and bucket.dtype == dtype:
            mode = "decode" if bucket.max_q_len == 1 else "chunked_prefill"
            pairs.setdefault((mode, cfg), None)
    if not pairs:
        for mode, max_q_len in (("decode", 1), ("chunked_prefill", 512)):
            bucket = make_bucket(head_dim=head_dim, dtype=dtype, group=4, q_rows=256, max_q_len=max_q_len,
                                 kv_len=4096)
            cfg = lookup.cost_model_config(bucket, target) or lookup.heuristic_config(bucket)
            pairs.setdefault((mode, cfg), None)
    return list(pairs)


def class_binaries(pairs) -> list[tuple[str, object, bool]]:
    """``(mode, config, has_shared)`` of each work-class binary the ``(mode, config)`` pairs launch: a decode config
    serves the shared and the decode class, a chunked-prefill config the chunk class
    (:func:`prefixattn.planner.tiles.tiles_from_configs`)."""
    return [(mode, cfg, has_shared) for mode, cfg in pairs
            for has_shared in ((True, False) if mode != "chunked_prefill" else (False,))]


def build_jobs(*, targets, kernels, dtypes, head_dims, lse=(False, True), max_configs: int | None = None,
               configs: list | None = None) -> list:
    """Every job of the check: each binary of each default config with and without LSE and with each feature variant
    (:func:`prefixattn.autotune.compile_specs.feature_specs`), and the merge kernels. ``configs`` (a list of
    AttentionConfig) replaces the defaults (marked non-default)."""
    from prefixattn.autotune import compile_specs as cs

    names = _kernel_param_names()
    jobs = []
    for target in targets:
        for dtype in dtypes:
            for head_dim in head_dims:
                if "prefix_attention" in kernels and cs.FUSED_KERNEL in names:
                    if configs is not None:
                        pairs = [("custom", c) for c in configs]
                    else:
                        pairs = default_attention_configs(target, head_dim, dtype)
                    if max_configs is not None:
                        pairs = pairs[:max_configs]
                    common = dict(target=target, dtype=dtype, head_dim=head_dim, default=configs is None,
                                  param_names=names[cs.FUSED_KERNEL])
                    for mode, cfg, has_shared in class_binaries(pairs):
                        for has_lse in lse:
                            jobs.append(cs.fused_job(config=cfg, variant=mode, has_lse=has_lse, has_shared=has_shared,
                                                     **common))
                        jobs += cs.feature_jobs(config=cfg, variant=mode, has_shared=has_shared, **common)
                if "merge" in kernels:
                    jobs += _merge_jobs(target, dtype, head_dim, names)
    return jobs


def _merge_jobs(target, dtype: str, head_dim: int, names: dict) -> list:
    from prefixattn.autotune import compile_specs as cs
    from prefixattn.autotune.lookup import heuristic_merge_config

    return cs.merge_jobs(target=target, dtype=dtype, head_dim=head_dim,
                         config=heuristic_merge_config(head_dim, cs.NUM_QO_HEADS), param_names=names)


#: CI's selection (``--worst-case``) is bf16: its conversions take more registers than fp16's (sm_90, head_dim 256,
#: fp8 e4m3 K/V spilled 144 bytes in bf16 and 128 in fp16 with the same tiles, Triton 3.9).
WORST_CASE_DTYPE = "bf16"


def worst_case_jobs(targets) -> list:
    """CI's selection, the worst case of every axis in a few minutes: every binary of every shipped bf16 config
    (each head size, each work class, LSE on: a spill anywhere in those tables fails it); at the smallest and
    largest head size each of those binaries with every model switch over a 16-bit cache, and with each fp8 type the
    target compiles, alone and under every model switch (:func:`prefixattn.autotune.compile_specs.feature_specs`),
    and the fp32 binaries with LSE;
    the merge kernels at the largest head size. Only the full default run covers fp16, LSE off, each feature switch
    on its own, the NaN guard, fp32 at the other head sizes and fp32 with features."""
    from prefixattn.autotune import compile_specs as cs

    names = _kernel_param_names()
    fused = names[cs.FUSED_KERNEL]
    extremes = (min(HEAD_DIMS), max(HEAD_DIMS))
    jobs = []
    for target in targets:
        for head_dim in HEAD_DIMS:
            common = dict(target=target, dtype=WORST_CASE_DTYPE, head_dim=head_dim, param_names=fused)
            shipped = default_attention_configs(target, head_dim, WORST_CASE_DTYPE)
            for mode, cfg, has_shared in class_binaries(shipped):
                jobs.append(cs.fused_job(config=cfg, variant=mode, has_lse=True, has_shared=has_shared, **common))
                if head_dim in extremes:
                    jobs += cs.feature_jobs(config=cfg, variant=mode, has_shared=has_shared,
                                            specs=cs.feature_specs(target, WORST_CASE_DTYPE, worst_case_only=True),
                                            **common)
        for head_dim in extremes:
            for mode, cfg, has_shared in class_binaries(default_attention_configs(target, head_dim, "fp32")):
                jobs.append(cs.fused_job(target=target, dtype="fp32", head_dim=head_dim, config=cfg, variant=mode,
                                         has_lse=True, has_shared=has_shared, param_names=fused))
        jobs += _merge_jobs(target, WORST_CASE_DTYPE, max(HEAD_DIMS), names)
    return jobs


@contextlib.contextmanager
def _interpreter_off_for_children():
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def run_jobs(jobs, *, workers: int, progress=None) -> list[dict]:
    """Compile ``jobs`` in ``workers`` spawned processes (results in job order)."""
    if not jobs:
        return []
    results: list = [None] * len(jobs)
    # Spawned workers import the package before their initializer runs: they must start with the interpreter off
    # even when this process runs it (a test under TRITON_INTERPRET=1).
    with _interpreter_off_for_children(), ProcessPoolExecutor(
            max_workers=max(1, workers), mp_context=get_context("spawn"), initializer=_worker_init) as pool:
        futures = {pool.submit(compile_one, job): i for i, job in enumerate(jobs)}
        from concurrent.futures import as_completed

        for done, fut in enumerate(as_completed(futures), 1):
            results[futures[fut]] = fut.result()
            if progress:
                progress(done, len(jobs), results[futures[fut]])
    return results


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

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
            f"smem={r.get('shared_bytes')!s:>6s} shared_mma={mma:3s} [{instrs}] {r.get('compile_s')}s")


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
