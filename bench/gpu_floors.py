"""The card's ceilings as an attention kernel meets them, and each shape's floors (GPU check step ``floors``).

- **Read bandwidth**: a read-only streaming kernel (:func:`_stream_read_kernel`, every byte of a 1 GiB buffer loaded
  once, 16 bytes per lane, one int32 written per program) - what a KV-reading kernel can reach. The device-to-device
  copy (read + write bytes) and a bf16 matmul rate are kept beside it for comparison, not used as floors.
- **Attention compute rate**: causal prefill attention over one long dense request (GQA 32:8, head_dim 128, bf16),
  timed for prefixattn and, when its JIT is ready, FlashInfer's batch prefill (fa3 on sm90, else fa2); the fastest
  is the rate (an attention kernel's reachable FLOP/s, not a dense GEMM's).
- **Per-shape floors**: memory = (distinct KV bytes + q + out) / read bandwidth; compute = the batch's attention
  FLOPs / the attention rate; ``overlapped`` = max of the two (perfect overlap), ``serial`` = their sum (none).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Bytes the read-bandwidth kernel streams (20x an H100's L2: the first and last waves' L2 hits are noise).
READ_BYTES, DRY_READ_BYTES = 1 << 30, 1 << 16
#: int32 lanes per program per iteration: 4096 x 4 bytes = 16 KiB, 16 bytes per lane at 8 warps.
READ_BLOCK = 4096
#: Programs per SM of the persistent read grid (enough loads in flight to cover HBM latency).
READ_PROGRAMS_PER_SM = 8
#: Long causal prefill for the attention rate: tokens (GPU / dry run) and heads (q, kv), head_dim.
RATE_TOKENS, DRY_RATE_TOKENS = 16384, 64
RATE_HEADS, DRY_RATE_HEADS = (32, 8), (2, 1)
RATE_HEAD_DIM, DRY_RATE_HEAD_DIM = 128, 32
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
                        BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    for start in range(0, n, step):
        idx = start + offs
        acc ^= tl.load(x_ptr + idx, mask=idx < n, other=0)
    tl.store(partial_ptr + pid, tl.reduce(acc, 0, _xor))


def stream_read(x, num_programs: int):
    """Launch the read kernel over int32 ``x``: returns the per-program partials."""
    import torch

    partial = torch.empty(num_programs, dtype=torch.int32, device=x.device)
    _stream_read_kernel[(num_programs,)](partial, x, x.numel(), BLOCK=READ_BLOCK)
    return partial


def read_bandwidth(timer, device: str) -> float:
    """Bytes per second the read-only kernel streams (checked: its partials XOR to the buffer's XOR)."""
    import numpy as np
    import torch

    nbytes = DRY_READ_BYTES if timer.dry_run else READ_BYTES
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (nbytes // 4,), dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 1
    programs = sms * READ_PROGRAMS_PER_SM
    got = stream_read(x, programs)
    want = int(np.bitwise_xor.reduce(x.cpu().numpy()))
    if int(np.bitwise_xor.reduce(got.cpu().numpy())) != want:
        raise RuntimeError("read-bandwidth kernel: its partials do not XOR to the buffer's XOR")
    us = timer.repeat(lambda: stream_read(x, programs), timer.runs_for(lambda: stream_read(x, programs)),
                      flush=False)["median"]
    return nbytes / (us * 1e-6)


def attention_rate_batch(dry_run: bool, device: str):
    """One long dense causal prefill request: (q, k_cache, v_cache, qo_indptr, kv_lens, block_table, flops)."""
    import torch

    t = DRY_RATE_TOKENS if dry_run else RATE_TOKENS
    hq, hkv = DRY_RATE_HEADS if dry_run else RATE_HEADS
    d = DRY_RATE_HEAD_DIM if dry_run else RATE_HEAD_DIM
    dtype = torch.float32 if dry_run else torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
    bs = 16
    g = torch.Generator(device=device).manual_seed(7)
    draw = lambda *s: torch.randn(*s, generator=g, device=device).to(dtype)  # noqa: E731
    q = draw(t, hq, d)
    k, v = draw(t // bs, bs, hkv, d), draw(t // bs, bs, hkv, d)
    qo = torch.tensor([0, t], dtype=torch.int32, device=device)
    lens = torch.tensor([t], dtype=torch.int32, device=device)
    table = torch.arange(t // bs, dtype=torch.int32, device=device)[None]
    flops = 4.0 * d * hq * t * (t + 1) / 2  # QK^T and PV, 2 FLOPs per MAC, causal pairs
    return q, k, v, qo, lens, table, flops


def attention_rates(timer, device: str, flashinfer_ready: set) -> dict:
    """FLOP/s of causal prefill per provider that ran (prefixattn always; FlashInfer's prefill where its JIT is
    ready), each output checked against the reference first."""
    import prefixattn
    import torch
    from peers.flashinfer import FA3_MAJOR, PagedMeta, device_major, plan_peer
    from tests.tolerances import ATTENTION_TOL

    q, k, v, qo, lens, table, flops = attention_rate_batch(timer.dry_run, device)
    hq, d, hkv = q.shape[1], q.shape[2], k.shape[2]
    rows = min(RATE_CHECK_ROWS, q.shape[0])
    tail = torch.tensor([0, rows], dtype=torch.int32, device=device)
    want = prefixattn.reference_attention(q[-rows:], k, v, tail, lens, table)
    p = prefixattn.plan(qo, lens, table, block_size=k.shape[1], num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                        q_dtype=q.dtype)
    out = torch.empty_like(q)
    runs = {"prefixattn": lambda: prefixattn.attention(q, k, v, p, out=out)}
    backend = "fa3" if device == "cuda" and device_major(torch.device(device)) == FA3_MAJOR else "fa2"
    name = f"flashinfer-prefill-{backend}"
    if name in flashinfer_ready:
        meta = PagedMeta(qo, lens, table, k.shape[1], hq, hkv, d, q.dtype)
        peer = plan_peer(name, meta, graph=False)
        runs[name] = lambda: peer.launch(q, k, v)
    rates = {}
    atol, rtol = ATTENTION_TOL[q.dtype]
    for provider, fn in runs.items():
        try:
            got = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            if not bool(((got[-rows:].float() - want).abs() <= atol + rtol * want.abs()).all()):
                print(f"[ceilings] attention rate: {provider}'s output is wrong: no rate from it", flush=True)
                continue
            us = timer.repeat(fn, timer.runs_for(fn), flush=False)["median"]
        except Exception as exc:  # noqa: BLE001 - one provider failing leaves the other's rate
            print(f"[ceilings] attention rate: {provider} failed: {type(exc).__name__}: {exc}"[:300], flush=True)
            continue
        rates[provider] = flops / (us * 1e-6)
    return rates


def shape_floors(batch, read_bytes_per_s: float, attention_flops_per_s: float) -> dict:
    """Seconds: ``memory``, ``compute``, ``overlapped`` (max) and ``serial`` (sum) for one batch."""
    from gpu_cases import attention_flops

    nbytes = batch.unique_kv_bytes() + 2 * batch.q.numel() * batch.q.element_size()  # KV once, q in, out out
    memory = nbytes / read_bytes_per_s
    compute = attention_flops(batch) / attention_flops_per_s
    return dict(memory=memory, compute=compute, overlapped=max(memory, compute), serial=memory + compute)
