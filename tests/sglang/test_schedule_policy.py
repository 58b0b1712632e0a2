"""The prefix-group schedule policy inside SGLang's own SchedulePolicy, on a queue of 1,000 real ``Req`` objects.

The workload: one system prompt shared by everyone, 40 documents each asked 24 questions, 40 unrelated prompts,
submitted in shuffled order (an offline batch). SGLang's ``lpm`` gives up above 128 waiting requests and leaves the
queue in arrival order; ``prefixattn`` must put every document's requests next to each other, in the order
prefixattn.scheduling gives.
"""

from __future__ import annotations

import array
import random

import pytest
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import WAITING_QUEUE_PREFIX_MATCH_MAX, SchedulePolicy
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.sampling.sampling_params import SamplingParams

from prefixattn.integrations.sglang import plugin
from prefixattn.integrations.sglang.schedule_policy import (OUTPUT_LEN_KEY, POLICY_NAME, output_len_inputs,
                                                            policy_names, prefix_group_order)
from prefixattn.scheduling import DEFAULT_ORDERING, ORDERINGS

pytestmark = pytest.mark.sglang

NUM_DOCS, QUESTIONS_PER_DOC, NUM_LONERS = 40, 24, 40  # 1,000 requests
SYSTEM = list(range(1, 33))


@pytest.fixture(scope="module")
def sglang_context(tmp_path_factory):
    """SGLang's process config (the scheduler reads it through runtime_context), for a tiny local model."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    model_dir = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
    plugin.enable()
    args = ServerArgs(model_path=str(model_dir), device="cpu", skip_tokenizer_init=True, schedule_policy=POLICY_NAME)
    with runtime_context.use_context(runtime_context.create_context(args, role="scheduler")):
        yield runtime_context


def _workload(seed=0):
    """Requests (shuffled) and the document each asks about (None for the unrelated ones)."""
    rng = random.Random(seed)
    prompts, docs = [], []
    for d in range(NUM_DOCS):
        doc = [1000 + 100 * d + j for j in range(rng.randint(16, 64))]
        for q in range(QUESTIONS_PER_DOC):
            prompts.append(SYSTEM + doc + [100_000 + 100 * d + q] * rng.randint(1, 8))
            docs.append(d)
    for i in range(NUM_LONERS):
        prompts.append([200_000 + 1000 * i + j for j in range(rng.randint(8, 40))])
        docs.append(None)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    reqs = [Req(f"req-{i}", "", array.array("q", prompts[i]), SamplingParams(max_new_tokens=16)) for i in order]
    return reqs, {f"req-{i}": docs[i] for i in order}


def _policy(name):
    tree_cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                            page_size=1))
    return SchedulePolicy(name, tree_cache, False, False, False)


def _doc_runs(queue, doc_of):
    """Number of maximal runs of consecutive requests about the same document."""
    docs = [doc_of[r.rid] for r in queue if doc_of[r.rid] is not None]
    return 1 + sum(a != b for a, b in zip(docs, docs[1:]))


def test_lpm_falls_back_to_arrival_order_above_128_waiting(sglang_context):
    """The gap this policy fills, checked on SGLang itself."""
    reqs, doc_of = _workload()
    assert len(reqs) > WAITING_QUEUE_PREFIX_MATCH_MAX
    queue = list(reqs)
    _policy("lpm").calc_priority(queue)
    assert [r.rid for r in queue] == [r.rid for r in reqs]
    assert _doc_runs(queue, doc_of) > 10 * NUM_DOCS


def test_groups_come_out_contiguous_in_the_scheduler_order(sglang_context):
    policy = _policy(sglang_context.get_schedule().schedule_policy)  # what Scheduler.init_schedule_policy does
    order = policy.prefixattn_order
    assert order.ordering == DEFAULT_ORDERING
    reqs, doc_of = _workload()
    queue = list(reqs)
    policy.calc_priority(queue)

    assert sorted(r.rid for r in queue) == sorted(r.rid for r in reqs)
    assert _doc_runs(queue, doc_of) == NUM_DOCS  # every document's 24 requests are adjacent
    known, limits = output_len_inputs(reqs)
    expected = prefix_group_order([list(r.origin_input_ids) for r in reqs], DEFAULT_ORDERING, known=known,
                                  limits=limits)
    assert [r.rid for r in queue] == [reqs[i].rid for i in expected]

    # Admission takes requests off the front; the rest keeps its order without regrouping.
    queue = queue[100:]
    policy.calc_priority(queue)
    assert order.regroups == 1
    assert [r.rid for r in queue] == [reqs[i].rid for i in expected[100:]]

    # New arrivals (a new document's questions, appended at the back) are regrouped into place.
    doc = [900_000 + j for j in range(20)]
    new = [Req(f"new-{q}", "", array.array("q", SYSTEM + doc + [990_000 + q]), SamplingParams(max_new_tokens=16))
           for q in range(QUESTIONS_PER_DOC)]
    doc_of.update({r.rid: NUM_DOCS for r in new})
    queue += new
    policy.calc_priority(queue)
    assert order.regroups == 2
    assert _doc_runs(queue, doc_of) == len({doc_of[r.rid] for r in queue} - {None})


@pytest.mark.parametrize("ordering", sorted(ORDERINGS))
def test_every_named_ordering_is_a_policy(sglang_context, ordering):
    name = f"{POLICY_NAME}-{ordering}"
    assert name in policy_names()
    policy = _policy(name)
    reqs, doc_of = _workload(seed=1)
    queue = list(reqs)
    policy.calc_priority(queue)
    known, limits = output_len_inputs(reqs)
    expected = prefix_group_order([list(r.origin_input_ids) for r in reqs], ordering, known=known, limits=limits)
    assert [r.rid for r in queue] == [reqs[i].rid for i in expected]
    assert _doc_runs(queue, doc_of) >= NUM_DOCS  # blendserve may split a group; its pieces still share a prefix


def test_other_policies_are_untouched(sglang_context):
    policy = _policy("fcfs")
    assert not hasattr(policy, "prefixattn_order")
    with pytest.raises(ValueError, match="schedule_policy: expected one of"):
        _policy(f"{POLICY_NAME}-no-such-ordering")


def _mixed_outputs(seed=0, custom=None):
    """``_workload`` with each document's questions asking for the same max_new_tokens, documents differing (4 to
    512); ``custom(doc, q)`` may add a custom_params estimate."""
    reqs, doc_of = _workload(seed)
    rng = random.Random(seed + 1)
    per_doc = [rng.choice((4, 16, 64, 256, 512)) for _ in range(NUM_DOCS)]
    for r in reqs:
        d = doc_of[r.rid]
        r.sampling_params.max_new_tokens = per_doc[d] if d is not None else 32
        extra = custom(d, r) if custom and d is not None else None
        if extra is not None:
            r.sampling_params.custom_params = {OUTPUT_LEN_KEY: extra}
    return reqs, doc_of, per_doc


def _doc_order(queue, doc_of):
    seen = []
    for r in queue:
        d = doc_of[r.rid]
        if d is not None and d not in seen:
            seen.append(d)
    return seen


@pytest.mark.parametrize("ordering", ["batchllm", "blendserve"])
def test_max_new_tokens_are_the_decode_weights(sglang_context, ordering):
    """Groups asking for long outputs weigh more in BatchLLM Eq. 3 and in BlendServe's density: the policy must
    hand the requests' max_new_tokens to the ordering (it used to order without any output length)."""
    reqs, doc_of, per_doc = _mixed_outputs()
    queue = list(reqs)
    _policy(f"{POLICY_NAME}-{ordering}").calc_priority(queue)
    prompts = [list(r.origin_input_ids) for r in reqs]
    limits = [float(r.sampling_params.max_new_tokens) for r in reqs]
    with_lens = [reqs[i].rid for i in prefix_group_order(prompts, ordering, limits=limits)]
    assert [r.rid for r in queue] == with_lens
    assert with_lens != [reqs[i].rid for i in prefix_group_order(prompts, ordering)]  # the weights changed it
    if ordering == "batchllm":  # Eq. 3: larger mean(decode) / prefill first
        first, last = _doc_order(queue, doc_of)[0], _doc_order(queue, doc_of)[-1]
        assert per_doc[first] == max(per_doc) and per_doc[last] == min(per_doc)


def test_custom_estimates_fill_their_group_and_are_capped(sglang_context):
    """A sampled estimate (custom_params) on one request of a document stands for its whole group; a request never
    weighs more than the tokens it may still generate (a retracted one has some already)."""
    reqs, doc_of, per_doc = _mixed_outputs(custom=lambda d, r: 3 if d == 0 and r.rid.endswith("0") else None)
    known, limits = output_len_inputs(reqs)
    sampled = [i for i, r in enumerate(reqs) if r.sampling_params.custom_params]
    assert sampled and all(known[i] == 3 for i in sampled)
    from prefixattn.scheduling import group_prompts
    from prefixattn.scheduling.output_lengths import request_output_lens

    lens = request_output_lens(group_prompts([list(r.origin_input_ids) for r in reqs]), known, limits)
    assert {lens[i] for i, r in enumerate(reqs) if doc_of[r.rid] == 0} == {min(3.0, per_doc[0])}
    retracted = reqs[1]
    retracted.output_ids = [7] * 3
    assert output_len_inputs([retracted])[1] == [max(0.0, retracted.sampling_params.max_new_tokens - 3.0)]
    retracted.sampling_params.custom_params = {OUTPUT_LEN_KEY: "long"}
    with pytest.raises(ValueError, match=OUTPUT_LEN_KEY):
        output_len_inputs([retracted])
