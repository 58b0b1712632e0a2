"""Each metadata builder plans with the geometry of the layers it serves, not the model config's.

vLLM gives a speculative-decoding draft model's layers (same KV cache group as the target's: same cache spec) a
metadata builder of their own when their query-head count differs; that builder's plans and workspaces must have the
draft's head count.
"""

import pytest
import torch

pytestmark = pytest.mark.vllm

BLOCK, HKV, D = 32, 2, 64
TARGET_HEADS, DRAFT_HEADS = 4, 8  # the tiny Llama has 4 query heads; its draft here 8
TARGET = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
DRAFT = ["draft.layers.0.self_attn.attn"]


@pytest.fixture
def vllm_config(tiny_llama):
    """Two target layers and one draft layer (prefixattn's impl) in the static forward context."""
    from tests.vllm.layers import config_with_layers

    return config_with_layers(tiny_llama, {**dict.fromkeys(TARGET, TARGET_HEADS), **dict.fromkeys(DRAFT, DRAFT_HEADS)})


def _spec():
    from tests.vllm.layers import full_attention_spec

    return full_attention_spec(BLOCK)


def _metadata(num_reqs: int = 2):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    seq_lens = torch.full((num_reqs,), 40, dtype=torch.int32)
    table = torch.tensor([[3, 4]] * num_reqs, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=num_reqs, num_actual_tokens=num_reqs, max_query_len=1, max_seq_len=40, block_table_tensor=table,
        slot_mapping=torch.arange(num_reqs, dtype=torch.int64))


@pytest.mark.parametrize("layer_names, heads", [(TARGET, TARGET_HEADS), (DRAFT, DRAFT_HEADS)])
def test_a_builder_plans_with_its_own_layers_head_count(vllm_config, layer_names, heads):
    from prefixattn.integrations.vllm.backend import PrefixAttnMetadataBuilder

    builder = PrefixAttnMetadataBuilder(_spec(), layer_names, vllm_config, torch.device("cpu"))
    assert (builder.num_qo_heads, builder.num_kv_heads, builder.head_dim) == (heads, HKV, D)
    plan = builder.build(0, _metadata()).plan
    assert (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim) == (heads, HKV, D)
    ws = builder.eager_attn.workspace
    assert ws.ws_o.shape[1:] == (heads, D)  # the partial-state workspace is sized for these heads


def test_a_builder_over_layers_of_two_head_counts_is_refused(vllm_config):
    from prefixattn.integrations.vllm.backend import PrefixAttnMetadataBuilder

    with pytest.raises(ValueError, match=r"not valid for this configuration.*different num_heads values \[4, 8\]"):
        PrefixAttnMetadataBuilder(_spec(), TARGET + DRAFT, vllm_config, torch.device("cpu"))


def test_layers_that_disagree_with_the_cache_spec_are_refused(vllm_config):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from prefixattn.integrations.vllm.backend import PrefixAttnMetadataBuilder

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=D, dtype=torch.float32)
    with pytest.raises(ValueError, match="the group's layers have num_kv_heads=2, its KV cache spec 1"):
        PrefixAttnMetadataBuilder(spec, TARGET, vllm_config, torch.device("cpu"))


def test_the_profile_foresees_one_builder_per_head_count(vllm_config):
    # The workspaces reserved in vLLM's memory profile follow vLLM's split of the one KV cache group (same spec)
    # into attention groups by query heads: the draft's builder gets a workspace with its own heads.
    from prefixattn.integrations.vllm.backend import PrefixAttnImpl
    from prefixattn.integrations.vllm.workspace_pool import expected_builders

    keys = expected_builders(vllm_config, device="cpu", impl_cls=PrefixAttnImpl)
    assert sorted((k.layer_names, k.geometry.num_qo_heads) for k in keys) == [
        (tuple(DRAFT), DRAFT_HEADS), (tuple(TARGET), TARGET_HEADS)]
