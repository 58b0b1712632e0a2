"""The GPU check's MLA step (driver: driver.py): DeepSeek-V3-shaped decode steps (latent 512 + rope 64, bf16, 64-token
pages) under a shared prompt, prefixattn's ``mla_attention`` (``sharing="auto"`` and ``"never"``) against FlashInfer's
``BatchMLAPagedAttentionWrapper`` (the absorbed form, no sharing: what an engine runs today).

Each provider's output is checked against the fp64 reference on the first and last :data:`SAMPLE` requests and after
its graph replays, then timed as every provider of the timing step is (:mod:`gpu_check.measure`): graph replay with
the L2 flushed (the headline) and warm, 3 repetitions. Beside them, the memory floor: the distinct latent bytes (the
prefix once, each request's own tokens) plus q and out, at the HBM floor's rate.

``typhoon-mla``: TyphoonMLA's split (arXiv 2509.21081) built from FlashInfer. The shared prefix's latent is
up-projected once per head into naive keys ``[q_nope | k_pe]`` (128 + 64) and values (128) and kept (as TyphoonMLA keeps
it across a group's steps: not timed); every request's heads attend it at once in the naive form (one non-causal
``single_prefill_with_kv_cache`` of the batch's rows, fa3), each request's own tokens in the absorbed form (the MLA
wrapper), whose latent output is up-projected by ``W_UV``, and ``merge_state`` joins the two. Its output is the value
``[B, H, 128]``, checked against the reference latent times ``W_UV``; ``prefixattn-naive`` is the same split on
prefixattn's kernels (:func:`prefixattn.mla_naive_attention` with ``form="naive"``: the prefix up-projected in the
timed run, as its engine loop would in every step), and ``prefixattn-naive-kept`` the same with the prefix kept
across steps (a :class:`prefixattn.NaivePrefixCache` of the prefix's blocks, filled by a first step that is not
timed: the steady state TyphoonMLA's baseline stands for); the other providers leave ``W_UV`` to the layer
(a ``[B, H, 512] x [512, 128]`` product per head: 0.27 GFLOP at 256 x 16, modeled < 1 us on an H200). The batch's
absorbed query is ``q_nope @ W_UK`` of random per-head ``W_UK``/``W_UV`` (DeepSeek-V3's 128-wide heads), so the two
forms compute the same attention.
"""

from __future__ import annotations

BENCH = "mla"
#: DeepSeek-V3's latent and rotary widths; vLLM's MLA page size.
RANK, ROPE, PAGE = 512, 64, 64
#: DeepSeek-V3's per-head widths of the naive form: the no-rope query/key and the value.
NOPE, VALUE = 128, 128
#: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) of DeepSeek-V3 (128 + 64).
SM_SCALE = (NOPE + ROPE) ** -0.5
#: (name, query heads, requests, shared prompt tokens, own tokens per request): the issue's targets. 16 heads is
#: DeepSeek-V3 under tensor parallelism 8, 128 all of them (data-parallel attention).
SHAPES = (("mla-h16-b256-s8192-o128", 16, 256, 8192, 128), ("mla-h16-b256-s4096-o512", 16, 256, 4096, 512),
          ("mla-h16-b256-s32768-o128", 16, 256, 32768, 128), ("mla-h16-b256-s0-o512", 16, 256, 0, 512),
          ("mla-h128-b1024-s8192-o128", 128, 1024, 8192, 128))
#: The dry run's (interpreter): the same kinds, tiny.
DRY_SHAPES = (("mla-dry-h16-b4-s128-o16", 16, 4, 128, 16), ("mla-dry-h32-b3-s0-o40", 32, 3, 0, 40))
#: Requests at each end of the batch checked against the fp64 reference.
SAMPLE = 4
PROVIDERS = ("prefixattn", "prefixattn-nosharing", "flashinfer-mla", "typhoon-mla", "prefixattn-naive",
             "prefixattn-naive-kept")
#: The providers whose output is the value (``W_UV`` applied), not the latent.
VALUE_PROVIDERS = ("typhoon-mla", "prefixattn-naive", "prefixattn-naive-kept")


def _batch(heads: int, requests: int, shared: int, own: int, device: str) -> dict:
    """One decode row per request: the first ``shared`` tokens on shared pages, ``own`` on its own (ids shuffled)."""
    import torch

    g = torch.Generator().manual_seed(heads * 7919 + requests)
    shared_pages, own_pages = -(-shared // PAGE), -(-own // PAGE)
    num_pages = shared_pages + requests * own_pages
    ids = torch.randperm(num_pages, generator=g).to(torch.int32)
    table = torch.cat([ids[:shared_pages].expand(requests, -1),
                       ids[shared_pages:].view(requests, own_pages)], dim=1).contiguous()
    kv_lens = torch.full((requests,), shared + own, dtype=torch.int32)
    cache = (torch.randn((num_pages, PAGE, RANK + ROPE), generator=g) / 2).to(torch.bfloat16).to(device)
    # The layer's up-projections (entries ~ 1/sqrt(fan-in)) and the absorbed query q_nope @ W_UK, on the device.
    w_uk, w_uv, q_nope, q_pe = ((torch.randn(shape, generator=g) * scale).to(torch.bfloat16).to(device)
                                for shape, scale in (((heads, NOPE, RANK), NOPE ** -0.5),
                                                     ((heads, RANK, VALUE), RANK ** -0.5),
                                                     ((requests, heads, NOPE), 1.0), ((requests, heads, ROPE), 1.0)))
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, RANK]
    q = torch.cat([q_latent, q_pe], dim=-1).contiguous()
    unique = (shared + requests * own) * (RANK + ROPE) * 2 + q.numel() * 2 + requests * heads * RANK * 2
    return dict(qo_indptr=torch.arange(requests + 1, dtype=torch.int32), kv_lens=kv_lens, table=table, q=q,
                cache=cache, heads=heads, unique_bytes=unique, shared=shared, own=own, q_nope=q_nope, q_pe=q_pe,
                w_uk=w_uk, w_uv=w_uv)


def _want(b: dict) -> tuple:
    """The fp64 reference on the sampled requests: ``(rows, out)``."""
    import torch

    import prefixattn

    n = b["table"].shape[0]
    rows = torch.tensor(sorted(set(range(min(SAMPLE, n))) | set(range(max(0, n - SAMPLE), n))))
    dev = b["q"].device
    out = prefixattn.reference_mla_attention(
        b["q"][rows.to(dev)].float(), b["cache"].float(), torch.arange(len(rows) + 1, device=dev),
        b["kv_lens"][rows].to(dev), b["table"][rows].to(dev), kv_lora_rank=RANK, sm_scale=SM_SCALE,
        compute_dtype=torch.float64)
    return rows, out.cpu()


def _flashinfer():
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(f"FlashInfer is not importable here ({exc})") from exc
    return flashinfer


def _mla_wrapper(flashinfer, b: dict, table, kv_lens, device: str):
    """FlashInfer's MLA wrapper planned for one decode row per request over ``table``'s pages (graph buffers)."""
    import torch

    kv_indptr = torch.arange(0, table.numel() + 1, table.shape[1], dtype=torch.int32)
    bufs = [t.to(device) for t in (b["qo_indptr"], kv_indptr, table.flatten(), kv_lens)]
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    w = flashinfer.BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=True, qo_indptr=bufs[0],
                                                 kv_indptr=bufs[1], kv_indices=bufs[2], kv_len_arr=bufs[3])
    w.plan(*bufs, b["heads"], RANK, ROPE, PAGE, False, SM_SCALE, torch.bfloat16, torch.bfloat16)
    return w


def _typhoon(b: dict, device: str):
    """The ``typhoon-mla`` provider (module docstring): its run and its output ``[B, H, VALUE]``."""
    import torch

    fi = _flashinfer()
    shared, heads = b["shared"], b["heads"]
    if not shared:
        raise RuntimeError("no shared prefix: TyphoonMLA's split is the absorbed form alone (flashinfer-mla)")
    pages = b["table"][0, : -(-shared // PAGE)].to(device)
    latent = b["cache"][pages].reshape(-1, RANK + ROPE)[:shared]
    c, k_pe = latent[:, :RANK], latent[:, RANK:]
    # Up-projected once (not timed): per head k_nope = c @ W_UK^T, v = c @ W_UV; q_naive = [q_nope | q_pe].
    k = torch.cat([torch.einsum("pr,hnr->phn", c, b["w_uk"]), k_pe[:, None].expand(-1, heads, -1)], dim=-1)
    k, v = k.contiguous(), torch.einsum("pr,hrv->phv", c, b["w_uv"]).contiguous()
    q_naive = torch.cat([b["q_nope"], b["q_pe"]], dim=-1).contiguous()
    own = b["table"][:, -(-shared // PAGE):].contiguous()
    w = _mla_wrapper(fi, b, own, torch.full_like(b["kv_lens"], b["own"]), device)
    q_nope, q_pe = b["q"][..., :RANK], b["q"][..., RANK:]
    ckv, kpe = b["cache"][..., :RANK], b["cache"][..., RANK:]
    w_uv = b["w_uv"]
    out = torch.empty((b["q"].shape[0], heads, VALUE), dtype=torch.bfloat16, device=device)

    def run():
        o_shared, lse_shared = fi.single_prefill_with_kv_cache(q_naive, k, v, causal=False, sm_scale=SM_SCALE,
                                                                backend="fa3", return_lse=True)
        o_latent, lse_own = w.run(q_nope, q_pe, ckv, kpe, return_lse=True)
        o_own = torch.bmm(o_latent.transpose(0, 1), w_uv).transpose(0, 1)
        merged, _ = fi.merge_state(o_shared, lse_shared, o_own.contiguous(), lse_own)
        out.copy_(merged)

    return run, out


def _provider(name: str, b: dict, device: str):
    """A callable that runs ``name`` on the batch into a fixed output (graph-capturable), and that output; raises
    ``RuntimeError`` with the reason where the provider cannot run here."""
    import torch

    import prefixattn

    if name == "typhoon-mla":
        try:
            return (*_typhoon(b, device), None)
        except RuntimeError:
            raise
        except Exception as exc:  # a FlashInfer build without this path: reported, the step goes on
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
    if name in ("prefixattn-naive", "prefixattn-naive-kept"):
        def plan(cache=None):
            return prefixattn.plan_mla_naive(b["qo_indptr"], b["kv_lens"], b["table"], block_size=PAGE,
                                             num_heads=b["heads"], sm_scale=SM_SCALE, kv_lora_rank=RANK, rope_dim=ROPE,
                                             qk_nope_head_dim=NOPE, v_head_dim=VALUE, form="naive",
                                             q_dtype=torch.bfloat16, device=device, cache=cache)

        out = torch.empty((b["q"].shape[0], b["heads"], VALUE), dtype=torch.bfloat16, device=device)
        p = plan()
        layer = None
        if name == "prefixattn-naive-kept":
            blocks = p.stats["naive_prefix_tokens"] // PAGE
            if not blocks:
                raise RuntimeError("no shared prefix to keep")
            cache = prefixattn.NaivePrefixCache(
                num_layers=1, max_bytes=blocks * PAGE * b["heads"] * (NOPE + ROPE + VALUE) * 2, num_heads=b["heads"],
                block_size=PAGE, qk_nope_head_dim=NOPE, rope_dim=ROPE, v_head_dim=VALUE, dtype=torch.bfloat16,
                device=device)
            prefixattn.mla_naive_attention(b["q_nope"], b["q_pe"], b["cache"], plan(cache), b["w_uk"], b["w_uv"],
                                           layer=0)  # the first step: it up-projects the prefix into the cache
            p, layer = plan(cache), 0  # a later step's: every prefix block found
        args = (b["q_nope"], b["q_pe"], b["cache"], p, b["w_uk"], b["w_uv"])
        return (lambda: out.copy_(prefixattn.mla_naive_attention(*args, layer=layer))), out, p.absorbed
    out = torch.empty((b["q"].shape[0], b["heads"], RANK), dtype=torch.bfloat16, device=device)
    meta = (b["qo_indptr"].to(device), b["kv_lens"].to(device), b["table"].to(device))
    if name.startswith("prefixattn"):
        p = prefixattn.plan_mla(*meta, block_size=PAGE, num_heads=b["heads"], sm_scale=SM_SCALE,
                                q_dtype=torch.bfloat16, sharing="never" if name.endswith("nosharing") else "auto")
        return (lambda: prefixattn.mla_attention(b["q"], b["cache"], p, out=out)), out, p
    w = _mla_wrapper(_flashinfer(), b, b["table"], b["kv_lens"], device)
    q_nope, q_pe = b["q"][..., :RANK], b["q"][..., RANK:]
    ckv, kpe = b["cache"][..., :RANK], b["cache"][..., RANK:]
    return (lambda: w.run(q_nope, q_pe, ckv, kpe, out=out)), out, None


def _correct(out, rows, want) -> tuple[bool, float]:
    from tests.tolerances import ATTENTION_TOL
    import torch

    got = out[rows.to(out.device)].double().cpu()
    atol, rtol = ATTENTION_TOL[torch.bfloat16]
    err = (got - want).abs()
    return bool(torch.isfinite(got).all() and (err <= atol + rtol * want.abs()).all()), float(err.max())


def time_graphed(args, timer, results, row: tuple, run, out, check) -> tuple[dict, bool]:
    """Time a checked provider as every MLA provider is timed: its output poisoned, its run captured in a CUDA graph
    and replayed, ``check()`` again (``graph_correct``), then replays with the L2 flushed and warm; in the dry run one
    interpreted run. ``row``: ``(benchmark, provider, shape)`` of the results. Returns ``(times, graph correct)``."""
    import torch

    from gpu_check.measure import capture

    ok = True
    if args.dry_run:
        times = {"graph_flushed": timer.repeat(run, 1, flush=False)}
    else:
        out.fill_(float("nan"))
        graph, _ = capture(run)
        graph.replay()
        torch.cuda.synchronize()
        ok = check()
        results.add(*row, "graph_correct", float(ok), "bool")
        runs = timer.runs_for(graph.replay)
        times = {"graph_flushed": timer.repeat(graph.replay, runs, flush=True),
                 "graph_warm": timer.repeat(graph.replay, runs, flush=False)}
    for policy, t in times.items():
        for stat, us in t.items():
            results.add(*row, f"{policy}_us_{stat}", us, "us")
    return times, ok


def step_mla(args, results, skips, device: str, fi_ready: dict, ceil: dict | None) -> None:
    import torch

    from gpu_check.clock import Clock
    from gpu_check.measure import Timer, record_state

    clock = Clock("mla", skips)
    timer = Timer(args.dry_run, device)
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    hbm = (ceil or {}).get("hbm_bytes_per_s")
    for i, (name, heads, requests, shared, own) in enumerate(shapes):
        if clock.expired([s[0] for s in shapes[i:]]):
            return  # the prefill contexts after the decode shapes: skipped with them
        b = _batch(heads, requests, shared, own, device)
        rows, want = _want(b)
        # The naive form's output is the value: the reference latent times W_UV.
        want_value = torch.einsum("bhr,hrv->bhv", want, b["w_uv"].double().cpu())
        if hbm:
            results.add(BENCH, "floor", name, "floor_memory_us", b["unique_bytes"] / hbm * 1e6, "us")
        for provider in PROVIDERS:
            try:
                if provider in ("flashinfer-mla", "typhoon-mla") and "_why" in fi_ready:
                    # Its module was to be built by the warm-up; compiling it here would take the step's budget.
                    raise RuntimeError(f"FlashInfer's warm-up did not finish: {fi_ready['_why']}")
                run, out, p = _provider(provider, b, device)
                run()
            except RuntimeError as exc:
                results.add(BENCH, provider, name, "not_run", 1.0, f"reason: {exc}"[:200])
                print(f"[mla] {name} {provider}: not run: {exc}", flush=True)
                continue
            expected = want_value if provider in VALUE_PROVIDERS else want
            ok, err = _correct(out, rows, expected)
            results.add(BENCH, provider, name, "correct", float(ok), "bool")
            results.add(BENCH, provider, name, "max_abs_err", err, "abs")
            if p is not None:
                results.add(BENCH, provider, name, "shared_nodes", float(p.stats["num_shared_nodes"]), "count")
            times, ok = time_graphed(args, timer, results, (BENCH, provider, name), run, out,
                                     lambda: _correct(out, rows, expected)[0])
            print(f"[mla] {name} {provider}: {times['graph_flushed']['median']:.1f} us, correct {ok} "
                  f"(max err {err:.2g})", flush=True)
        if not args.dry_run:
            record_state(results, BENCH, name)
        del b
    from gpu_check.mla_prefill import run_shapes

    run_shapes(args, results, clock, timer, device, fi_ready)  # the prefill contexts, under the step's budget
    if args.dry_run:
        clock.skip("dry run: one interpreted run per provider stands for every statistic, no CUDA graph")
