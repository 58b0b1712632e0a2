"""A Llama-3.1-8B-shaped model step per attention provider (GPU check step ``model_step``; a benchmark harness, not
an engine: random bf16 weights, no tokenizer, no sampling, outputs forced to the workload's lengths).

The decoder stack: hidden 4096, 32 query / 8 KV heads of 128, MLP 14336 (SiLU-gated), RMSNorm, rotary, vocabulary
128256, all 32 layers (:data:`LLAMA_31_8B`); each layer writes its new K/V into its paged cache
(:func:`prefixattn.write_kv`, the same for every provider) and runs the provider's attention. Steps come from
bench/model_layout.py (prefixattn's TokenBatcher on a BatchLLM case-1-shaped workload): decode steps are captured
whole into a CUDA graph and replayed (as engines run decode), mixed steps run eagerly.

Providers: ``prefixattn`` (free ``plan()`` once per step, one launch per layer), ``prefixattn-nosharing``
(``sharing="never"``), ``flashinfer-best`` (FlashInfer without sharing, what vLLM runs: the fastest of the
configurations of bench/peers/flashinfer.py that take the step, chosen by their attention time, the choice recorded)
and ``flashinfer-cascade2`` (oracle prefix groups). Per step and provider: the step time, the attention time (the
same 32 attention calls alone, timed the same way), attention's share, and tokens/s; every provider's attention is
checked against the reference on the step's metadata first. The dry run does the same on a 2-layer model of tiny
width (one layer) in the interpreter, eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

BENCHMARK = "model_step"


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5


#: meta-llama/Llama-3.1-8B config.json (the simulator's preset of the same name has the same shapes).
LLAMA_31_8B = ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256)
DRY_MODEL = ModelShape("llama-shaped-tiny", 1, 64, 2, 1, 32, 128, 256)
#: The workload and batching per run: (requests, length scale, token budget, KV blocks). The GPU run's KV blocks
#: (12,000 x 16 tokens, 23 GiB over 32 layers) hold ~260 running requests of ~1,550 tokens beside the 16 GB of weights
#: on an 80 GB card; the token budget is vLLM's and BatchLLM's 2048.
GPU_WORKLOAD = (384, 1, 2048, 12000)
DRY_WORKLOAD = (12, 32, 64, 200)
BLOCK_SIZE = 16
#: Steps timed per kind (decode, mixed): the largest and one from the middle of the run; one in the dry run.
STEPS_PER_KIND, DRY_STEPS_PER_KIND = 2, 1
#: FlashInfer configurations tried per step kind for "flashinfer-best" (no sharing).
FI_CANDIDATES = {"decode": ("flashinfer-decode", "flashinfer-decode-tc-fa2", "flashinfer-decode-tc-fa3"),
                 "mixed": ("flashinfer-prefill-fa2", "flashinfer-prefill-fa3", "flashinfer-split",
                           "flashinfer-batch-attention", "flashinfer-pod")}
#: Simulator kernel kind of each provider (prefixattn.sim.step_cost): the calibration's input.
SIM_KERNEL = {"prefixattn": ("fused", True), "prefixattn-nosharing": ("fused", True),
              "flashinfer-best": ("paged", False), "flashinfer-cascade2": ("cascade", False)}


class Model:
    """Random weights and the forward pass of one step; ``attend(layer, q)`` is the provider's."""

    def __init__(self, shape: ModelShape, dtype, device: str, num_blocks: int):
        import torch

        self.s, self.dtype, self.device = shape, dtype, device
        g = torch.Generator(device=device).manual_seed(0)
        s = shape

        def w(*size, std=0.02):
            return torch.empty(*size, dtype=dtype, device=device).normal_(0.0, std, generator=g)

        qkv = (s.q_heads + 2 * s.kv_heads) * s.head_dim
        self.layers = [dict(wqkv=w(s.hidden, qkv), wo=w(s.q_heads * s.head_dim, s.hidden),
                            w_gate_up=w(s.hidden, 2 * s.intermediate), w_down=w(s.intermediate, s.hidden),
                            norm1=torch.ones(s.hidden, dtype=dtype, device=device),
                            norm2=torch.ones(s.hidden, dtype=dtype, device=device)) for _ in range(s.layers)]
        self.embed, self.lm_head = w(s.vocab, s.hidden), w(s.hidden, s.vocab)
        self.norm = torch.ones(s.hidden, dtype=dtype, device=device)
        # Paged caches of every layer, [num_blocks, block, kv heads, head_dim] each, random contents.
        self.kv = w(s.layers, 2, num_blocks, BLOCK_SIZE, s.kv_heads, s.head_dim, std=1.0)

    def rms(self, x, weight):
        import torch

        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.s.rms_eps)).to(x.dtype) * weight

    def rotary(self, positions):
        """(cos, sin) ``[T, head_dim / 2]`` for the step's positions."""
        import torch

        d = self.s.head_dim
        inv = 1.0 / (self.s.rope_theta ** (torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d))
        ang = positions.float()[:, None] * inv[None]
        return ang.cos(), ang.sin()

    @staticmethod
    def rope(x, cos, sin):
        import torch

        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        c, s = cos[:, None], sin[:, None]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    def forward(self, io, attend):
        """One step: ``io`` holds the step's device tensors (tokens, positions' cos/sin, slots, sampled rows)."""
        import torch

        import prefixattn

        s = self.s
        x = self.embed[io["tokens"]]
        for li, layer in enumerate(self.layers):
            h = self.rms(x, layer["norm1"])
            qkv = h @ layer["wqkv"]
            q, k, v = qkv.split([s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
            q = self.rope(q.view(-1, s.q_heads, s.head_dim), io["cos"], io["sin"])
            k = self.rope(k.view(-1, s.kv_heads, s.head_dim), io["cos"], io["sin"])
            prefixattn.write_kv(k, v.view(-1, s.kv_heads, s.head_dim), self.kv[li, 0], self.kv[li, 1], io["slots"])
            o = attend(li, q)
            x = x + o.reshape(x.shape[0], -1) @ layer["wo"]
            gate, up = (self.rms(x, layer["norm2"]) @ layer["w_gate_up"]).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ layer["w_down"]
        return self.rms(x[io["sampled"]], self.norm) @ self.lm_head

    def attention_only(self, io, attend):
        """The step's attention calls alone (each layer's cache, the step's q shape): attention's time."""
        for li in range(self.s.layers):
            attend(li, io["q"])


def _io(lay, model, device: str) -> dict:
    import torch

    t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    g = torch.Generator(device=device).manual_seed(lay.step)
    cos, sin = model.rotary(t(lay.positions))
    s = model.s
    return dict(tokens=torch.randint(0, s.vocab, (lay.num_tokens,), generator=g, device=device), cos=cos, sin=sin,
                slots=t(lay.slots), sampled=t(lay.sampled_rows),
                q=torch.randn(lay.num_tokens, s.q_heads, s.head_dim, generator=g, device=device).to(model.dtype))


def _meta(lay, model, device: str):
    import torch

    from peers.flashinfer import PagedMeta

    t = lambda a: torch.as_tensor(a, dtype=torch.int32, device=device)  # noqa: E731
    s = model.s
    return PagedMeta(qo_indptr=t(lay.qo_indptr), kv_lens=t(lay.kv_lens), block_table=t(lay.block_table),
                     block_size=BLOCK_SIZE, num_qo_heads=s.q_heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim,
                     dtype=model.dtype, groups=lay.groups)


def make_attend(provider: str, meta, model, graph: bool):
    """``attend(layer, q) -> out`` for one provider, planned for the step (host work done here); FlashInfer's wrappers
    in their cuda-graph mode for steps that are captured (decode), as engines build them, else without it."""
    import torch

    import prefixattn
    from peers.flashinfer import plan_peer

    if provider.startswith("prefixattn"):
        p = prefixattn.plan(meta.qo_indptr, meta.kv_lens, meta.block_table, block_size=meta.block_size,
                            num_qo_heads=meta.num_qo_heads, num_kv_heads=meta.num_kv_heads, head_dim=meta.head_dim,
                            q_dtype=meta.dtype, num_blocks=model.kv.shape[2],
                            sharing="never" if provider == "prefixattn-nosharing" else "auto")
        out = torch.empty(int(meta.qo_indptr[-1]), meta.num_qo_heads, meta.head_dim, dtype=meta.dtype,
                          device=meta.device)
        return lambda li, q: prefixattn.attention(q, model.kv[li, 0], model.kv[li, 1], p, out=out)
    peer = plan_peer(provider, meta, graph=graph)
    return lambda li, q: peer.output(peer.launch(q, model.kv[li, 0], model.kv[li, 1]))


def _check(attend, io, meta, model) -> tuple[bool, float]:
    """Layer 0's attention on the step's q against the fp32 reference."""
    import torch

    from prefixattn import reference_attention
    from tests.tolerances import ATTENTION_TOL

    got = attend(0, io["q"]).float()
    want = reference_attention(io["q"], model.kv[0, 0], model.kv[0, 1], meta.qo_indptr, meta.kv_lens,
                               meta.block_table)
    atol, rtol = ATTENTION_TOL[model.dtype]
    err = (got - want).abs()
    return bool(torch.isfinite(got).all() and (err <= atol + rtol * want.abs()).all()), float(err.max())


def _timed(fn, timer, graph: bool):
    """(min, median) us of ``fn``: a captured graph's replays (decode steps) or eager calls, L2 warm (a step streams
    16 GB of weights: no flush changes what it finds in L2)."""
    if graph:
        from gpu_measure import capture

        g, _ = capture(fn)
        fn = g.replay
    t = timer.repeat(fn, timer.runs_for(fn), flush=False)
    return t["min"], t["median"]


def _label(lay) -> str:
    return f"{lay.kind} step {lay.step}: {len(lay.kv_lens)} requests, {lay.num_tokens} tokens"


def step_model(args, results, skips, device: str, fi_ready: dict) -> list:
    """Time the selected steps for every provider; rows ``model_step``; returns the measured steps (JSON-able) for
    the simulator's calibration (prefixattn/sim/fit.py)."""
    import torch

    import model_layout
    from gpu_check_steps import Clock
    from gpu_measure import Timer

    clock = Clock("model_step", skips)
    dry = args.dry_run
    shape = DRY_MODEL if dry else LLAMA_31_8B
    n_req, scale, budget, blocks = DRY_WORKLOAD if dry else GPU_WORKLOAD
    start = time.monotonic()
    prompts, outputs = model_layout.workload(n_req, scale)
    batcher, all_steps = model_layout.run_batcher(prompts, outputs, token_budget=budget, kv_blocks=blocks,
                                                  block_size=BLOCK_SIZE)
    layouts = [model_layout.layout(b, batcher, prompts, BLOCK_SIZE)
               for b in model_layout.select_steps(all_steps, DRY_STEPS_PER_KIND if dry else STEPS_PER_KIND)]
    print(f"[model_step] {shape.name}: {n_req} requests (lengths / {scale}), {len(all_steps)} TokenBatcher steps "
          f"({time.monotonic() - start:.1f} s host); timing steps {[lay.step for lay in layouts]}", flush=True)
    try:
        model = Model(shape, torch.float32 if dry else torch.bfloat16, device, max(lay.num_blocks for lay in layouts))
    except torch.cuda.OutOfMemoryError as exc:
        clock.skip(f"out of memory building the {shape.name} weights and caches: {str(exc)[:200]}")
        return []
    timer = Timer(dry, device)
    measured = []
    for i, lay in enumerate(layouts):
        if clock.expired([_label(x) for x in layouts[i:]]):
            break
        measured += _time_step(lay, model, timer, device, results, fi_ready, clock, dry)
    if dry:
        clock.skip("dry run: eager interpreter steps (no CUDA graphs), times are not GPU times")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return measured


def _time_step(lay, model, timer, device, results, fi_ready, clock, dry) -> list:
    io, meta, label = _io(lay, model, device), _meta(lay, model, device), _label(lay)
    graph = lay.kind == "decode" and not dry
    fi_ok = {p for p, ok in fi_ready.items() if ok is True}
    attends = {}
    for provider in ("prefixattn", "prefixattn-nosharing", "flashinfer-cascade2"):
        if provider.startswith("flashinfer") and provider not in fi_ok:
            continue
        attends[provider] = provider
    # FlashInfer best without sharing: the fastest correct candidate by attention time.
    best, best_t = None, None
    for cand in FI_CANDIDATES[lay.kind]:
        if cand not in fi_ok or clock.left() <= 0:
            continue
        r = _attention_time(cand, meta, model, io, timer, graph, results, label)
        if r is not None and (best_t is None or r < best_t):
            best, best_t = cand, r
    if best:
        attends["flashinfer-best"] = best
        results.add(BENCHMARK, best, label, "is_flashinfer_best", 1.0, "bool")
    measured = []
    for provider, impl in attends.items():
        if clock.left() <= 0:
            break
        try:
            attend = make_attend(impl, meta, model, graph)
            ok, err = _check(attend, io, meta, model)
            results.add(BENCHMARK, provider, label, "correct", float(ok), "bool")
            if not ok:
                print(f"[model_step]   {provider:22s} WRONG attention (max abs err {err:.2e}): not timed", flush=True)
                continue
            step_t = _timed(lambda: model.forward(io, attend), timer, graph)
            attn_t = _timed(lambda: model.attention_only(io, attend), timer, graph)
        except Exception as exc:  # one provider failing does not end the step
            print(f"[model_step]   {provider:22s} FAILED: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            # Ours failing is a failure of the check; a peer failing is a column without numbers.
            results.add(BENCHMARK, provider, label, "correct" if provider.startswith("prefixattn") else "ran", 0.0,
                        "bool")
            continue
        tokens_s = lay.num_tokens / (step_t[1] * 1e-6)
        for metric, value, unit in (("step_us_min", step_t[0], "us"), ("step_us_median", step_t[1], "us"),
                                    ("attention_us_min", attn_t[0], "us"), ("attention_us_median", attn_t[1], "us"),
                                    ("attention_share", attn_t[1] / step_t[1], "fraction"),
                                    ("tokens_per_s", tokens_s, "tokens/s"),
                                    ("output_tokens_per_s", len(lay.sampled_rows) / (step_t[1] * 1e-6), "tokens/s"),
                                    ("graph", float(graph), "bool")):
            results.add(BENCHMARK, provider, label, metric, value, unit)
        print(f"[model_step]   {provider:22s}{'(' + impl + ')' if impl != provider else '':28s} step "
              f"{step_t[1] / 1e3:8.2f} ms, attention {attn_t[1] / 1e3:8.2f} ms ({attn_t[1] / step_t[1]:.0%}), "
              f"{tokens_s:,.0f} tokens/s", flush=True)
        kernel, split_k = SIM_KERNEL[provider]
        measured.append(dict(step=lay.step, kind=lay.kind, provider=provider, impl=impl, kernel=kernel,
                             split_k=split_k, step_s=step_t[1] * 1e-6, attention_s=attn_t[1] * 1e-6,
                             q_lens=lay.q_lens.tolist(), kv_lens=lay.kv_lens.tolist(),
                             num_sampled=int(len(lay.sampled_rows)),
                             shared_lens=lay.shared_lens.tolist() if provider != "prefixattn-nosharing" and
                             kernel != "paged" else [0] * len(lay.kv_lens),
                             shared_runs=lay.shared_runs if provider != "prefixattn-nosharing" and
                             kernel != "paged" else [],
                             model=model.s.name, device=results.device, graph=graph))
    return measured


def _attention_time(cand, meta, model, io, timer, graph, results, label):
    """A FlashInfer candidate's checked attention-only time (median us), or None."""
    from peers.flashinfer import Unavailable

    try:
        attend = make_attend(cand, meta, model, graph)
        ok, err = _check(attend, io, meta, model)
        if not ok:
            print(f"[model_step]   {cand:22s} WRONG attention (max abs err {err:.2e}): not a candidate", flush=True)
            results.add(BENCHMARK, cand, label, "correct", 0.0, "bool")
            return None
        t = _timed(lambda: model.attention_only(io, attend), timer, graph)
    except Unavailable as exc:
        print(f"[model_step]   {cand:22s} skipped: {exc}", flush=True)
        return None
    except Exception as exc:  # noqa: BLE001 - a candidate failing is not the end of the step
        print(f"[model_step]   {cand:22s} FAILED: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None
    results.add(BENCHMARK, cand, label, "attention_us_median", t[1], "us")
    print(f"[model_step]   candidate {cand:28s} attention {t[1] / 1e3:8.2f} ms", flush=True)
    return t[1]
