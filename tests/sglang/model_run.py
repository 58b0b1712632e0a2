"""Tiny random SGLang models end to end on CPU: SGLang's own model classes, pools, radix cache and attention backends.

Run as ``python -m tests.sglang.model_run IN.json OUT.json`` (a subprocess of ``run_models`` in
tests/sglang/test_e2e_models.py: it publishes SGLang's process-wide server config and builds a gloo process group,
neither of which can be undone in the pytest process). For each run in the input it builds the model (``sglang.srt.models.<module>``) with random
weights from a fixed seed, then serves one shared-prefix session through :class:`tests.sglang.engine.MiniEngine`
with the named attention backend:

1. request 0 (``PREFIX + question 0``) is prefilled alone and put in the radix cache;
2. requests 1 and 2 (same prefix, other questions) get the prefix's KV slots from the radix cache and prefill the
   rest in one EXTEND batch (a causal extend over a shared cached prefix);
3. all three decode ``DECODE_STEPS`` greedy tokens in DECODE batches (the prefix slots are shared).

It writes each run's greedy tokens and their log-probabilities, the smallest top-1/top-2 log-probability gap over
all of them, and (prefixattn)
the shared nodes of every plan, per layer kind (window_left).

What is not SGLang's production path, and why (test-only, in this process only):

* no ModelRunner / Scheduler / Engine: the runner needs ``sgl_kernel`` for its CPU device (``SGLANG_USE_CPU_ENGINE``);
  MiniEngine does the scheduler's slot and radix-cache bookkeeping, and this module builds ``ForwardBatch`` and the
  ``ForwardContext`` the runner would;
* every fused op runs its ``forward_native`` torch path: ``set_fused_op_backend(KernelBackend.TORCH)``, SGLang's own
  debug switch (``SGLANG_FORCE_FUSED_OP_BACKEND=torch``);
* ``sglang.srt.layers.rotary_embedding.base._is_cpu`` is set True before the model is built: with no CUDA and no
  ``SGLANG_USE_CPU_ENGINE`` the rotary embedding's constructor imports ``vllm._custom_ops`` for a fallback kernel it
  never calls on the native path (its forward dispatches to ``forward_native`` here);
* the DeepSeek-V3 model: ``moe_layer_freq`` is added to its HF config (DeepSeek-V3's ``config.json`` has it,
  transformers' config class lacks it), ``post_load_weights()`` splits the random ``kv_b_proj`` as it does a
  checkpoint's, and every backend is stamped with its name and takes the absorbed form (:func:`make_backend`);
* SGLang's Triton attention backend (the reference for sinks: SGLang refuses gpt-oss on ``torch_native``, and
  ``TorchNativeAttnBackend.forward_extend`` has no ``sinks`` argument) runs its kernels in the Triton interpreter,
  built over a namespace with the runner attributes it reads. It is no fp8 reference: its extend kernel attends the
  new tokens' K/V as computed (unquantized), where prefixattn and torch_native read them back from the fp8 pool, so
  the greedy tokens differ legitimately (measured on gpt-oss with an e5m2 pool: the first token already differs).
"""

from __future__ import annotations

import json
import os
import socket
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: SGLang's Triton backend on CPU

from tests.sglang import torchvision_stub  # noqa: E402

torchvision_stub.install()

import torch  # noqa: E402

from tests.vllm.tiny_model import INIT_RANGE, VOCAB  # noqa: E402  (one definition of the tiny-model init)

#: Printed to stderr before each stage, so a failure names the stage it died in.
STAGE_MARK = "@@stage "
#: 24 shared prompt tokens: longer than WINDOW, so the windowed layers' windows start inside the shared prefix.
PREFIX = [7 + 13 * i % 400 for i in range(24)]
QUESTIONS = ([450, 451, 452, 453], [460, 461, 462, 463, 464], [470, 471, 472])
#: HF ``sliding_window`` (SGLang's ``sliding_window_size`` = WINDOW - 1 = FlashInfer's window_left) of the Gemma 3
#: model, whose reference is SGLang's torch_native backend.
WINDOW = 16
#: gpt-oss's window: its reference is SGLang's Triton backend, whose decode path in 0.5.23 gives a windowed query one
#: key fewer than its own extend path and every other SGLang backend (``update_sliding_window_buffer`` keeps
#: ``min(seq_len, sliding_window_size)`` keys, not ``sliding_window_size + 1``; measured per layer here: extend matches
#: window_left = 15, decode window_left = 14; sgl-project/sglang#32087). So the gpt-oss window (layer 0) is longer than
#: every sequence of the session: the layer still plans and runs with its window, which never excludes a key.
OSS_WINDOW = 64
DECODE_STEPS = 4
#: One sink logit per query head, spread so heads of one KV group differ (as in tests/vllm/test_e2e_sinks.py).
SINKS = (0.0, 2.0, 4.0, 6.0)
#: Gemma scales the input embedding by sqrt(hidden_size) (16 here) and SGLang's Gemma 3 always uses it as the LM head:
#: a token's logit gets 16 * |e|^2 from its own input embedding against ~32 * std(e) from everything the layers add,
#: so with a large embedding each greedy token repeats its input whatever attention computes (measured at 1x and
#: 0.1x the layers' init: 5 x the same token per request). At 0.02x the layers decide (the control run in
#: test_e2e_models.py checks that the window changes the tokens).
EMBED_STD_FACTOR = 0.02

_COMMON = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, max_position_embeddings=1024)


def _hf_config(arch: str):
    """(HF config, SGLang module, class) of a tiny 2-layer model: layer 0 windowed, layer 1 full."""
    import transformers

    if arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(**_COMMON, intermediate_size=512, sliding_window=WINDOW,
                                            layer_types=["sliding_attention", "full_attention"],
                                            architectures=["Gemma3ForCausalLM"])
        return cfg, "gemma3_causal", "Gemma3ForCausalLM"
    if arch == "gpt_oss":
        cfg = transformers.GptOssConfig(**_COMMON, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=OSS_WINDOW,
                                        layer_types=["sliding_attention", "full_attention"],
                                        architectures=["GptOssForCausalLM"])
        return cfg, "gpt_oss", "GptOssForCausalLM"
    if arch == "deepseek_v3":  # MLA: 4 heads over one 512 + 64 latent head, dense MLPs (first_k_dense_replace)
        cfg = transformers.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
            qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, max_position_embeddings=1024,
            moe_layer_freq=1,  # DeepSeek-V3's config.json has it and SGLang reads it; transformers 5.19's lacks it
            rope_scaling=dict(type="yarn", rope_type="yarn", factor=4.0, original_max_position_embeddings=256,
                              beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
            architectures=["DeepseekV3ForCausalLM"])
        return cfg, "deepseek_v2", "DeepseekV3ForCausalLM"
    raise ValueError(f"arch: expected 'gemma3', 'gpt_oss' or 'deepseek_v3', got {arch!r}")


def _stage(name: str) -> None:
    print(f"{STAGE_MARK}{name}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_sglang(model_dir: str):
    """SGLang's process state a model constructor reads: published server config, a 1-rank gloo world, native ops."""
    from sglang.kernels.fused_op import set_fused_op_backend
    from sglang.kernels.spec import KernelBackend
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state
    from sglang.srt.server_args import ServerArgs

    # "triton": the backend SGLang accepts for every model here (its gpt-oss hook refuses torch_native); the
    # attention backends themselves are built by this module, not from this setting.
    server_args = ServerArgs(model_path=model_dir, device="cpu", skip_tokenizer_init=True, dtype="float32",
                             attention_backend="triton")
    runtime_context.publish(server_args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
    parallel_state.init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    parallel_state.initialize_model_parallel()
    set_fused_op_backend(KernelBackend.TORCH)
    import sglang.srt.layers.rotary_embedding.base as rotary_base

    rotary_base._is_cpu = True  # see the module docstring
    return server_args


def build_model(cfg, module: str, cls: str, *, seed: int = 0):
    import importlib

    from sglang.srt.layers.layernorm import RMSNorm

    model = getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls)(cfg)
    # SGLang's RMSNorm multiplies by its weight (init 1, as in HF); GemmaRMSNorm by 1 + weight (init 0).
    unit_norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):  # set per run (set_features)
                continue
            std = INIT_RANGE * EMBED_STD_FACTOR if name.endswith("embed_tokens.weight") else INIT_RANGE
            p.copy_((torch.randn(p.shape, generator=gen) * std + (1.0 if name in unit_norms else 0.0)).to(p.dtype))
    if hasattr(model, "post_load_weights"):  # DeepSeek: kv_b_proj split into the absorbed form's W_UK and W_UV
        model.post_load_weights()
    return model.eval()


def _attention_layers(model):
    from sglang.srt.layers.radix_attention import RadixAttention

    return [m for m in model.modules() if isinstance(m, RadixAttention)]


def set_features(model, *, sinks=None, no_window: bool = False) -> None:
    """Per run: gpt-oss's sink logits (``SINKS`` unless given), and for a control run every window switched off."""
    for name, p in model.named_parameters():
        if name.endswith(".sinks"):
            with torch.no_grad():
                p.copy_(torch.tensor(sinks if sinks is not None else SINKS, dtype=p.dtype))
    for layer in _attention_layers(model):
        if not hasattr(layer, "_window"):
            layer._window = layer.sliding_window_size
        layer.sliding_window_size = -1 if no_window else layer._window


def set_kv_scales(model, scale: float | None) -> None:
    """What SGLang's fp8 KV quant method leaves on each layer after loading a checkpoint with per-tensor scales."""
    for layer in _attention_layers(model):
        if scale is None:
            layer.k_scale = layer.v_scale = layer.k_scale_float = layer.v_scale_float = None
        else:
            layer.k_scale = torch.nn.Parameter(torch.tensor(scale), requires_grad=False)
            layer.v_scale = torch.nn.Parameter(torch.tensor(scale * 2), requires_grad=False)
            layer.k_scale_float, layer.v_scale_float = scale, scale * 2


def make_pool(eng, cfg):
    """The session's KV pool: SGLang's latent pool for an MLA model, else MiniEngine's MHA pool."""
    if getattr(cfg, "kv_lora_rank", None) is None:
        return eng.make_pool()
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(eng.pool_size, eng.page_size, eng.kv_dtype, kv_lora_rank=cfg.kv_lora_rank,
                            qk_rope_head_dim=cfg.qk_rope_head_dim, layer_num=cfg.num_hidden_layers, device="cpu",
                            enable_memory_saver=False)


def make_backend(name: str, eng, pool, model, server_args):
    backend = _make_backend(name, eng, pool, model, server_args)
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    if isinstance(pool, MLATokenToKVPool):
        # SGLang's DeepSeek attention picks its form by the backend's name, which the ModelRunner resolves from the
        # server args (this module's are fixed): stamped as the runner would. Every run takes the absorbed form:
        # prefixattn's plugin registers that rule for its name; torch_native (the reference) gets the same rule here,
        # since for a name it does not know SGLang up-projects a prefill without cached prefix, and torch_native
        # reads the latent pool instead.
        from prefixattn.integrations.sglang.mla_backend import force_absorbed_mla

        force_absorbed_mla(name)
        backend.prefill_attention_backend_str = backend.decode_attention_backend_str = name
    return backend


def _make_backend(name: str, eng, pool, model, server_args):
    runner = eng.runner(pool)
    runner.dtype = eng.dtype  # ModelRunner.dtype: the model's
    if name == "prefixattn":
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        if isinstance(pool, MLATokenToKVPool):
            from prefixattn.integrations.sglang.mla_backend import PrefixAttnMLABackend

            return PrefixAttnMLABackend(runner, sharing="always")
        from prefixattn.integrations.sglang.backend import PrefixAttnBackend

        return PrefixAttnBackend(runner, sharing="always")  # share every common prefix: sharing is exercised
    if name == "torch_native":
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return TorchNativeAttnBackend(runner)
    if name == "triton":
        from sglang.srt.arg_groups.model_override_base import model_config_of
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner.__dict__.update(
            sliding_window_size=model.get_attention_sliding_window_size(), page_size=eng.page_size,
            token_to_kv_pool_allocator=None, model_config=model_config_of(server_args), is_draft_worker=False,
            spec_algorithm=SpeculativeAlgorithm.NONE, kv_cache_dtype=pool.dtype, gpu_id=0,
            decode_num_tokens_per_req=lambda: 1,
            kv_index_translator=KVIndexTranslator(req_to_token=eng.req_to_token_pool.req_to_token,
                                                  token_to_kv_pool_allocator=None, token_to_kv_pool=pool,
                                                  page_size=eng.page_size, device="cpu"))
        return TritonAttnBackend(runner)
    raise ValueError(f"backend: expected prefixattn, torch_native or triton, got {name!r}")


def _forward(model, backend, fb) -> torch.Tensor:
    """One model forward as SGLang's ModelRunner runs it; the next-token logits ``[batch, vocab]``."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    fb.attn_backend = backend
    fb.capture_hidden_mode = CaptureHiddenMode.NULL
    backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        return model(fb.input_ids, fb.positions, fb).next_token_logits.float()


def _plans(backend) -> list:
    meta = getattr(backend, "forward_metadata", None)
    plans = getattr(meta, "plans", None) or {}
    return sorted([p.window_left, sorted([sorted(n.requests.tolist()), int(n.kv_end)] for n in p.shared_nodes)]
                  for p in plans.values())


def run_session(model, cfg, backend_name: str, server_args, *, kv_dtype: torch.dtype, page_size: int) -> dict:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from tests.sglang.engine import MiniEngine

    mla = getattr(cfg, "kv_lora_rank", None) is not None  # one latent KV head of kv_lora_rank + rope
    eng = MiniEngine(num_heads=cfg.num_attention_heads, num_kv_heads=1 if mla else cfg.num_key_value_heads,
                     head_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim if mla else cfg.head_dim, page_size=page_size,
                     num_layers=cfg.num_hidden_layers, kv_dtype=kv_dtype, num_pages=256 // page_size)
    backend = make_backend(backend_name, eng, make_pool(eng, cfg), model, server_args)
    tokens: list[list[int]] = [[] for _ in QUESTIONS]
    logprobs: list[list[float]] = [[] for _ in QUESTIONS]
    gaps, plans = [], []

    def step(extend: dict, mode) -> None:
        logits = _forward(model, backend, eng.batch(extend, mode))
        top2 = torch.log_softmax(logits, dim=-1).topk(2, dim=-1).values
        gaps.append(float((top2[:, 0] - top2[:, 1]).min()))
        plans.append([mode.name, _plans(backend)])
        for r, t, lp in zip(extend, logits.argmax(dim=-1).tolist(), top2[:, 0].tolist()):
            tokens[r].append(t)
            logprobs[r].append(lp)
            eng.append_token(r, t)

    r0 = eng.add_request(PREFIX + QUESTIONS[0])
    step({r0: len(PREFIX + QUESTIONS[0])}, ForwardMode.EXTEND)
    eng.cache_request(r0)
    rest = [eng.add_request(PREFIX + q) for q in QUESTIONS[1:]]
    cached = [eng.requests[r].cached_len for r in rest]
    step({r: len(eng.requests[r].tokens) - c for r, c in zip(rest, cached)}, ForwardMode.EXTEND)
    for _ in range(DECODE_STEPS):
        step({r: 1 for r in range(len(QUESTIONS))}, ForwardMode.DECODE)
    return dict(tokens=tokens, logprobs=logprobs, min_top2_gap=min(gaps), plans=plans, cached=cached,
                backend_class=f"{type(backend).__module__}.{type(backend).__name__}")


_KV_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def main(in_path: str, out_path: str) -> None:
    spec = json.loads(open(in_path).read())
    _stage("config")
    cfg, module, cls = _hf_config(spec["arch"])
    model_dir = spec["model_dir"]
    cfg.save_pretrained(model_dir)  # ServerArgs reads config.json from the model path
    _stage("init_sglang")
    server_args = init_sglang(model_dir)
    _stage("build_model")
    model = build_model(cfg, module, cls)
    results = {}
    for run in spec["runs"]:
        _stage(f"run {run['name']}")
        kv_dtype = _KV_DTYPES[run.get("kv_cache_dtype", "auto")] or torch.float32
        set_kv_scales(model, run.get("kv_scale"))
        set_features(model, sinks=run.get("sinks"), no_window=run.get("no_window", False))
        results[run["name"]] = run_session(model, cfg, run["backend"], server_args, kv_dtype=kv_dtype,
                                           page_size=run.get("page_size", 1))
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
