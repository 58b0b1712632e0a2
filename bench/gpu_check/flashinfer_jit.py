"""FlashInfer's JIT off the GPU check's critical path: a background process, started first, compiles every module
the FlashInfer peers use (bf16, head_dim 128: the timing shapes and the model step) in one ninja run across the
machine's cores, then plans and runs each peer once on a tiny batch (loading what it built, and building anything the
first pass did not name). It prints one JSON line per peer as that peer becomes ready, so a run that cannot wait for
all of them still uses those that are.

Measured before this module: the 2-level cascade alone took 96-115 s to JIT-compile on the first GPU host (three
runs), while the correctness and sanitizer steps ran.

Ahead of time, optionally: ``python -m gpu_check.flashinfer_jit --aot-build DEST`` with bench/ on ``PYTHONPATH`` (run by
``scripts/gpu_wheels.sh --aot`` on a CPU machine, with a pip-installed CUDA 13.0 nvcc as ``CUDA_HOME``) builds the same
modules for sm90a and copies each ``.so`` to ``DEST/<module>/<module>.so``; ``scripts/gpu_check.sh`` puts them where
FlashInfer looks for AOT modules (``flashinfer/data/aot``), so its wrappers load them instead of compiling. The warm-up
loads every AOT module first and, if any fails to load there, removes them all and compiles as without them (nothing has
loaded them on a GPU yet). Measured on the 2-core CPU host (one build job, niced, other jobs running), FlashInfer 0.6.0,
CUDA 13.0 pip wheels, sm90a: cascade 19 s / 0.4 MiB; batch decode 35 s / 0.6 MiB; batch prefill fa3 (10 translation
units) 1014 s wall, 12 CPU-minutes, 3.9 MiB; batch prefill fa2 + BatchAttention + POD (10 + 6 + 18 units) 2468 s wall,
29 CPU-minutes, 5.0 / 0.8 / **75.1 MiB**. All six load through ``tvm_ffi.load_module`` on a CPU host. POD alone is over
the 64 MiB a GPU call carries, so it is not built ahead of time (:data:`AOT_EXCLUDED`: the background build compiles it
there); the other five are 10.7 MiB. Whether they load and run on the GPU machine is not measured yet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from gpu_check.clock import failure

#: Past this many seconds from the start of the run the timing step stops waiting and uses the peers reported ready.
JIT_LIMIT_S = 300
#: The dtype and head size every FlashInfer peer is compiled for (timing shapes and model step).
DTYPE, HEAD_DIM = "bfloat16", 128
#: The MLA step's latent and rotary widths (DeepSeek-V3; gpu_check.mla).
MLA_CKV_DIM, MLA_KPE_DIM = 512, 64
#: The naive form's head widths (no-rope 128 + rope 64 keys, 128-wide values) of the MLA step's TyphoonMLA baseline.
MLA_NAIVE_QK_DIM, MLA_NAIVE_VO_DIM = 192, 128
#: Modules not built ahead of time, by name prefix, and why: they go to the background build on the GPU machine.
AOT_EXCLUDED = {"batch_pod_": "75 MiB for sm90a (measured), over the 64 MiB a GPU call carries"}
#: Modules the background build compiles last (name prefix -> the peer that needs them): POD's 18 translation units
#: took ~1,800 of the 2,468 s of the fa2 + BatchAttention + POD build here (the objects' timestamps; fa2's 10 ~570 s,
#: BatchAttention's 6 ~100 s), so every other peer is ready before them.
LAST_BUILT = {"batch_pod_": "flashinfer-pod"}
#: Parallel nvcc jobs of the background build (FlashInfer reads MAX_JOBS): the GPU host's 16 cores less a few for
#: the driver's own Triton compiles, which run meanwhile.
MAX_JOBS = 12


def specs():
    """FlashInfer 0.6.0's JIT specs for the peers at DTYPE/HEAD_DIM, with the arguments each wrapper passes (read
    from decode.py, prefill.py, attention.py, pod.py, cascade.py, mla.py): no RoPE, no window, no soft cap, no fp16
    QK; the MLA wrapper's at MLA_CKV_DIM/MLA_KPE_DIM, and the single prefill of its TyphoonMLA-style baseline."""
    import torch
    from flashinfer.jit import (gen_batch_attention_module, gen_batch_decode_module, gen_batch_mla_module,
                                gen_batch_pod_module, gen_batch_prefill_module, gen_single_prefill_module)
    from flashinfer.jit.cascade import gen_cascade_module

    dt, idx, none = getattr(torch, DTYPE), torch.int32, 0
    out = [gen_batch_prefill_module(b, dt, dt, dt, idx, HEAD_DIM, HEAD_DIM, none, False, False, False)
           for b in ("fa2", "fa3")]
    out.append(gen_batch_decode_module(dt, dt, dt, idx, HEAD_DIM, HEAD_DIM, none, False, False))
    out.append(gen_batch_attention_module(dt, dt, dt, idx, HEAD_DIM, HEAD_DIM, none, False, False))
    out.append(gen_batch_pod_module(dt, dt, dt, HEAD_DIM, none, False, False, False, idx, none, False, False))
    out.append(gen_cascade_module())
    # The MLA step's wrapper (mla.py: backend "auto" is fa3 on sm90a), DeepSeek-V3's 512 + 64, bf16.
    out.append(gen_batch_mla_module("fa3", dt, dt, dt, idx, MLA_CKV_DIM, MLA_KPE_DIM, False))
    # Its TyphoonMLA-style baseline's naive half: one fa3 prefill with DeepSeek-V3's 192-wide keys, 128-wide values.
    # Read from the generator's signature at FlashInfer main, not checked against 0.6.0 on a GPU: a generator with
    # other parameters must not cost every other peer its warm-up (the baseline then compiles at its first run).
    try:
        out.append(gen_single_prefill_module("fa3", dt, dt, dt, MLA_NAIVE_QK_DIM, MLA_NAIVE_VO_DIM, none, False,
                                             False, False))
    except TypeError as exc:
        print(f"flashinfer_jit: no ahead-of-time spec for the TyphoonMLA baseline's prefill ({exc})", flush=True)
    return out


def aot_build(dest: str) -> int:
    """CPU host: build :func:`specs` for sm90a (``FLASHINFER_CUDA_ARCH_LIST``, ``CUDA_HOME`` set by the caller) and
    copy each module to ``dest/<name>/<name>.so`` with a manifest of versions, sizes and build time."""
    import shutil
    from pathlib import Path

    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    import flashinfer
    from flashinfer.jit import build_jit_specs

    start = time.monotonic()
    todo = [s for s in specs() if not s.name.startswith(tuple(AOT_EXCLUDED))]
    build_jit_specs(todo, skip_prebuilt=False)
    out, manifest = Path(dest), dict(flashinfer=flashinfer.__version__, arch=os.environ["FLASHINFER_CUDA_ARCH_LIST"],
                                     build_s=time.monotonic() - start, modules={}, excluded=AOT_EXCLUDED)
    for spec in todo:
        target = out / spec.name / f"{spec.name}.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, target)
        manifest["modules"][spec.name] = target.stat().st_size
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps(manifest), flush=True)
    return 0


def _load_aot_or_drop() -> str:
    """Load every AOT module FlashInfer finds; if one fails, remove them all (the JIT then builds every module)."""
    import shutil

    found = [s for s in specs() if s.is_aot]
    if not found:
        return "no AOT modules"
    try:
        for spec in found:
            spec.build_and_load()
        return f"{len(found)} AOT modules loaded"
    except Exception as exc:  # a module built elsewhere that does not load here: compile instead
        from flashinfer.jit import env as jit_env

        shutil.rmtree(jit_env.FLASHINFER_AOT_DIR, ignore_errors=True)
        return f"AOT modules removed, they did not load: {failure(exc)}"


def _build(todo: list, start: float, label: str) -> None:
    """One ninja run over ``todo`` (sm90 only: elsewhere fa3 cannot build and the peers build on first use)."""
    import torch

    try:
        from flashinfer.jit import build_jit_specs

        if torch.cuda.get_device_capability()[0] != 9:
            raise RuntimeError("not sm90: modules built on first use")
        build_jit_specs(todo)
        print(json.dumps({label: time.monotonic() - start}), flush=True)
    except Exception as exc:  # the per-peer runs still build what they need
        print(json.dumps({f"{label}_failed": failure(exc)}), flush=True)


def warmup() -> int:
    """Child process: load the AOT modules (if any), build the others (POD's last: its 18 translation units are the
    slowest, and the other peers need not wait for them), then one tiny run of each peer (decode and mixed batches,
    GQA 32:8), each reported as it becomes ready."""
    import torch

    from batches.shapes import Shape, build_batch
    from peers.flashinfer import PEERS, Unavailable, prepare

    start = time.monotonic()
    print(json.dumps({"aot": _load_aot_or_drop(), "since_start_s": time.monotonic() - start}), flush=True)
    todo = specs()
    slow = tuple(LAST_BUILT)
    _build([s for s in todo if not s.name.startswith(slow)], start, "built_all_specs_s")
    common = dict(shared=64, distinct=32, per_group=0, num_qo_heads=32, num_kv_heads=8, head_dim=HEAD_DIM,
                  dtype=DTYPE, paper="flashinfer-warmup")
    batches = [build_batch(Shape(scenario="decode", num_decode=4, num_prefill=0, **common), device="cuda"),
               build_batch(Shape(scenario="mixed", num_decode=3, num_prefill=1, **common), device="cuda")]
    for name in sorted(PEERS, key=lambda p: p in LAST_BUILT.values()):
        if name in LAST_BUILT.values():
            _build([s for s in todo if s.name.startswith(slow)], start, "built_last_specs_s")
        t0, status = time.monotonic(), None
        for batch in batches:
            try:
                prepared = prepare(batch, name, graph=False)
                prepared.result(prepared.run())
                torch.cuda.synchronize()
                status = True
            except Unavailable:
                continue  # this batch kind is not the peer's
            except Exception as exc:
                status = failure(exc)
                break
        print(json.dumps({"peer": name, "ready": status if status is not None else "no batch kind it takes",
                          "seconds": time.monotonic() - t0, "since_start_s": time.monotonic() - start}), flush=True)
    return 0


def start(driver, dry_run: bool):
    """The background warm-up process (None in the dry run: FlashInfer's kernels are CUDA-only): ``driver`` (the
    command that runs the driver, :data:`gpu_check.driver.DRIVER`) with ``--flashinfer-warmup``. Its output goes to a
    file, read when the timing step asks (a pipe nobody reads could fill and stall it)."""
    if dry_run:
        return None
    log = tempfile.TemporaryFile(mode="w+")
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", str(MAX_JOBS)))
    proc = subprocess.Popen([*driver, "--flashinfer-warmup"], stdout=log,
                            stderr=subprocess.STDOUT, text=True, env=env)
    return proc, log


def ready(handle, run_start: float, results=None, *, dry_run: bool = False) -> dict:
    """``{peer: True | failure text}`` for the peers the warm-up reported, plus ``_why`` when some are missing
    (waits until the warm-up ends or JIT_LIMIT_S after ``run_start``); with ``results``, rows ``flashinfer_jit``:
    seconds from the warm-up's start to the shared build's end and to each peer's readiness. The dry run has no
    warm-up: every peer runs on the stand-in FlashInfer the driver installed (its kernels are CUDA-only)."""
    if handle is None:
        from peers.flashinfer import PEERS

        if dry_run:
            print("[flashinfer-jit] dry run: FlashInfer's kernels are CUDA-only; the peers run on the stand-in of "
                  "tests/bench_support/fake_flashinfer.py (the harness's code paths, not FlashInfer)", flush=True)
            return {name: True for name in PEERS}
        return {"_why": "FlashInfer's warm-up was not started"}
    proc, log = handle
    try:
        proc.wait(timeout=max(1.0, JIT_LIMIT_S - (time.monotonic() - run_start)))
        late = ""
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        late = f"its JIT warm-up did not finish within {JIT_LIMIT_S} s of the start"
    log.seek(0)
    text = log.read()
    out = {}
    for line in (text or "").splitlines():
        if line.startswith("{"):
            info = json.loads(line)
            print(f"[flashinfer-jit] {info}", flush=True)
            if "peer" in info:
                out[info["peer"]] = info["ready"]
                if results is not None:
                    results.add("flashinfer_jit", info["peer"], "warm-up", "ready_after_s", info["since_start_s"],
                                "s")
                    results.add("flashinfer_jit", info["peer"], "warm-up", "ready", float(info["ready"] is True),
                                "bool")
            elif "built_all_specs_s" in info and results is not None:
                results.add("flashinfer_jit", "flashinfer", "warm-up", "built_all_specs_s",
                            info["built_all_specs_s"], "s")
        elif line.strip():
            print(f"[flashinfer-jit] {line}"[:400], flush=True)
    if late or proc.returncode not in (0, None):
        out["_why"] = late or f"the warm-up process exited with {proc.returncode}"
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--aot-build":
        sys.exit("usage: PYTHONPATH=bench python -m gpu_check.flashinfer_jit --aot-build DEST   (CPU host; CUDA_HOME: "
                 "a CUDA 13.0 nvcc)")
    sys.exit(aot_build(sys.argv[2]))
