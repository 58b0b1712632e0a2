"""The card's ceilings as an attention kernel meets them, and each shape's floors (GPU check step ``ceilings``).

- **HBM rate** (the memory floor's): the best of a tuned read-only streaming kernel (:func:`read_sweep`: vector width
  and loads in flight per program, programs per SM, over a buffer 17x the H200's L2, each config checked) and the
  device-to-device copy's bytes moved (read + written) per second. A lone read-only kernel was beaten in its own run
  (H200 at 74e5177: 3,913 GB/s read-only, 4,233 GB/s copy, and FlashInfer read 4.54 TB/s of distinct bytes), so
  neither alone is the floor. The card's spec-sheet peak is printed beside it; a bf16 matmul rate is kept for
  comparison.
- **Attention compute rate**: causal prefill attention over one long dense request (GQA 32:8, head_dim 128, bf16),
  timed for prefixattn and, when its JIT is ready, FlashInfer's batch prefill (fa3 on sm90, else fa2); the fastest
  correct one is the rate (an attention kernel's reachable FLOP/s, not a dense GEMM's).
- **Per-shape floors**: memory = (distinct KV bytes + q + out) / the HBM rate; compute = the batch's attention FLOPs
  / the attention rate; ``overlapped`` = max of the two (perfect overlap), ``serial`` = their sum (none).
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpu_check.clock import Clock, failure

#: Bytes the read kernel streams (17x an H200's 60 MB L2, 20x an H100's: the first and last waves' L2 hits are noise).
READ_BYTES, DRY_READ_BYTES = 1 << 30, 1 << 16
#: The read kernel's configs: (int32 lanes per program per load, loads in flight per iteration, warps). 4,096 lanes at
#: 8 warps are 16 bytes per thread per load (one 128-bit load); the unrolled ones keep 2-8 such loads in flight per
#: thread, the 4-warp ones fit more programs per SM. Each config is a compile (~1 s on a GPU host), so few.
READ_CONFIGS = ((4096, 1, 8), (4096, 4, 8), (8192, 2, 8), (2048, 4, 4), (1024, 8, 4))
#: Programs per SM of the persistent read grid, tried for every config (a launch parameter: no recompile).
READ_PROGRAMS_PER_SM = (1, 2, 4, 8, 16)
#: The dry run's share of the sweep: the code path, not a measurement.
DRY_READ_CONFIGS, DRY_READ_PROGRAMS_PER_SM = READ_CONFIGS[:2], (1, 2)
#: Spec-sheet HBM bandwidth by device name (substring, checked in order), printed beside the measured floor:
#: NVIDIA's datasheets (H200 SXM 4.8 TB/s, H100 SXM 3.35, H100 PCIe 2.0, A100 80GB SXM 2.039, A100 40GB 1.555) and
#: AMD's (MI300X 5.3).
SPEC_HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12),
                        ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("MI300X", 5.3e12))
#: Long causal prefill for the attention rate: tokens (GPU / dry run) and heads (q, kv), head_dim.
RATE_TOKENS, DRY_RATE_TOKENS = 16384, 64
RATE_HEADS, DRY_RATE_HEADS = (32, 8), (2, 1)
RATE_HEAD_DIM, DRY_RATE_HEAD_DIM = 128, 32
#: Page size of the rate batches: vLLM's and SGLang's default, where a KV tile spans several pages.
RATE_PAGE = 16
#: The paged chunks of the class-rates step (:mod:`gpu_check.class_rates`): (requests, chunk tokens, cached tokens
#: each), GPU / dry run: 4,096-token chunks over 32,768 cached tokens, as a long prompt's later chunks run.
PAGED_CHUNKS, DRY_PAGED_CHUNKS = (2, 4096, 32768), (2, 32, 64)
#: Query rows checked against the reference (the last ones: they see the whole KV); a full 16K x 16K reference would
#: hold 34 GB of logits.
RATE_CHECK_ROWS = 256


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _stream_read_kernel(partial_ptr,  # [num_programs] int32 out: one value per program (keeps the loads alive)
                        x_ptr,  # [n] int32 in: the streamed buffer
                        n,
                        BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK * UNROLL
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    offs = pid * BLOCK * UNROLL + tl.arange(0, BLOCK)
    for start in range(0, n, step):
        for u in tl.static_range(UNROLL):  # UNROLL independent loads in flight before the XORs need them
            idx = start + u * BLOCK + offs
            acc ^= tl.load(x_ptr + idx, mask=idx < n, other=0)
    tl.store(partial_ptr + pid, tl.reduce(acc, 0, _xor))


def stream_read(x, num_programs: int, config=READ_CONFIGS[0]):
    """Launch the read kernel over int32 ``x`` with ``config`` (lanes, unroll, warps): the per-program partials."""
    import torch

    block, unroll, warps = config
    partial = torch.empty(num_programs, dtype=torch.int32, device=x.device)
    _stream_read_kernel[(num_programs,)](partial, x, x.numel(), BLOCK=block, UNROLL=unroll, num_warps=warps)
    return partial


def read_sweep(timer, device: str) -> dict:
    """Every (config, programs per SM) of the read kernel over one buffer, each checked (its partials XOR to the
    buffer's XOR) then timed (L2 not flushed: the buffer is 17x the L2). ``{"bytes_per_s": best, "config": (lanes,
    unroll, warps, programs per SM), "tried": n}``; a wrong config is an error (a kernel bug, not a slow config)."""
    import numpy as np
    import torch

    nbytes = DRY_READ_BYTES if timer.dry_run else READ_BYTES
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (nbytes // 4,), dtype=torch.int32, device=device)
    want = int(np.bitwise_xor.reduce(x.cpu().numpy()))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 1
    configs = DRY_READ_CONFIGS if timer.dry_run else READ_CONFIGS
    per_sm = DRY_READ_PROGRAMS_PER_SM if timer.dry_run else READ_PROGRAMS_PER_SM
    best, tried = None, 0
    for config in configs:
        for k in per_sm:
            programs = sms * k
            got = stream_read(x, programs, config)
            if int(np.bitwise_xor.reduce(got.cpu().numpy())) != want:
                raise RuntimeError(f"read kernel {config} x {k} per SM: its partials do not XOR to the buffer's XOR")
            fn = lambda: stream_read(x, programs, config)  # noqa: E731
            us = timer.repeat(fn, timer.runs_for(fn), flush=False)["median"]
            tried += 1
            if best is None or us < best[0]:
                best = (us, (*config, k))
    return dict(bytes_per_s=nbytes / (best[0] * 1e-6), config=best[1], tried=tried)


def spec_hbm_bytes_per_s(device_name: str) -> float | None:
    """The spec-sheet HBM bandwidth of a device by its name (:data:`SPEC_HBM_BYTES_PER_S`), or None."""
    return next((rate for key, rate in SPEC_HBM_BYTES_PER_S if key in device_name), None)


def _rate_operands(dry_run: bool, device: str, seed: int):
    """``(heads (q, kv), head_dim, draw)`` of the rate batches; ``draw(*shape)`` gives random operands (fp32 in the
    dry run, bf16 on a GPU)."""
    import torch

    dtype = torch.float32 if dry_run else torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
    g = torch.Generator(device=device).manual_seed(seed)
    draw = lambda *s: torch.randn(*s, generator=g, device=device).to(dtype)  # noqa: E731
    return (DRY_RATE_HEADS if dry_run else RATE_HEADS), (DRY_RATE_HEAD_DIM if dry_run else RATE_HEAD_DIM), draw


def attention_rate_batch(dry_run: bool, device: str):
    """One long dense causal prefill request, its pages in order: (q, k_cache, v_cache, qo_indptr, kv_lens,
    block_table, flops)."""
    import torch

    from gpu_check.cases import causal_attention_flops

    t = DRY_RATE_TOKENS if dry_run else RATE_TOKENS
    (hq, hkv), d, draw = _rate_operands(dry_run, device, 7)
    bs = RATE_PAGE
    q = draw(t, hq, d)
    k, v = draw(t // bs, bs, hkv, d), draw(t // bs, bs, hkv, d)
    qo = torch.tensor([0, t], dtype=torch.int32, device=device)
    lens = torch.tensor([t], dtype=torch.int32, device=device)
    table = torch.arange(t // bs, dtype=torch.int32, device=device)[None]
    return q, k, v, qo, lens, table, causal_attention_flops([t], [t], hq, d)


def paged_chunk_batch(dry_run: bool, device: str):
    """Prefill chunks over a cached context as an engine's cache holds them (:data:`PAGED_CHUNKS`): each request's
    pages distinct and all of them in a shuffled order, so no two neighbouring pages are neighbours in memory; the
    same tuple as :func:`attention_rate_batch`."""
    import torch

    from gpu_check.cases import causal_attention_flops

    n, new, cached = DRY_PAGED_CHUNKS if dry_run else PAGED_CHUNKS
    (hq, hkv), d, draw = _rate_operands(dry_run, device, 11)
    bs = RATE_PAGE
    pages = (new + cached) // bs
    q = draw(n * new, hq, d)
    k, v = draw(n * pages, bs, hkv, d), draw(n * pages, bs, hkv, d)
    order = torch.randperm(n * pages, generator=torch.Generator().manual_seed(13))
    table = order.view(n, pages).to(torch.int32).to(device)
    qo = torch.arange(0, n * new + 1, new, dtype=torch.int32, device=device)
    lens = torch.full((n,), new + cached, dtype=torch.int32, device=device)
    return q, k, v, qo, lens, table, causal_attention_flops([new] * n, [new + cached] * n, hq, d)


def _default_backend(device: str) -> str:
    """FlashInfer's prefill backend an engine would take on ``device``: fa3 on sm90, else fa2."""
    import torch
    from peers.flashinfer import FA3_MAJOR, device_major

    return "fa3" if device == "cuda" and device_major(torch.device(device)) == FA3_MAJOR else "fa2"


def attention_rates(timer, device: str, flashinfer_ready: set, batch=None, backends=None, failures=None,
                    hopper: bool = False) -> dict:
    """``{provider: (FLOP/s, median us)}`` of causal attention over ``batch`` (default :func:`attention_rate_batch`)
    per provider that ran: prefixattn always, FlashInfer's batch prefill on each of ``backends`` (default: the one
    of :func:`_default_backend`) whose JIT is ready, with ``hopper`` last prefixattn asking for the Hopper build
    (``prefixattn-hopper``, where the plan's chunk class takes it); each output checked against the reference first
    (the last request's last rows), then run eagerly, L2 warm (the KV is past the L2 on a GPU: a multi-ms
    compute-bound run). A provider that fails or is wrong is printed and left out (``failures``, a dict: gets its
    reason)."""
    import prefixattn
    import torch
    from peers.flashinfer import PagedMeta, plan_peer
    from tests.tolerances import ATTENTION_TOL

    q, k, v, qo, lens, table, flops = batch or attention_rate_batch(timer.dry_run, device)
    hq, d, hkv = q.shape[1], q.shape[2], k.shape[2]
    rows = min(RATE_CHECK_ROWS, int(qo[-1] - qo[-2]))  # the last request's
    tail = torch.tensor([0, rows], dtype=torch.int32, device=device)
    want = prefixattn.reference_attention(q[-rows:], k, v, tail, lens[-1:], table[-1:])
    def plan():
        return prefixattn.plan(qo, lens, table, block_size=k.shape[1], num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                               q_dtype=q.dtype)

    p = plan()
    out = torch.empty_like(q)
    runs = {"prefixattn": lambda: prefixattn.attention(q, k, v, p, out=out)}
    why = {}
    for backend in backends or (_default_backend(device),):
        name = f"flashinfer-prefill-{backend}"
        if name in flashinfer_ready:
            try:
                peer = plan_peer(name, PagedMeta(qo, lens, table, k.shape[1], hq, hkv, d, q.dtype), graph=False)
            except Exception as exc:  # noqa: BLE001 - e.g. fa3 off sm90: the other providers' rates stand
                why[name] = f"not planned: {failure(exc)}"
                continue
            runs[name] = lambda peer=peer: peer.launch(q, k, v)
    if hopper:
        from prefixattn.autotune.builds import HOPPER, asking_for

        with asking_for(HOPPER):
            hp = plan()
        if hp.chunk_build == HOPPER:
            runs["prefixattn-hopper"] = lambda: prefixattn.attention(q, k, v, hp, out=out)
        else:
            why["prefixattn-hopper"] = f"the portable build: {hp.stats['chunk_build_why']}"
    rates = {}
    atol, rtol = ATTENTION_TOL[q.dtype]
    for provider, fn in runs.items():
        try:
            got = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            if not bool(((got[-rows:].float() - want).abs() <= atol + rtol * want.abs()).all()):
                why[provider] = "its output is wrong: no rate from it"
                continue
            us = timer.repeat(fn, timer.runs_for(fn), flush=False)["median"]
        except Exception as exc:  # noqa: BLE001 - one provider failing leaves the other's rate
            why[provider] = f"failed: {failure(exc)}"
            continue
        rates[provider] = (flops / (us * 1e-6), us)
    for provider, reason in why.items():
        print(f"[rates] {provider} {reason}"[:300], flush=True)
    if failures is not None:
        failures.update(why)
    return rates


def shape_floors(batch, hbm_bytes_per_s: float, attention_flops_per_s: float) -> dict:
    """Seconds: ``memory``, ``compute``, ``overlapped`` (max) and ``serial`` (sum) for one batch; ``bytes``: the
    distinct bytes the memory floor counts (KV once, q in, out out)."""
    from gpu_check.cases import attention_flops

    nbytes = batch.unique_kv_bytes() + 2 * batch.q.numel() * batch.q.element_size()
    memory = nbytes / hbm_bytes_per_s
    compute = attention_flops(batch) / attention_flops_per_s
    return dict(memory=memory, compute=compute, overlapped=max(memory, compute), serial=memory + compute,
                bytes=nbytes)


def step_ceilings(args, results, skips, device: str) -> dict:
    """The HBM floor's rate: the best of the read-only kernel's sweep and the device-to-device copy's bytes moved (read
    + written) per second, with the card's spec peak beside it; the L2 size; a bf16 matmul rate (for comparison: no
    floor)."""
    import torch

    from gpu_check.measure import Timer

    clock = Clock("ceilings", skips)
    timer = Timer(args.dry_run, device)
    # 1 GiB copies (far past the L2) and 8192^3 bf16 matmuls; tiny in the dry run.
    nbytes, n = (1 << 20, 128) if args.dry_run else (1 << 30, 8192)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = timer.repeat(lambda: dst.copy_(src), 3, flush=False)["median"]
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    bm = torch.randn(n, n, device=device).to(torch.bfloat16)
    mm_us = timer.repeat(lambda: a @ bm, 3, flush=False)["median"]
    read = read_sweep(timer, device)
    ceil = dict(copy_bytes_per_s=2 * nbytes / (copy_us * 1e-6), matmul_flops_per_s=2 * n ** 3 / (mm_us * 1e-6),
                read_bytes_per_s=read["bytes_per_s"])
    ceil["hbm_bytes_per_s"] = max(ceil["read_bytes_per_s"], ceil["copy_bytes_per_s"])
    ceil["l2_bytes"] = l2_bytes(device)
    spec = spec_hbm_bytes_per_s(results.device)
    lanes, unroll, warps, per_sm = read["config"]
    print(f"[ceilings] HBM floor {ceil['hbm_bytes_per_s'] / 1e9:.0f} GB/s (best of: read-only stream "
          f"{ceil['read_bytes_per_s'] / 1e9:.0f} GB/s, {read['tried']} configs, best {lanes} lanes x {unroll} loads, "
          f"{warps} warps, {per_sm} programs/SM; copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s read+write); spec "
          f"peak {'-' if spec is None else f'{spec / 1e9:.0f} GB/s'}; L2 {ceil['l2_bytes'] / 2**20:.0f} MiB; bf16 "
          f"matmul {ceil['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({clock.seconds - clock.left():.1f} s)", flush=True)
    results.add("gpu_ceiling", "triton", "read-only stream", "read_gbps", ceil["read_bytes_per_s"] / 1e9, "GB/s")
    results.add("gpu_ceiling", "triton", "read-only stream", "read_configs_tried", read["tried"], "count")
    results.add("gpu_ceiling", "torch", f"copy {nbytes >> 20} MiB", "copy_gbps", ceil["copy_bytes_per_s"] / 1e9,
                "GB/s")
    results.add("gpu_ceiling", "floor", "HBM (best of read-only and copy)", "hbm_gbps", ceil["hbm_bytes_per_s"] / 1e9,
                "GB/s")
    if spec is not None:
        results.add("gpu_ceiling", "spec", "HBM (datasheet)", "spec_gbps", spec / 1e9, "GB/s")
    results.add("gpu_ceiling", "device", "L2 cache", "l2_mib", ceil["l2_bytes"] / 2 ** 20, "MiB")
    results.add("gpu_ceiling", "torch", f"bf16 matmul {n}^3", "matmul_tflops", ceil["matmul_flops_per_s"] / 1e12,
                "TFLOP/s")
    return ceil


#: L2 bytes where the device does not say (the dry run's CPU): an H100's 50 MiB, so the dry run's rows are in range.
DEFAULT_L2_BYTES = 50 * 2 ** 20


def l2_bytes(device: str) -> int:
    """The device's L2 cache in bytes (``torch.cuda.get_device_properties().L2_cache_size``), else
    :data:`DEFAULT_L2_BYTES`."""
    import torch

    if device == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        if size:
            return int(size)
    return DEFAULT_L2_BYTES


def attention_ceiling(args, results, device: str, ceil: dict, fi_ready: dict) -> None:
    """The attention compute rate (after FlashInfer's JIT, so its prefill can set it): the fastest correct causal
    prefill of :func:`attention_rate_batch`; adds ``attention_flops_per_s`` to ``ceil``."""
    from gpu_check.measure import Timer

    ready = {p for p, ok in fi_ready.items() if ok is True}
    rates = {p: rate for p, (rate, _) in attention_rates(Timer(args.dry_run, device), device, ready).items()}
    for provider, rate in rates.items():
        results.add("gpu_ceiling", provider, "causal prefill (attention rate)", "attention_tflops", rate / 1e12,
                    "TFLOP/s")
    ceil["attention_flops_per_s"] = max(rates.values()) if rates else ceil["matmul_flops_per_s"]
    print(f"[ceilings] attention rate {ceil['attention_flops_per_s'] / 1e12:.1f} TFLOP/s ("
          + (", ".join(f"{p} {r / 1e12:.1f}" for p, r in rates.items()) if rates else
             "none measured: the bf16 matmul rate stands in, a lower compute floor") + ")", flush=True)
