"""The simulator's MLA and MoE model (DeepSeek-V2-Lite): its arithmetic from the published config, the attention it
prices as prefixattn's MLA kernel runs it (absorbed form, head blocks over one latent), and a shared-prompt workload
(modeled)."""

import numpy as np
import pytest

from prefixattn.planner.cost_rule import mla_cost_head_dim, mla_heads_per_program, sharing_pays_off
from prefixattn.sim.presets import MODELS, get_model
from prefixattn.sim.simulate import simulate
from prefixattn.sim.step_cost import CostModel, SharedRun, StepShape

LITE = get_model("deepseek-v2-lite")


def test_deepseek_v2_lite_from_its_config():
    # DeepSeek-V2-Lite's model card: 15.7B parameters, 2.4B activated per token (here with both embedding matrices)
    assert 15.6e9 < LITE.num_params < 15.8e9 and 2.2e9 < LITE.active_params < 2.7e9
    # One latent row (512 + 64, bf16) per token and layer: 31 KB a token where Llama-3.1-8B caches 128 KB
    assert LITE.kv_bytes_per_token == 27 * (512 + 64) * 2
    assert LITE.kv_bytes_per_token * 4 < MODELS["llama-3.1-8b"].kv_bytes_per_token
    # Absorbed queries (128 + 64 per head), the latent and rotary key, the up-projection, O over 16 x 128 values
    assert LITE.attention_shapes() == [("q", 2048, 16 * 192), ("kv_a", 2048, 576), ("kv_b", 512, 16 * 256),
                                       ("o", 2048, 2048)]
    (dense, dense_gemms), (moe, moe_gemms) = LITE.layer_kinds()
    assert (dense, moe) == (1, 26) and dense_gemms[-1] == ("down", 10944, 2048, 0)
    assert moe_gemms[-2:] == [("experts_gate_up", 2048, 2 * 1408, 64), ("experts_down", 1408, 2048, 64)]


def test_attention_is_priced_as_prefixattns_mla_kernel():
    cm = CostModel("h100", LITE)
    # Absorbed form: per (query, key, head) the 576-wide score and the 512-wide latent output
    assert cm._attn_flops_per_pair == 2 * (512 + 64 + 512) * 16
    assert cm._kv_head_bytes == cm._kv_token_bytes == (512 + 64) * 2
    # The sharing rule the planner applies to an MLA plan: one head block of 16 heads per program, the latent priced
    # as K and V of half its width each
    for requests, rows, tokens in ((2, 2, 64), (2, 2, 400), (64, 64, 40), (8, 800, 2000)):
        m_tiles = -(-rows * 16 // cm.calib.attn_block_m)
        want = sharing_pays_off(num_requests=requests, num_rows=rows, num_m_tiles=m_tiles, num_tokens=tokens,
                                group=mla_heads_per_program(16), head_dim=mla_cost_head_dim(512, 64), elt_bytes=2)
        assert cm.sharing_pays_off(requests, rows, tokens) == bool(want)


def test_a_shared_latent_prefix_is_read_once():
    cm = CostModel("h100", LITE)
    q = np.ones(256, dtype=np.int64)
    shape = dict(q_lens=q, kv_lens=np.full(256, 4100), num_sampled=256, shared_lens=np.full(256, 4000),
                 shared_nodes=[SharedRun(4000, 256)])
    _, paged_flops_s, paged_bytes_s, _ = cm.attention_time(StepShape(**shape), "paged")
    fused, fused_flops_s, fused_bytes_s, _ = cm.attention_time(StepShape(**shape), "fused")
    # 256 reads of the 4K latent prefix become one per shared tile; the absorbed form's FLOPs stay (at Triton's
    # rate), so the step turns compute-bound: the naive form's lever, not modeled
    assert fused_bytes_s < paged_bytes_s / 4 and fused_flops_s >= paged_flops_s
    assert fused < cm.attention_time(StepShape(**shape), "paged")[0]
    # MoE: a 256-token decode step touches every expert (uniform routing), 1 token about 8 of 64 per layer
    one = cm.linear_time(1, 1)
    assert cm.linear_time(256, 256)[0] > 4 * one[0] and one[0] < CostModel("h100", "llama-3.1-8b").linear_time(1, 1)[0]


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_a_shared_prompt_workload_runs_faster_with_prefix_sharing(gpu):
    vllm, ours = simulate("shared-prompt-4k", ["vllm", "prefixattn"], model="deepseek-v2-lite", gpu=gpu,
                          num_requests=64)
    assert ours.modeled and ours.throughput_tok_s > vllm.throughput_tok_s
