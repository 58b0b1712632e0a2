"""compute-sanitizer on one small batch of each kernel class (GPU check step ``sanitizer``).

Cases (:data:`CASES`): decode, mixed (chunked prefill + decode), split-k with many merges, multi-level sharing, a
sliding window, attention sinks, an fp8 (e4m3) cache, a CUDA-graph replay of the ``use_cuda_graph`` wrapper after
a second plan, and the MLA kernel (DeepSeek-V3's latent, decodes under a shared prompt, split-k). Each case is
checked against the fp64 reference. The correctness step runs them once in the driver (compiling their kernels, so
the sanitized processes load them from Triton's cache); then one child process per tool (:data:`TOOLS`) runs all of
them under ``compute-sanitizer --tool <tool>``, instrumenting the kernels whose names contain
:data:`KERNEL_FILTER`. Errors are reported per tool (the tool's summary line) with each case's pass/fail; the output
around an error names the case that printed before it.
"""

from __future__ import annotations

import re
import subprocess
import time

from gpu_check.clock import Clock, guarded

CASES = ("decode", "mixed", "split_k", "multi_level", "window", "sinks", "fp8", "graph_replay", "mla")
#: Tool -> share of the step's budget (racecheck instruments shared memory: the slowest).
TOOLS = {"racecheck": 0.4, "memcheck": 0.3, "synccheck": 0.3}
#: Substring of the kernels instrumented: prefixattn's attention kernels, ``prefix_attention_kernel`` and
#: ``mla_attention_kernel`` (torch's own kernels are not ours; their instrumentation would only slow the run). A
#: renamed kernel must keep it, or this constant must change.
KERNEL_FILTER = "kns=attention_kernel"
#: The MLA case: (query heads, requests, shared prompt tokens, own tokens) on a GPU and in the interpreter; the GPU's
#: own tokens are split (split-k) and merged.
MLA_CASE = {True: (16, 6, 128, 700), False: (16, 3, 128, 40)}
#: Batch scale of the cases on a GPU (cases.build_case): small, so three instrumented passes over the cases fit
#: the step (the first GPU run's one split-k case at scale 8 took 13 s under racecheck, 9 s under memcheck); split-k
#: still splits at this size (64 SMs assumed, 16-token chunks).
GPU_CASE_SCALE = 2
#: Sliding window of the window case (tokens left of each query) and fp8 scales of the fp8 case.
WINDOW_LEFT = 37
FP8_SCALES = (0.5, 0.25)


def _case(name: str, gpu: bool):
    """The cases.Case whose batch the case runs (its scenario, production layout on a GPU)."""
    import torch

    from gpu_check import cases

    dtype = torch.bfloat16 if gpu else torch.float32  # the interpreter's bf16 arithmetic is wrong
    head_dim = 128 if gpu else 32
    scenario = {"window": "mixed", "sinks": "mixed", "fp8": "decode", "graph_replay": "decode"}.get(name, name)
    return cases.Case(scenario, dtype, head_dim, 8 if gpu else 4, 16)


def run_case(name: str, device: str, gpu: bool) -> dict:
    """One sanitizer case, checked against the fp64 reference: ``{"passed", "max_abs_err"}``."""
    import torch

    from gpu_check import cases
    import prefixattn
    from tests.tolerances import ATTENTION_TOL

    if name == "mla":
        return _mla_case(device, gpu)
    case = _case(name, gpu)
    b, options = cases.build_case(case, GPU_CASE_SCALE if gpu else 1, seed=CASES.index(name))
    q, k, v = (t.to(device) for t in (b.q, b.k_cache, b.v_cache))
    meta = tuple(t.to(device) for t in b.metadata)
    run_kw, ref_kw = {}, {}
    if name == "window":
        options["window_left"] = ref_kw["window_left"] = WINDOW_LEFT
    if name == "sinks":
        sinks = torch.randn(b.heads["num_qo_heads"], generator=torch.Generator().manual_seed(5)).to(device)
        run_kw["sinks"] = ref_kw["sinks"] = sinks
    if name == "fp8":
        k = (k.float() / FP8_SCALES[0]).to(torch.float8_e4m3fn)
        v = (v.float() / FP8_SCALES[1]).to(torch.float8_e4m3fn)
        options["kv_dtype"] = torch.float8_e4m3fn
        run_kw["k_scale"], run_kw["v_scale"] = ref_kw["k_scale"], ref_kw["v_scale"] = FP8_SCALES
    n = int(meta[0][-1])
    if name == "graph_replay":
        out = _graph_replay(b, q, k, v, meta, device, gpu)
    else:
        p = prefixattn.plan(*meta, **b.heads, q_dtype=case.dtype, **options)
        out = prefixattn.attention(q, k, v, p, **run_kw)
    want = prefixattn.reference_attention(q[:n], k, v, *meta, compute_dtype=torch.float64, **ref_kw)
    atol, rtol = ATTENTION_TOL[case.dtype]
    err = (out[:n].double() - want).abs()
    passed = bool(torch.isfinite(out[:n]).all() and (err <= atol + rtol * want.abs()).all())
    return dict(passed=passed, max_abs_err=float(err.max()) if n else 0.0)


def _mla_case(device: str, gpu: bool) -> dict:
    """The MLA case (:data:`MLA_CASE`): mla_attention with every shared node taken, against the fp64 reference."""
    import torch

    import prefixattn
    from gpu_check.mla import PAGE, SM_SCALE, _batch, _correct, _want

    b = _batch(*MLA_CASE[gpu], device)
    p = prefixattn.plan_mla(b["qo_indptr"].to(device), b["kv_lens"].to(device), b["table"].to(device),
                            block_size=PAGE, num_heads=b["heads"], sm_scale=SM_SCALE, q_dtype=torch.bfloat16,
                            sharing="always")
    rows, want = _want(b)
    passed, err = _correct(prefixattn.mla_attention(b["q"], b["cache"], p), rows, want)
    return dict(passed=passed and p.has_shared, max_abs_err=err)


def _graph_replay(b, q, k, v, meta, device: str, gpu: bool):
    """The wrapper captured on a first plan (of the batch's first half) and replayed after planning the batch."""
    import torch

    import prefixattn

    n, reqs = int(meta[0][-1]), meta[1].shape[0]
    attn = prefixattn.PrefixSharedAttention(**b.heads, q_dtype=q.dtype, device=device, max_tokens=n,
                                            max_requests=reqs, max_blocks_per_request=meta[2].shape[1],
                                            use_cuda_graph=True)
    out = torch.full_like(q, float("nan"))
    half = reqs // 2
    first = (meta[0][:half + 1], meta[1][:half], meta[2][:half])
    attn.plan(*first, graph_num_tokens=n)
    if not gpu:  # no capture on CPU: the same plans, run eagerly
        attn.plan(*meta, graph_num_tokens=n)
        return attn.run(q, k, v, out=out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attn.run(q, k, v, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out)
    attn.plan(*meta, graph_num_tokens=n)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out


def run_all(device: str, gpu: bool, results=None, prefix: str = "sanitize case") -> bool:
    """Every case once, printed (and recorded as ``gpu_check_sanitizer_cases`` rows when ``results`` is given)."""
    ok = True
    for name in CASES:
        r, seconds = guarded(run_case, name, device, gpu)
        ok &= r["passed"]
        detail = r.get("error") or f"err={r['max_abs_err']:.2e}"
        print(f"{prefix} {name}: passed={r['passed']} {detail} ({seconds:.1f} s)", flush=True)
        if results is not None:
            results.add("gpu_check_sanitizer_cases", "prefixattn", name, "passed", float(r["passed"]), "bool")
    return ok


def step_sanitizer(args, results, skips, driver, which) -> None:
    """One compute-sanitizer child per tool over all cases (``driver``: the command that runs the driver, given
    ``--sanitize-cases``; ``which``: finds the tool); rows ``gpu_check_sanitizer``."""
    clock = Clock("sanitizer", skips)
    if args.dry_run:
        return clock.skip("dry run: compute-sanitizer instruments CUDA kernels (no GPU here); the cases ran in the "
                          "correctness step")
    exe = which("compute-sanitizer")
    if exe is None:
        return clock.skip("compute-sanitizer not found on PATH or in /usr/local/cuda/bin")
    for tool, share in TOOLS.items():
        limit = max(1.0, min(clock.left(), clock.seconds * share))
        cmd = [exe, "--tool", tool, "--kernel-name", KERNEL_FILTER, "--print-limit", "20", *driver,
               "--sanitize-cases"]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            text, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired:
            clock.skip(f"{tool}: did not finish within {limit:.0f} s")
            continue
        cases = [ln for ln in text.splitlines() if ln.startswith("sanitize case")]
        m = re.search(r"ERROR SUMMARY: (\d+) error", text) or re.search(r"(\d+) hazards? displayed", text)
        errors = int(m.group(1)) if m else -1  # -1: no summary line (the tool itself failed: see the output)
        print(f"[sanitizer] {tool}: exit {code}, errors={errors} ({time.monotonic() - start:.0f} s); "
              + " | ".join(cases), flush=True)
        if errors != 0 or code != 0:
            print("\n".join(text.splitlines()[-60:]), flush=True)
        shape = "all cases: " + ",".join(CASES)
        results.add("gpu_check_sanitizer", "prefixattn", shape, f"{tool}_errors", errors, "count")
        results.add("gpu_check_sanitizer", "prefixattn", shape, f"{tool}_exit_code", code, "code")
        results.add("gpu_check_sanitizer", "prefixattn", shape, f"{tool}_cases_passed",
                    sum("passed=True" in c for c in cases), "count")
