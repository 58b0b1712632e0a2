"""The MLA step's prefill contexts (driver: the ``mla`` step, after its decode shapes): a step of prefills over one
cached DeepSeek-V3 prompt, the attention of their new tokens over the cached context, as the vLLM MLA backend runs it
where its rule takes that path (:mod:`prefixattn.integrations.vllm.mla_prefill`: the distinct latent blocks gathered
and up-projected once, attended by ``prefixattn.attention``) against vLLM's own way (every prefill's context gathered
and up-projected by ``kv_b_proj`` on its own, attended by FlashAttention: here FlashInfer's fa3 single prefill, one
call per prefill, 192 + 128 wide, non-causal).

Both outputs (the values' 128 lanes) are checked against the fp64 reference on the first and last prefill's first
rows, then graph-replayed with the L2 flushed and warm. What it settles: whether :func:`context_path_pays_off`'s
modeled prices (FA3's and Triton's causal-prefill rates) pick the faster path on both sides of its threshold.
"""

from __future__ import annotations

from gpu_check.clock import failure
from gpu_check.mla import NOPE, PAGE, RANK, ROPE, SM_SCALE, VALUE

BENCH = "mla_prefill"
#: ``(name, heads, prefills, cached prompt tokens, new tokens each)``: short questions (the backend's path, modeled)
#: and long ones (vLLM's), within vLLM's default 8K-token step budget, at 16 and 128 heads.
SHAPES = (("mla-prefill-h16-p32-c8192-n64", 16, 32, 8192, 64), ("mla-prefill-h128-p32-c8192-n64", 128, 32, 8192, 64),
          ("mla-prefill-h128-p8-c8192-n512", 128, 8, 8192, 512))
DRY_SHAPES = (("mla-prefill-dry-h16-p3-c128-n8", 16, 3, 128, 8),)
#: Rows of the first and last prefill checked against the reference.
SAMPLE = 4
PROVIDERS = ("prefixattn-context", "vllm-context")


def _batch(heads: int, prefills: int, cached: int, new: int, device: str) -> dict:
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(heads * 31 + prefills)
    pages = cached // PAGE
    cache = (torch.randn((pages + 1, PAGE, RANK + ROPE), generator=g) / 2).to(torch.bfloat16).to(device)
    # kv_b_proj: per head [k_nope | v] of 128 + 128 (entries ~ 1/sqrt(fan-in)); queries [q_nope | q_pe] per head
    w_kv = (torch.randn((RANK, heads * (NOPE + VALUE)), generator=g) * RANK ** -0.5).to(torch.bfloat16).to(device)
    q = torch.randn((prefills * new, heads, NOPE + ROPE), generator=g).to(torch.bfloat16).to(device)
    table = np.broadcast_to(np.arange(pages), (prefills, pages)).copy()
    return dict(cache=cache, w_kv=w_kv, q=q, table=table, heads=heads, prefills=prefills, cached=cached, new=new)


def _want(b: dict):
    """fp64 reference of the sampled rows: ``(rows, out [rows, H, VALUE])``."""
    import torch

    heads, cached = b["heads"], b["cached"]
    n = b["q"].shape[0]
    rows = torch.tensor(sorted(set(range(SAMPLE)) | set(range(n - b["new"], n - b["new"] + SAMPLE))))
    latent = b["cache"][: cached // PAGE].reshape(-1, RANK + ROPE).double()
    kv = (latent[:, :RANK] @ b["w_kv"].double()).view(-1, heads, NOPE + VALUE)
    k = torch.cat([kv[..., :NOPE], latent[:, None, RANK:].expand(-1, heads, -1)], dim=-1)
    q = b["q"][rows.to(b["q"].device)].double()
    p = torch.softmax(torch.einsum("thd,khd->htk", q, k) * SM_SCALE, dim=-1)
    return rows, torch.einsum("htk,khd->thd", p, kv[..., NOPE:]).cpu()


def _ours(b: dict, device: str):
    """The backend's path, planned whatever its rule says (``priced=False``); also whether the rule takes it."""
    import numpy as np
    import torch

    from prefixattn.integrations.vllm.mla_prefill import plan_prefill_context, prefill_context_attention

    n = b["prefills"]
    args = (np.full(n, b["new"]), np.full(n, b["cached"]), b["table"])
    kwargs = dict(block_size=PAGE, num_heads=b["heads"], head_dim=NOPE + ROPE, sm_scale=SM_SCALE,
                  q_dtype=torch.bfloat16, device=device, max_tokens=1 << 22, kv_lora_rank=RANK, rope_dim=ROPE,
                  v_head_dim=VALUE)
    ctx = plan_prefill_context(*args, **kwargs)
    chosen = ctx is not None
    ctx = ctx or plan_prefill_context(*args, **kwargs, priced=False)
    out = torch.empty((b["q"].shape[0], b["heads"], NOPE + ROPE), dtype=torch.bfloat16, device=device)

    def run():
        o, _ = prefill_context_attention(ctx, b["q"], b["cache"], lambda c: c @ b["w_kv"], kv_lora_rank=RANK,
                                         qk_nope_head_dim=NOPE, v_head_dim=VALUE)
        out.copy_(o)

    return run, out, chosen


def _vllm_like(b: dict, device: str):
    import torch

    from gpu_check.mla import _flashinfer

    fi = _flashinfer()
    heads, new, pages = b["heads"], b["new"], b["cached"] // PAGE
    ids = torch.as_tensor(b["table"], device=device)
    out = torch.empty((b["q"].shape[0], heads, VALUE), dtype=torch.bfloat16, device=device)

    def run():
        for r in range(b["prefills"]):  # vLLM gathers and up-projects each prefill's context
            latent = b["cache"][ids[r, :pages]].reshape(-1, RANK + ROPE)
            kv = (latent[:, :RANK] @ b["w_kv"]).view(-1, heads, NOPE + VALUE)
            k = torch.cat([kv[..., :NOPE], latent[:, None, RANK:].expand(-1, heads, -1)], dim=-1)
            o = fi.single_prefill_with_kv_cache(b["q"][r * new:(r + 1) * new], k, kv[..., NOPE:].contiguous(),
                                                causal=False, sm_scale=SM_SCALE, backend="fa3")
            out[r * new:(r + 1) * new] = o

    return run, out, None


def run_shapes(args, results, clock, timer, device: str, fi_ready: dict) -> None:
    """Each shape's two providers: correctness, then the graph-replayed times (as :func:`gpu_check.mla.step_mla`)."""
    from gpu_check.measure import record_state
    from gpu_check.mla import _correct, time_graphed

    shapes = DRY_SHAPES if args.dry_run else SHAPES
    for i, (name, heads, prefills, cached, new) in enumerate(shapes):
        if clock.expired([s[0] for s in shapes[i:]]):
            return
        b = _batch(heads, prefills, cached, new, device)
        rows, want = _want(b)
        for provider in PROVIDERS:
            try:
                if provider == "vllm-context" and "_why" in fi_ready:
                    raise RuntimeError(f"FlashInfer's warm-up did not finish: {fi_ready['_why']}")
                run, out, chosen = (_ours if provider == "prefixattn-context" else _vllm_like)(b, device)
                run()
            except Exception as exc:  # noqa: BLE001 - a provider that cannot run here is reported, the step goes on
                results.add(BENCH, provider, name, "not_run", 1.0, f"reason: {failure(exc)}")
                print(f"[mla_prefill] {name} {provider}: not run: {exc}", flush=True)
                continue
            ok, err = _correct(out[..., :VALUE], rows, want)
            results.add(BENCH, provider, name, "correct", float(ok), "bool")
            results.add(BENCH, provider, name, "max_abs_err", err, "abs")
            if chosen is not None:  # what the backend's modeled rule picks for this step
                results.add(BENCH, provider, name, "rule_takes_this_path", float(chosen), "bool")
            times, graph_ok = time_graphed(args, timer, results, (BENCH, provider, name), run, out,
                                           lambda: _correct(out[..., :VALUE], rows, want)[0])
            print(f"[mla_prefill] {name} {provider}: {times['graph_flushed']['median']:.1f} us, correct "
                  f"{ok and graph_ok}", flush=True)
        if not args.dry_run:
            record_state(results, BENCH, name)
        del b
