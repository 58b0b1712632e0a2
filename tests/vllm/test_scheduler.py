"""PrefixGroupScheduler inside vLLM's real scheduler, driven step by step the way vLLM's scheduler tests drive it
(schedule -> fake model output -> update_from_output): token budget, KV blocks, every request finishes, no leaked
blocks after the drain, and admission by prefix group in the policy's order."""

import random
from collections import deque

import pytest
import torch

pytestmark = pytest.mark.vllm

BLOCK = 32
VOCAB = 512


@pytest.fixture(scope="module")
def model_config(tiny_llama):
    from vllm.config import ModelConfig

    return ModelConfig(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=512)


def make_scheduler(model_config, cls, *, num_blocks, max_num_batched_tokens=256, max_num_seqs=64, ordering=None,
                   options=None):
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    is_async = issubclass(cls, AsyncScheduler)
    sched_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=512, enable_chunked_prefill=True, async_scheduling=is_async,
                                   is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config, scheduler_config=sched_config,
                             additional_config={"prefixattn": dict(options or {}, **({"ordering": ordering}
                                                                                      if ordering else {}))})
    vllm_config.scheduler_config.async_scheduling = is_async
    cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                                      dtype=torch.float32))])
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=BLOCK, log_stats=True,
               structured_output_manager=StructuredOutputManager(vllm_config))


def make_requests(prompts, max_tokens):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    return [Request(request_id=str(i), prompt_token_ids=p, pooling_params=None, block_hasher=hasher,
                    sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=float(i))
            for i, p in enumerate(prompts)]


def grouped_prompts(seed=0):
    """Three groups interleaved in arrival order: prefixes of 200, 100 and 40 tokens, 4 members each, plus 2
    requests sharing nothing. BatchLLM order puts lighter groups (less prefill per request) first."""
    r = random.Random(seed)
    prefixes = [[r.randrange(VOCAB) for _ in range(n)] for n in (200, 100, 40)]
    prompts = [prefixes[i % 3] + [r.randrange(VOCAB) for _ in range(r.randrange(5, 40))] for i in range(12)]
    prompts += [[r.randrange(VOCAB) for _ in range(r.randrange(20, 60))] for _ in range(2)]
    return prompts


def drive(sched, requests, max_tokens, *, max_steps=2000):
    """Run to completion; return (admission order of request ids, per-step stats). Asserts the budgets."""
    from vllm.v1.outputs import ModelRunnerOutput

    for req in requests:
        sched.add_request(req)
    admitted, resumed, num_blocks = [], 0, sched.kv_cache_config.num_blocks
    budget = sched.scheduler_config.max_num_batched_tokens
    for _ in range(max_steps):
        if not sched.has_requests():
            break
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= budget
        assert len(sched.running) <= sched.max_num_running_reqs
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() >= 0
        assert sched.kv_cache_manager.usage <= 1.0
        admitted += [r.req_id for r in out.scheduled_new_reqs]
        resumed += len(getattr(out.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if sched.requests[i].is_prefill_chunk else [7] for i in ids]
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={i: k for k, i in
                                                                                      enumerate(ids)},
                                                        sampled_token_ids=sampled))
    else:
        raise AssertionError(f"not drained after {max_steps} steps")
    for req in requests:
        assert req.is_finished() and req.num_output_tokens == max_tokens, (req.request_id, req.status)
    # No leaked blocks: everything is free again (blocks kept only as prefix cache are reusable, hence free).
    assert sched.kv_cache_manager.usage == 0.0
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1  # minus vLLM's null block
    return admitted, resumed


def expected_order(prompts, ordering="batchllm"):
    from prefixattn.integrations.vllm.scheduler import group_order

    return [str(i) for i in group_order(prompts, ordering=ordering, min_shared_tokens=BLOCK)]


@pytest.mark.parametrize("cls_name", ["PrefixGroupScheduler", "PrefixGroupSyncScheduler"])
def test_admits_by_prefix_group_in_batchllm_order(model_config, cls_name):
    import prefixattn.integrations.vllm.scheduler as S

    prompts = grouped_prompts()
    sched = make_scheduler(model_config, getattr(S, cls_name), num_blocks=400)
    assert isinstance(sched.waiting, S.PrefixGroupRequestQueue)
    admitted, _ = drive(sched, make_requests(prompts, max_tokens=4), 4)
    assert admitted == expected_order(prompts)
    # Groups are contiguous in admission order, and differ from arrival order (which interleaves them).
    group_of = {str(i): tuple(prompts[i][:40]) if i < 12 else i for i in range(len(prompts))}
    runs = [group_of[a] for k, a in enumerate(admitted) if k == 0 or group_of[a] != group_of[admitted[k - 1]]]
    assert len(runs) == len(set(runs))
    assert admitted != [str(i) for i in range(len(prompts))]


@pytest.mark.parametrize("ordering", ["fcfs", "dfs", "batchllm"])
def test_ordering_is_configurable(model_config, ordering):
    from prefixattn.integrations.vllm.scheduler import PrefixGroupSyncScheduler

    prompts = grouped_prompts(seed=1)
    sched = make_scheduler(model_config, PrefixGroupSyncScheduler, num_blocks=400, ordering=ordering)
    admitted, _ = drive(sched, make_requests(prompts, max_tokens=2), 2)
    assert admitted == expected_order(prompts, ordering)


def test_tight_kv_memory_preempts_and_still_drains(model_config):
    from prefixattn.integrations.vllm.scheduler import PrefixGroupScheduler

    prompts = grouped_prompts(seed=2)
    # 24 blocks of 32 tokens hold a few requests at once: admission stops on memory, decodes grow into
    # preemption, and every request must still finish with nothing leaked.
    sched = make_scheduler(model_config, PrefixGroupScheduler, num_blocks=24, max_num_batched_tokens=128)
    admitted, resumed = drive(sched, make_requests(prompts, max_tokens=48), 48)
    assert sorted(set(admitted), key=int) == [str(i) for i in range(len(prompts))]
    assert resumed > 0  # the case is tight enough to preempt (else this test would not test it)


def test_queue_front_and_removal_semantics():
    from prefixattn.integrations.vllm.scheduler import PrefixGroupRequestQueue

    class Req:
        def __init__(self, name, ids, priority=0):
            self.name, self.prompt_token_ids, self.priority = name, ids, priority

    a1, b1, a2, b2 = (Req("a1", [1] * 40 + [2]), Req("b1", [5] * 80 + [2]), Req("a2", [1] * 40 + [3]),
                      Req("b2", [5] * 80 + [3]))
    emb = Req("emb", None)
    q = PrefixGroupRequestQueue(min_shared_tokens=16)
    for r in (b1, a1, emb, b2, a2):
        q.add_request(r)
    assert len(q) == 5 and q
    assert [r.name for r in q] == ["a1", "a2", "b1", "b2", "emb"]  # lighter group first, embeds last
    assert q.peek_request() is a1 and q.pop_request() is a1
    q.prepend_request(a1)  # preempted: served first again
    assert [r.name for r in q] == ["a1", "a2", "b1", "b2", "emb"]
    # vLLM pops requests it skips this step, collects them with appendleft and puts them back with
    # prepend_requests: they must come back in their original order, in front.
    skipped = deque()
    for _ in range(3):
        skipped.appendleft(q.pop_request())
    q.prepend_requests(skipped)
    assert [r.name for r in q] == ["a1", "a2", "b1", "b2", "emb"]
    q.remove_requests([b2, a2])
    q.remove_request(emb)
    assert [r.name for r in q] == ["a1", "b1"]
    # New arrivals are regrouped with the requests still waiting (not with those put back in front).
    from prefixattn.integrations.vllm.scheduler import group_order

    q2 = PrefixGroupRequestQueue(min_shared_tokens=16)
    b3 = Req("b3", [5] * 80 + [4])
    q2.add_request(b1)
    q2.add_request(a1)
    first = q2.pop_request()
    q2.add_request(a2)
    q2.add_request(b3)
    waiting = [r for r in (b1, a1) if r is not first] + [a2, b3]
    want = [waiting[i].name for i in group_order([w.prompt_token_ids for w in waiting], min_shared_tokens=16)]
    got = [r.name for r in q2]
    assert got == want and abs(got.index("b1") - got.index("b3")) == 1
    while q:
        q.pop_request()
    with pytest.raises(IndexError):
        q.peek_request()


def test_priority_stays_the_primary_key():
    from prefixattn.integrations.vllm.scheduler import PrefixGroupRequestQueue

    class Req:
        def __init__(self, name, ids, priority):
            self.name, self.prompt_token_ids, self.priority = name, ids, priority

    q = PrefixGroupRequestQueue(min_shared_tokens=16, by_priority=True)
    for r in (Req("a1", [1] * 40 + [2], 1), Req("b1", [5] * 80 + [2], 0), Req("a2", [1] * 40 + [3], 1),
              Req("b2", [5] * 80 + [3], 0)):
        q.add_request(r)
    assert [r.name for r in q] == ["b1", "b2", "a1", "a2"]


def test_one_name_builds_the_variant_matching_async_mode(model_config):
    from prefixattn.integrations.vllm.scheduler import PrefixGroupScheduler, PrefixGroupSyncScheduler

    sched = make_scheduler(model_config, PrefixGroupSyncScheduler, num_blocks=64)
    built = PrefixGroupScheduler(vllm_config=sched.vllm_config, kv_cache_config=sched.kv_cache_config,
                                 structured_output_manager=sched.structured_output_manager, block_size=BLOCK)
    assert type(built) is PrefixGroupSyncScheduler
    assert type(make_scheduler(model_config, PrefixGroupScheduler, num_blocks=64)) is PrefixGroupScheduler


def test_mismatched_async_mode_is_refused(model_config):
    from prefixattn.integrations.vllm.scheduler import PrefixGroupScheduler

    with pytest.raises(ValueError, match="PrefixGroupSyncScheduler"):
        sched = make_scheduler(model_config, PrefixGroupScheduler, num_blocks=64)
        sched.vllm_config.scheduler_config.async_scheduling = False
        from prefixattn.integrations.vllm.scheduler import _install_queue

        sched.waiting = type(sched.waiting)()
        _install_queue(sched)


def test_bad_options_are_refused():
    from types import SimpleNamespace

    from prefixattn.integrations.vllm.scheduler import scheduling_options

    with pytest.raises(ValueError, match=r"\['ordering'\]: expected one of"):
        scheduling_options(SimpleNamespace(additional_config={"prefixattn": {"ordering": "random"}}))
    with pytest.raises(ValueError, match=r"\['levels'\]: expected a positive int, got 0"):
        scheduling_options(SimpleNamespace(additional_config={"prefixattn": {"levels": 0}}))
    assert scheduling_options(None) == dict(ordering="batchllm", levels=1, memory_admission=False, kv_threshold=0.95,
                                            reservation_clip=None, admission_projection="ends")


def test_memory_bound_engine_kwargs_are_accepted_by_vllm(tiny_llama):
    from vllm.engine.arg_utils import EngineArgs

    from prefixattn.integrations.vllm.scheduler import (MEMORY_BOUND_MAX_NUM_SEQS, PrefixGroupScheduler,
                                                        memory_bound_engine_kwargs)

    cfg = EngineArgs(model=tiny_llama, skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=1 << 24,
                     **memory_bound_engine_kwargs()).create_engine_config()
    # PREFIXATTN is an alias of vLLM's CUSTOM member (pickle-safe), resolving to prefixattn's backend.
    assert cfg.attention_config.backend.get_class().get_name() == "PREFIXATTN"
    assert cfg.cache_config.enable_prefix_caching
    assert cfg.scheduler_config.max_num_seqs == MEMORY_BOUND_MAX_NUM_SEQS
    assert cfg.scheduler_config.get_scheduler_cls() is PrefixGroupScheduler
