"""A tiny random Llama for end-to-end runs of the real engine (no hub access, a few MB)."""

from __future__ import annotations

#: Larger than Llama's 0.02 so the random model's next-token distribution is peaked: the greedy top-2 logprob gap
#: is then >= 0.017 on the e2e prompts (measured), ~10^4x the fp32 difference between two attention backends, so
#: "same greedy tokens" cannot flip on a near tie.
INIT_RANGE = 0.2
VOCAB = 512


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
