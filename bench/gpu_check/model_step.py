"""A Llama-3.1-8B-shaped model step per attention provider (GPU check step ``model_step``; a benchmark harness, not
an engine: random bf16 weights, no tokenizer, no sampling, outputs forced to the workload's lengths).

The decoder stack: hidden 4096, 32 query / 8 KV heads of 128, MLP 14336 (SiLU-gated), RMSNorm, rotary, vocabulary
128256, all 32 layers (:data:`LLAMA_31_8B`); each layer writes its new K/V into its paged cache
(:func:`prefixattn.write_kv`, the same for every provider) and runs the provider's attention. Steps come from
model_layout.py (prefixattn's TokenBatcher) on the workloads of :data:`WORKLOADS`, in that order (the time
guard keeps the first): ~8K-token documents each shared by 32-64 questions, BatchLLM case 1 (~1K-token documents
shared by ~7 requests: the workload where an unshared kernel finds the prefix in L2) and one ~4K-token prompt shared
by every request. Decode steps are captured whole into a CUDA graph and replayed (as engines run decode), mixed
steps run eagerly.

Providers: ``prefixattn`` (free ``plan()`` once per step, one launch per work class per layer),
``prefixattn-nosharing`` (``sharing="never"``), ``flashinfer-best`` (FlashInfer without sharing, what vLLM runs: the
fastest of the configurations of bench/peers/flashinfer.py that take the step, chosen by their attention time, the
choice recorded), both cascades (oracle prefix groups; FlashInfer's wrapper and its fa2 levels), on a mixed step
whose plan overlaps, ``prefixattn-overlap`` (``overlap=True``: its decode launch beside the others) and, on a step
with two launches or more once the correctness step's PDL cases passed, ``prefixattn-pdl`` (its launches chained by
programmatic dependent launch). Per step and
provider: the step time, the attention time (the same 32 attention calls alone, timed the same way), attention's
share, tokens/s and the ``bound``: the step with attention at the sharing floor (the step's distinct KV + q + out per
layer at the HBM rate, or its attention FLOPs at the attention rate). prefixattn's work classes are timed alone on
one layer (graph-replayed, L2 flushed). Per step: one layer's KV bytes read without sharing, its distinct KV bytes,
the L2 size, and how much of the unshared reads re-read a group prefix that fits in L2 (model_layout.kv_traffic).
Every provider's attention is checked against the reference on the step's metadata first. The dry run does the same
on a 2-layer model of tiny width (one layer) in the interpreter, eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpu_check.clock import Clock, failure

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
#: The workloads and their batching, in the order the time guard keeps them: name (prefixattn.sim.workloads) ->
#: (requests, length scale, token budget, KV blocks, steps per kind) on a GPU. 12,000 blocks of 16 tokens (23 GiB
#: over 32 layers) sit beside the 16 GB of weights on an 80 GB card: case 1 runs ~260 requests of ~1,550 tokens at
#: once, docs-qa-8k ~5 documents with their questions (~22K tokens a document), shared-prompt-4k all 256 requests
#: (~81K distinct tokens). The token budget is vLLM's and BatchLLM's 2048. Steps per kind (decode, mixed): the
#: largest, then ones from the middle of the run.
WORKLOADS = {"docs-qa-8k": (288, 1, 2048, 12000, 1), "batchllm-case1": (384, 1, 2048, 12000, 2),
             "shared-prompt-4k": (256, 1, 2048, 12000, 1)}
#: The dry run: every workload, lengths / 32, one step of each kind.
DRY_WORKLOAD, DRY_STEPS_PER_KIND = (12, 32, 64, 200), 1
BLOCK_SIZE = 16
#: FlashInfer configurations tried per step kind for "flashinfer-best" (no sharing).
FI_CANDIDATES = {"decode": ("flashinfer-decode", "flashinfer-decode-tc-fa2", "flashinfer-decode-tc-fa3"),
                 "mixed": ("flashinfer-prefill-fa2", "flashinfer-prefill-fa3", "flashinfer-split",
                           "flashinfer-batch-attention", "flashinfer-pod")}
#: The providers timed on every step beside "flashinfer-best".
PROVIDERS = ("prefixattn", "prefixattn-nosharing", "flashinfer-cascade2", "flashinfer-cascade2-fa2")
#: Timed on the mixed steps whose plan overlaps its classes (``plan(overlap=True)``: the decode launch beside the
#: chunk and shared launches); not a calibration input of the simulator (it models the classes in series).
OVERLAP = "prefixattn-overlap"
#: Timed on the steps whose plan chains two launches or more by programmatic dependent launch (``PREFIXATTN_PDL=1``:
#: each layer's launches after the first start as their predecessor's programs leave), once the correctness step's
#: PDL cases passed in this process; not a calibration input either.
PDL = "prefixattn-pdl"
#: Simulator kernel kind of each provider (prefixattn.sim.step_cost): the calibration's input.
SIM_KERNEL = {"prefixattn": ("fused", True), "prefixattn-nosharing": ("fused", True),
              "flashinfer-best": ("paged", False), "flashinfer-cascade2": ("cascade", False),
              "flashinfer-cascade2-fa2": ("cascade", True)}


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
    in their cuda-graph mode for steps that are captured (decode), as engines build them, else without it.
    prefixattn's ``attend.plan`` is its plan (its work classes are timed alone)."""
    import torch

    import prefixattn
    from peers.flashinfer import plan_peer
    from prefixattn.autotune.pdl import asking_for_pdl

    if provider.startswith("prefixattn"):
        with asking_for_pdl(provider == PDL):
            p = prefixattn.plan(meta.qo_indptr, meta.kv_lens, meta.block_table, block_size=meta.block_size,
                                num_qo_heads=meta.num_qo_heads, num_kv_heads=meta.num_kv_heads,
                                head_dim=meta.head_dim, q_dtype=meta.dtype, num_blocks=model.kv.shape[2],
                                sharing="never" if provider == "prefixattn-nosharing" else "auto",
                                overlap=provider == OVERLAP)
        out = torch.empty(int(meta.qo_indptr[-1]), meta.num_qo_heads, meta.head_dim, dtype=meta.dtype,
                          device=meta.device)

        def attend(li, q):
            return prefixattn.attention(q, model.kv[li, 0], model.kv[li, 1], p, out=out)

        attend.plan, attend.out = p, out
        return attend
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
        from gpu_check.measure import capture

        g, _ = capture(fn)
        fn = g.replay
    t = timer.repeat(fn, timer.runs_for(fn), flush=False)
    return t["min"], t["median"]


def _label(workload: str, lay) -> str:
    return f"{workload} {lay.kind} step {lay.step}: {len(lay.kv_lens)} requests, {lay.num_tokens} tokens"


def step_model(args, results, skips, device: str, fi_ready: dict, ceil: dict) -> list:
    """Time the selected steps of every workload (:data:`WORKLOADS`, in order) for every provider; rows
    ``model_step``; returns the measured steps (JSON-able) for the simulator's calibration (prefixattn/sim/fit.py).
    ``ceil``: the run's ceilings (``hbm_bytes_per_s``, ``attention_flops_per_s``, ``l2_bytes``) for the bounds."""
    import torch

    from gpu_check import model_layout
    from gpu_check.measure import Timer

    clock = Clock("model_step", skips)
    dry = args.dry_run
    shape = DRY_MODEL if dry else LLAMA_31_8B
    start = time.monotonic()
    todo = []  # (workload, layout): every workload's steps laid out first, so one model holds the largest
    for name, (n_req, scale, budget, blocks, per_kind) in WORKLOADS.items():
        if dry:
            n_req, scale, budget, blocks = DRY_WORKLOAD
            per_kind = DRY_STEPS_PER_KIND
        prompts, outputs = model_layout.workload(name, n_req, scale)
        batcher, all_steps = model_layout.run_batcher(prompts, outputs, token_budget=budget, kv_blocks=blocks,
                                                      block_size=BLOCK_SIZE)
        picked = model_layout.select_steps(all_steps, per_kind)
        todo += [(name, model_layout.layout(b, batcher, prompts, BLOCK_SIZE)) for b in picked]
        print(f"[model_step] {shape.name}, {name}: {n_req} requests (lengths / {scale}), {len(all_steps)} "
              f"TokenBatcher steps; timing steps {[b.step for b in picked]}", flush=True)
    print(f"[model_step] laid out in {time.monotonic() - start:.1f} s (host)", flush=True)
    try:
        model = Model(shape, torch.float32 if dry else torch.bfloat16, device, max(lay.num_blocks for _, lay in todo))
    except torch.cuda.OutOfMemoryError as exc:
        clock.skip(f"out of memory building the {shape.name} weights and caches: {str(exc)[:200]}")
        return []
    timer = Timer(dry, device)
    measured = []
    for i, (name, lay) in enumerate(todo):
        if clock.expired([_label(w, x) for w, x in todo[i:]]):
            break
        measured += _time_step(name, lay, model, timer, device, results, fi_ready, clock, dry, ceil)
    if dry:
        clock.skip("dry run: eager interpreter steps (no CUDA graphs), times are not GPU times")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return measured


def _floor_rows(workload, lay, model, results, label, ceil) -> float:
    """The step's attention floor (seconds, all layers) and its KV traffic rows (provider ``floor``)."""
    from gpu_check.cases import causal_attention_flops
    from gpu_check.model_layout import kv_traffic

    s = model.s
    elt = model.kv.element_size()
    per_token = 2 * s.kv_heads * s.head_dim * elt  # K and V, one layer
    kv = kv_traffic(lay, BLOCK_SIZE, per_token, ceil["l2_bytes"])
    q_out = 2 * lay.num_tokens * s.q_heads * s.head_dim * elt
    memory = (kv["unique"] + q_out) / ceil["hbm_bytes_per_s"]
    compute = causal_attention_flops(lay.q_lens, lay.kv_lens, s.q_heads, s.head_dim) / ceil["attention_flops_per_s"]
    floor = s.layers * max(memory, compute)
    for metric, value, unit in (("attention_floor_us", floor * 1e6, "us"),
                                ("kv_read_mib_per_layer", kv["read"] / 2 ** 20, "MiB"),
                                ("kv_unique_mib_per_layer", kv["unique"] / 2 ** 20, "MiB"),
                                ("l2_mib", ceil["l2_bytes"] / 2 ** 20, "MiB"),
                                ("l2_reread_fraction", kv["l2_reread_fraction"], "fraction")):
        results.add(BENCHMARK, "floor", label, metric, value, unit)
    print(f"[model_step] {label}: attention floor {floor * 1e3:.2f} ms; per layer {kv['read'] / 2 ** 20:,.0f} MiB read "
          f"unshared, {kv['unique'] / 2 ** 20:,.0f} MiB distinct, {kv['l2_reread_fraction']:.0%} of the reads re-read "
          f"a group prefix that fits in the {ceil['l2_bytes'] / 2 ** 20:.0f} MiB L2", flush=True)
    return floor


def _time_classes(attend, io, model, timer, results, label, provider) -> None:
    """prefixattn's work classes alone on layer 0 (CUDA-graph replays, eager in the dry run; L2 flushed): rows
    ``class_<name>_layer_us`` beside ``layer_us`` (all classes, the same way) and the plan's modeled times
    (``modeled_step_us``, ``modeled_class_<name>_us``)."""
    from gpu_check.measure import capture
    from peers.ours import class_runs, counters_reset, modeled_times

    p, q = attend.plan, io["q"]
    for metric, value in modeled_times(p).items():
        results.add(BENCHMARK, provider, label, metric, value, "us")
    parts = {"all": lambda: attend(0, q), **class_runs(p, q, model.kv[0, 0], model.kv[0, 1], attend.out)}
    reset = counters_reset(p)
    for name, fn in parts.items():
        before = None if name == "all" else reset
        run = fn
        if not timer.dry_run:
            if before is not None:
                before()
            run = capture(fn)[0].replay
        t = timer.repeat(run, timer.runs_for(run, before=before), flush=True, before=before)
        metric = "layer_us" if name == "all" else f"class_{name}_layer_us"
        results.add(BENCHMARK, provider, label, metric, t["median"], "us")
    if reset is not None:
        reset()


def _time_step(workload, lay, model, timer, device, results, fi_ready, clock, dry, ceil) -> list:
    from gpu_check.correctness import PDL_VERDICT
    from gpu_check.model_layout import group_item_span

    io, meta, label = _io(lay, model, device), _meta(lay, model, device), _label(workload, lay)
    graph = lay.kind == "decode" and not dry
    fi_ok = {p for p, ok in fi_ready.items() if ok is True}
    attention_floor = _floor_rows(workload, lay, model, results, label, ceil)
    attends = {p: p for p in PROVIDERS if not p.startswith("flashinfer") or p in fi_ok}
    if lay.kind == "mixed":
        attends[OVERLAP] = OVERLAP
    if PDL_VERDICT and PDL_VERDICT[0]:
        attends[PDL] = PDL
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
            if provider == OVERLAP and not attend.plan.overlapped:
                print(f"[model_step]   {provider:24s} skipped: the plan runs its classes in series", flush=True)
                continue
            if provider == PDL and (not attend.plan.pdl or attend.plan.num_launches < 2):
                print(f"[model_step]   {provider:24s} skipped: nothing to chain ({attend.plan.stats['pdl_why']}, "
                      f"{attend.plan.num_launches} launches)", flush=True)
                continue
            ok, err = _check(attend, io, meta, model)
            results.add(BENCHMARK, provider, label, "correct", float(ok), "bool")
            if not ok:
                print(f"[model_step]   {provider:24s} WRONG attention (max abs err {err:.2e}): not timed", flush=True)
                continue
            step_t = _timed(lambda: model.forward(io, attend), timer, graph)
            attn_t = _timed(lambda: model.attention_only(io, attend), timer, graph)
            if provider.startswith("prefixattn") and provider not in (OVERLAP, PDL):  # prefixattn's classes
                _time_classes(attend, io, model, timer, results, label, provider)
                # How together it issues a group's re-reads of its prefix (L2 reuse: the prefix runs' order).
                results.add(BENCHMARK, provider, label, "group_item_span",
                            group_item_span(attend.plan.work.items, attend.plan.work.class_ends, lay.groups),
                            "positions per item")
        except Exception as exc:  # one provider failing does not end the step
            print(f"[model_step]   {provider:24s} FAILED: {failure(exc)}", flush=True)
            # Ours failing is a failure of the check; a peer failing is a column without numbers.
            results.add(BENCHMARK, provider, label, "correct" if provider.startswith("prefixattn") else "ran", 0.0,
                        "bool")
            continue
        tokens_s = lay.num_tokens / (step_t[1] * 1e-6)
        bound_us = step_t[1] - attn_t[1] + attention_floor * 1e6
        for metric, value, unit in (("step_us_min", step_t[0], "us"), ("step_us_median", step_t[1], "us"),
                                    ("attention_us_min", attn_t[0], "us"), ("attention_us_median", attn_t[1], "us"),
                                    ("attention_share", attn_t[1] / step_t[1], "fraction"),
                                    ("bound_us", bound_us, "us"),
                                    ("tokens_per_s", tokens_s, "tokens/s"),
                                    ("output_tokens_per_s", len(lay.sampled_rows) / (step_t[1] * 1e-6), "tokens/s"),
                                    ("graph", float(graph), "bool")):
            results.add(BENCHMARK, provider, label, metric, value, unit)
        print(f"[model_step]   {provider:24s}{'(' + impl + ')' if impl != provider else '':28s} step "
              f"{step_t[1] / 1e3:8.2f} ms, attention {attn_t[1] / 1e3:8.2f} ms ({attn_t[1] / step_t[1]:.0%}), "
              f"{tokens_s:,.0f} tokens/s; bound {bound_us / 1e3:.2f} ms", flush=True)
        if provider in SIM_KERNEL:
            measured.append(_record(workload, lay, provider, impl, step_t, attn_t, model, results, graph, ceil))
    return measured


def _record(workload, lay, provider, impl, step_t, attn_t, model, results, graph, ceil) -> dict:
    """One measured step as the simulator's calibration reads it (prefixattn/sim/fit.py): ``shared_lens`` /
    ``shared_runs`` what the provider shares (nothing for the unshared ones), ``group_lens`` / ``group_runs`` the
    step's prefix groups whatever it shares."""
    kernel, split_k = SIM_KERNEL[provider]
    shares = provider != "prefixattn-nosharing" and kernel != "paged"
    groups = lay.shared_lens.tolist()
    return dict(step=lay.step, kind=lay.kind, workload=workload, provider=provider, impl=impl, kernel=kernel,
                split_k=split_k, step_s=step_t[1] * 1e-6, attention_s=attn_t[1] * 1e-6, q_lens=lay.q_lens.tolist(),
                kv_lens=lay.kv_lens.tolist(), num_sampled=int(len(lay.sampled_rows)),
                shared_lens=groups if shares else [0] * len(lay.kv_lens),
                shared_runs=lay.shared_runs if shares else [], group_lens=groups, group_runs=lay.shared_runs,
                model=model.s.name, device=results.device, graph=graph, l2_bytes=int(ceil["l2_bytes"]),
                hbm_bytes_per_s=float(ceil["hbm_bytes_per_s"]))


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
        print(f"[model_step]   {cand:22s} FAILED: {failure(exc)}", flush=True)
        return None
    results.add(BENCHMARK, cand, label, "attention_us_median", t[1], "us")
    print(f"[model_step]   candidate {cand:28s} attention {t[1] / 1e3:8.2f} ms", flush=True)
    return t[1]
