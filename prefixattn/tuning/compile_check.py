"""Compile every kernel variant for GPU targets on this machine (no GPU needed) and check what the compiler made.

For each target, kernel variant, dtype, head size and default config it runs ``triton.compile`` for the target and
reports: compile ok, registers (ptxas ``-v`` on NVIDIA; ``.vgpr_count`` (+ AGPRs) on AMD), spills (ptxas spill
store + load bytes; ``.vgpr_spill_count`` plus scratch-memory instructions on AMD), shared memory / LDS, the pipeline
depth of the KV loops in the TTGIR (:func:`parse_pipeline`: K/V tiles in flight, from the K/V buffer copies and the
in-loop ``async_wait`` nums on NVIDIA, LDS buffers plus the stream pipeliner's prefetch on AMD), and whether the
shared-node part of the fused kernel issues matrix instructions: its ``tt.dot`` ops got a tensor-core layout in the
TTGIR
(``nvidia_mma`` v2 = ``mma.sync``, v3 = ``wgmma``; ``amd_mfma``) and the assembly contains them. On sm_90 and later
it also reports the Hopper features the binary uses (:func:`hopper_features`: TMA, ``setmaxnreg``, ``wgmma`` and the
depths it is waited at, per-thread ``cp.async``) and grid dependency control (:func:`pdl_features`), checked where the
job requires them (a Hopper build; a launch chained by PDL). Dots are attributed
to the shared part by their shapes, ``[BLOCK_M_SHARED, BLOCK_D] x [BLOCK_D, BLOCK_N_SHARED]`` and
``[BLOCK_M_SHARED, BLOCK_N_SHARED] x [BLOCK_N_SHARED, BLOCK_D]`` (a suffix dot of the same shapes gets the same
layout, so sharing a shape cannot hide a fallback).

A record fails the check (:func:`failures`) when its compile fails, a default config spills, uses more shared memory
than the target has, keeps fewer than ``MIN_PIPELINE_DEPTH`` K/V tiles in flight on NVIDIA (the fused kernel), a
decode suffix-only binary the tables placed under the register budget uses more
(``launch_limits.DECODE_SUFFIX_MAX_REGS``), (fp16/bf16, and fp32 on AMD) its shared-node part has no matrix
instructions, or a Hopper build or a PDL launch lacks what makes it one. Compiles run in worker processes with
``TRITON_INTERPRET=0`` (a kernel defined under the interpreter cannot be compiled), ``workers`` at a time
(:func:`run_jobs`). What is read out of the compiler's output (TTGIR, PTX, ptxas log, AMDGCN) is
:mod:`prefixattn.tuning.compile_analysis`.

The default run compiles every binary of every default config (:func:`build_jobs`); ``--worst-case`` is CI's
selection (:func:`worst_case_jobs`). The command is ``prefixattn compile-check`` (:mod:`prefixattn.cli.compile_check`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from multiprocessing import get_context
from pathlib import Path

from prefixattn.autotune.config_space import HEAD_DIMS, KV_HEADS_MAX_BLOCK_D, NUM_STAGES_CUDA, block_d
from prefixattn.autotune.builds import HOPPER_ARCH
from prefixattn.autotune.pdl import pdl_refusal
from prefixattn.autotune.targets import TARGETS
from prefixattn.planner.tiles import tile_head_dim
from prefixattn.tuning.compile_analysis import (count_matrix_instrs, count_private_memory_ops, hopper_features,
                                               parse_amdgcn, parse_dots, parse_pipeline, parse_ptxas, pdl_features)

KERNELS = ("prefix_attention", "merge", "mla_attention", "hopper")


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
        if type(fn).__name__ == "GluonJITFunction":  # the Hopper build: Gluon's frontend
            from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
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
    if target.backend == "cuda" and target.arch >= HOPPER_ARCH:
        record["hopper"] = hopper_features(asm)
        record["pdl"] = pdl_features(asm)
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
    if record.get("require_hopper"):
        got = record.get("hopper") or {}
        why += [f"no {name} in the Hopper build" for name in ("tma", "wgmma", "setmaxnreg") if not got.get(name)]
    if record.get("require_pdl"):
        got = record.get("pdl") or {}
        why += [f"no griddepcontrol.{name} in a PDL launch" for name in ("launch_dependents", "wait")
                if not got.get(name)]
    if record.get("require_matrix") and record.get("shared_part_matrix") is False:
        why.append(f"shared-node part without matrix instructions (layouts {record.get('shared_part_layouts')})")
    return why



def exclusions_from_report(report_path: Path, target_name: str) -> dict:
    """(head_dim, dtype) -> names of default configs that failed a compile-check report for ``target_name``.
    A binary whose launch a rule changed (:data:`~prefixattn.tuning.compile_specs.RULE_MARK` in its variant:
    ``for_kv`` and ``fp8_block_n`` of :mod:`prefixattn.autotune.config_space`) does not count against its config:
    the table's options did not fail, the rule's did, and the rule is where to mend it."""
    from prefixattn.tuning.compile_specs import RULE_MARK

    data = json.loads(Path(report_path).read_text())
    out: dict = {}
    for r in data["records"]:
        if (r["target"] == target_name and r["kernel"] == "prefix_attention"
                and RULE_MARK not in r.get("variant", "") and failures(r)):
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
                        else:
                            out[(head_dim, dt)].update(_same_suffix_binary_patterns(r))
    return out


def _same_suffix_binary_patterns(record: dict) -> set:
    """Names (``fnmatch`` patterns) of the configs a failed suffix-only launch rules out: every config with the same
    suffix tiles under the same suffix launch (its own ``_sfw`` options, or its shared launch's when it has none),
    whatever its shared tiles; after a spill at more stages too (as :func:`_same_binary_patterns`)."""
    m = re.fullmatch(r"sh\d+x\d+_(sf\d+x\d+)_w(\d+)_s(\d+)(?:_sfw(\d+)_s(\d+))?", record["config_name"])
    if not m:
        return set()
    tiles = m.group(1)
    warps, stages = (int(m.group(4)), int(m.group(5))) if m.group(4) else (int(m.group(2)), int(m.group(3)))
    more = range(stages, max(NUM_STAGES_CUDA) + 1) if record.get("spills") else (stages,)
    return {p for s in more for p in (f"sh*_{tiles}_w{warps}_s{s}", f"sh*_{tiles}_w*_s*_sfw{warps}_s{s}")}


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

    from prefixattn.tuning import compile_specs as cs

    names = {}
    for fn in (cs.FUSED_KERNEL, cs.MERGE_PAIR_KERNEL, cs.MERGE_N_KERNEL, cs.MLA_KERNEL, cs.HOPPER_KERNEL):
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
    (:func:`prefixattn.tuning.compile_specs.feature_specs`), and the merge kernels. ``configs`` (a list of
    AttentionConfig) replaces the defaults (marked non-default)."""
    from prefixattn.tuning import compile_specs as cs

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
                if "hopper" in kernels:
                    jobs += _hopper_jobs(target, dtype, head_dim, names, lse=lse)
                if "merge" in kernels:
                    jobs += _merge_jobs(target, dtype, head_dim, names)
            if "mla_attention" in kernels and cs.MLA_KERNEL in names:  # its own head sizes (DeepSeek-V3's)
                fp8 = cs.fp8_kv_types(target) if dtype != "fp32" else ()
                jobs += _mla_jobs(target, dtype, names, fp8=fp8)
    return jobs


def _hopper_jobs(target, dtype: str, head_dim: int, names: dict, *, lse=(False, True),
                 model_switches: bool = True) -> list:
    """The Hopper build of each distinct shipped shared and chunk tile of this head size and dtype that it serves
    (:func:`prefixattn.autotune.builds.hopper_refusal`; none elsewhere): with and without LSE (``lse``), and with
    every model switch (LSE on)."""
    from prefixattn.autotune.config_space import MODEL_SWITCHES
    from prefixattn.tuning import compile_specs as cs

    # One job set per distinct binary: the build has its own warps and no software pipeline, so only the class's tile
    # reaches it (not the other class's tile, nor the portable launch options).
    tiles = {}
    for mode, cfg, has_shared in class_binaries(default_attention_configs(target, head_dim, dtype)):
        if has_shared or mode == "chunked_prefill":
            tiles.setdefault((has_shared, cfg.shared if has_shared else cfg.suffix), cfg)
    common = dict(target=target, dtype=dtype, head_dim=head_dim, param_names=names[cs.HOPPER_KERNEL], strict=False)
    variants = [(has_lse, ()) for has_lse in lse] + ([(True, tuple(MODEL_SWITCHES))] if model_switches else [])
    jobs = [cs.hopper_job(config=cfg, has_shared=has_shared, has_lse=has_lse, features=features, **common)
            for (has_shared, _), cfg in tiles.items() for has_lse, features in variants]
    return [job for job in jobs if job is not None]


def _mla_jobs(target, dtype: str, names: dict, *, fp8: tuple) -> list:
    """The MLA kernel's class binaries over a ``dtype`` latent cache and over each fp8 latent type of ``fp8``."""
    from prefixattn.tuning import compile_specs as cs

    kinds = (None,) + tuple(fp8)
    return [job for kind in kinds
            for job in cs.mla_jobs(target=target, dtype=dtype, kv_dtype=kind, param_names=names[cs.MLA_KERNEL])]


def _merge_jobs(target, dtype: str, head_dim: int, names: dict) -> list:
    from prefixattn.autotune.lookup import heuristic_merge_config
    from prefixattn.tuning import compile_specs as cs

    return cs.merge_jobs(target=target, dtype=dtype, head_dim=head_dim,
                         config=heuristic_merge_config(head_dim, cs.NUM_QO_HEADS), param_names=names)


#: CI's selection (``--worst-case``) is bf16: its conversions take more registers than fp16's (sm_90, head_dim 256,
#: fp8 e4m3 K/V spilled 144 bytes in bf16 and 128 in fp16 with the same tiles, Triton 3.9).
WORST_CASE_DTYPE = "bf16"
#: KV heads per program of the decode binaries the worst case adds: 4, a Llama-8B step's (GQA 32:8, 16 lanes).
WORST_CASE_KV_HEADS = 4
#: Keys and values of their own head sizes the worst case compiles (DeepSeek's up-projected MLA prefill), on the GPU
#: image's target only (CI's time: their registers are at most those of the wider size's binaries, which the
#: selection holds; these prove the separate V path compiles): sm_90 bf16 at the shipped d256 rows, shared class
#: 216 -> 159 registers (80 -> 68 KB of shared memory), chunk 230 -> 226 (128 -> 104 KB), decode 212 -> 208
#: (138 -> 106 KB), against values padded to the keys' 192 (Triton 3.9; sm_80 178/176/176 from 210/214/214, gfx942
#: VGPRs 303/278/191 from 356/320/212).
WORST_CASE_QK_V_HEAD_DIMS = (192, 128)
WORST_CASE_QK_V_TARGETS = ("sm90",)


def worst_case_jobs(targets) -> list:
    """CI's selection, the worst case of every axis in a few minutes: every binary of every shipped bf16 config
    (each head size, each work class, LSE on: a spill anywhere in those tables fails it); at the smallest and
    largest head size each of those binaries with every model switch over a 16-bit cache, and with each fp8 type the
    target compiles, alone and under every model switch (:func:`prefixattn.tuning.compile_specs.feature_specs`),
    the suffix-only ones also under every switch and the NaN guard over each fp8 type, and the fp32 binaries with
    LSE; the merge kernels at the largest head size. Only the full default run covers fp16, LSE off, each feature
    switch on its own, the NaN guard over a 16-bit cache, fp32 at the other head sizes and fp32 with features. And
    the MLA kernel's class binaries (bf16, and on sm90 over an e5m2 latent); its fp32 binaries and other fp8 latents
    only in the full run. At :data:`~prefixattn.autotune.config_space.KV_HEADS_MAX_BLOCK_D` also each decode binary
    with :data:`WORST_CASE_KV_HEADS` KV heads per program; on :data:`WORST_CASE_QK_V_TARGETS` the class binaries of
    keys and values of :data:`WORST_CASE_QK_V_HEAD_DIMS`. And on sm90 the Hopper build of the matrix classes
    (:mod:`prefixattn.kernels.hopper_attention_kernel`) of every shipped shared and chunk tile it serves, with LSE, at
    the extreme head sizes also under every model switch; at ``KV_HEADS_MAX_BLOCK_D`` each class binary as a launch
    chained by PDL (:mod:`prefixattn.autotune.pdl`), where the target has it."""
    from prefixattn.tuning import compile_specs as cs

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
                if head_dim == KV_HEADS_MAX_BLOCK_D and mode == "decode" and not has_shared:
                    # The decode binary with several KV heads per program (a table's kv_heads; none ships yet), at
                    # the largest head size that takes them.
                    packed = replace(cfg, suffix=replace(cfg.suffix, kv_heads=WORST_CASE_KV_HEADS))
                    jobs.append(cs.fused_job(config=packed, variant=f"{mode}/kv_heads={WORST_CASE_KV_HEADS}",
                                             has_lse=True, has_shared=False, **common))
                if head_dim == KV_HEADS_MAX_BLOCK_D and pdl_refusal(is_hip=target.is_hip, arch=target.arch,
                                                                    interpreted=False) is None:
                    jobs.append(cs.fused_job(config=cfg, variant=mode, has_lse=True, has_shared=has_shared,
                                             pdl=True, **common))
                if head_dim in extremes:
                    specs = cs.feature_specs(target, WORST_CASE_DTYPE, worst_case_only=True)
                    if not has_shared:
                        specs += cs.guarded_fp8_specs(target)
                    jobs += cs.feature_jobs(config=cfg, variant=mode, has_shared=has_shared, specs=specs, **common)
        for head_dim in extremes:
            for mode, cfg, has_shared in class_binaries(default_attention_configs(target, head_dim, "fp32")):
                jobs.append(cs.fused_job(target=target, dtype="fp32", head_dim=head_dim, config=cfg, variant=mode,
                                         has_lse=True, has_shared=has_shared, param_names=fused))
        jobs += _merge_jobs(target, WORST_CASE_DTYPE, max(HEAD_DIMS), names)
        if target.name in WORST_CASE_QK_V_TARGETS:
            # The rows a plan of these sizes reads: the tabled head size of its padded BLOCK_D (lookup's stand-ins).
            qk, v = WORST_CASE_QK_V_HEAD_DIMS
            rows = block_d(tile_head_dim(qk, v))
            for mode, cfg, has_shared in class_binaries(default_attention_configs(target, rows, WORST_CASE_DTYPE)):
                jobs.append(cs.fused_job(target=target, dtype=WORST_CASE_DTYPE, head_dim=qk, v_head_dim=v,
                                         config=cfg, variant=mode, has_lse=True, has_shared=has_shared,
                                         param_names=fused))
        # Over an e5m2 latent on sm90 only (the GPU image's target; CI's time): every target compiles e5m2, and its
        # upcasts took more registers than e4m3's in MLA's decode tiles (sm_90, 16 x 32 tiles: 220 against 172
        # spilled bytes).
        mla_fp8 = cs.fp8_kv_types(target)[-1:] if target.name == "sm90" else ()
        jobs += _mla_jobs(target, WORST_CASE_DTYPE, names, fp8=mla_fp8)
        # The Hopper build of the matrix classes at every head size it serves, with LSE, and at the extremes under
        # every model switch.
        for head_dim in HEAD_DIMS:
            jobs += _hopper_jobs(target, WORST_CASE_DTYPE, head_dim, names, lse=(True,),
                                 model_switches=head_dim in extremes)
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
