"""Memory-centric admission (BatchLLM Algorithm 2) in PrefixGroupScheduler, driven step by step inside vLLM's real
scheduler (as test_scheduler.py drives it): with exact output lengths reserved, a KV cache too small for the batch
never preempts, every request still finishes with nothing leaked, and admission keeps the group order."""

import random

import pytest

from tests.vllm.test_scheduler import BLOCK, VOCAB, drive, expected_order, make_requests, make_scheduler

pytestmark = pytest.mark.vllm


def offline_batch(seed=0, groups=10, members=4):
    """``groups`` prefix groups (prefixes of 64-160 tokens) of ``members`` requests each, interleaved."""
    r = random.Random(seed)
    prefixes = [[r.randrange(VOCAB) for _ in range(r.randrange(64, 160))] for _ in range(groups)]
    return [prefixes[i % groups] + [r.randrange(VOCAB) for _ in range(r.randrange(5, 40))]
            for i in range(groups * members)]


@pytest.fixture(scope="module")
def model_config(tiny_llama):
    from vllm.config import ModelConfig

    return ModelConfig(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=512)


@pytest.mark.parametrize("memory, projection", [(False, "ends"), (True, "ends"), (True, "peak")])
def test_memory_admission_avoids_preemption(model_config, memory, projection):
    from prefixattn.integrations.vllm.scheduler import PrefixGroupSyncScheduler

    prompts = offline_batch()
    max_tokens = 96
    sched = make_scheduler(model_config, PrefixGroupSyncScheduler, num_blocks=40, max_num_batched_tokens=256,
                           max_num_seqs=256, options={"memory_admission": memory, "kv_threshold": 1.0,
                                                      "admission_projection": projection})
    admitted, resumed = drive(sched, make_requests(prompts, max_tokens=max_tokens), max_tokens)
    assert sorted(admitted) == sorted(str(i) for i in range(len(prompts)))
    assert admitted[:len(set(admitted))] == [a for a in expected_order(prompts) if a in admitted][:len(set(admitted))]
    if memory:
        assert resumed == 0  # every reservation was exact: no request outgrew its share
        assert sched.waiting.admission.refused > 0  # the gate did hold requests back
    print(f"\nmemory_admission={memory} ({projection}): resumed after preemption {resumed}")


def test_bad_admission_options_are_refused():
    from prefixattn.integrations.vllm.scheduler import scheduling_options

    class Cfg:
        def __init__(self, **own):
            self.additional_config = {"prefixattn": own}

    assert scheduling_options(Cfg(memory_admission=True))["kv_threshold"] == 0.95
    for bad in (dict(memory_admission="yes"), dict(kv_threshold=0), dict(kv_threshold=1.5),
                dict(reservation_clip=0), dict(admission_projection="mean")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            scheduling_options(Cfg(**bad))


def test_max_tokens_and_estimates_weigh_the_group_order(model_config):
    """BatchLLM Eq. 3 sees each group's decode: groups asking for long outputs (per max_tokens, or an extra_args
    estimate standing for its whole group) come first, and the queue hands requests out in exactly that order."""
    import math

    from prefixattn.integrations.vllm.scheduler import OUTPUT_LEN_KEY, PrefixGroupSyncScheduler, group_order

    prompts = offline_batch(seed=3, groups=6, members=3)
    limits = [float(8 + 40 * (i % 6)) for i in range(len(prompts))]  # group g asks for 8 + 40 g tokens
    requests = make_requests(prompts, max_tokens=1)
    for r, limit in zip(requests, limits):
        r.sampling_params.max_tokens = r.max_tokens = int(limit)
    # one request of group 5 (the longest limit) carries a measured estimate of 1 token: it stands for its group
    requests[5].sampling_params.extra_args = {OUTPUT_LEN_KEY: 1}
    known = [1.0 if i == 5 else math.nan for i in range(len(prompts))]
    sched = make_scheduler(model_config, PrefixGroupSyncScheduler, num_blocks=400)
    for r in requests:
        sched.add_request(r)
    queued = [r.request_id for r in sched.waiting]
    expected = [str(i) for i in group_order(prompts, min_shared_tokens=BLOCK, known=known, limits=limits)]
    assert queued == expected
    assert expected != [str(i) for i in group_order(prompts, min_shared_tokens=BLOCK)]
    plain = [str(i) for i in group_order(prompts, min_shared_tokens=BLOCK, limits=limits)]
    group5 = {str(i) for i in range(5, len(prompts), 6)}
    assert plain[0] in group5 and expected[0] not in group5  # without the estimate group 5 goes first, with it not


class _SchedulerView:
    """What :class:`MemoryAdmission` reads of vLLM's scheduler: block size, pool size, the running requests."""

    def __init__(self, block_size, num_blocks):
        from types import SimpleNamespace

        self.block_size = block_size
        self.kv_cache_config = SimpleNamespace(num_blocks=num_blocks)
        self.running = []


def aligned_batch(seed, groups=6, members=3, singletons=4):
    """Prefix groups whose prefixes are whole blocks (1-4 of them) and singletons: on such prompts vLLM's block
    accounting (a group's full prefix blocks once, the rest per request) and TokenBatcher's (a level of
    ``ceil(prefix / block)`` blocks, the rest per request) count the same blocks."""
    r = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [r.randrange(VOCAB) for _ in range(BLOCK * r.randrange(1, 5))]
        firsts = r.sample(range(VOCAB), members)  # distinct first suffix tokens: the group's LCP is the prefix
        prompts += [prefix + [f] + [r.randrange(VOCAB) for _ in range(r.randrange(4, 40))] for f in firsts]
    prompts += [[r.randrange(VOCAB) for _ in range(r.randrange(20, 90))] for _ in range(singletons)]
    return prompts


@pytest.mark.parametrize("projection", ["ends", "peak"])
@pytest.mark.parametrize("clip", [None, 24])
def test_scheduler_and_token_batcher_admit_alike(projection, clip):
    """The vLLM scheduler's memory admission and TokenBatcher share one admission rule: driven through a batch by
    TokenBatcher, at every step boundary the running set is mirrored into vLLM requests, and for every waiting
    request ``MemoryAdmission.admits`` (the scheduler's caller) and ``TokenBatcher.admits`` (the batcher's) agree.

    Compared only where the two memory models describe the same thing: no started prefix level without a started
    member (vLLM's idle or still-computing prefix is cache, not held by a running request), and no preemption (a
    preempted TokenBatcher request recomputes one token less than vLLM's); both are checked and counted."""
    from prefixattn.scheduling import TokenBatcher, group_prompts, order_groups
    from prefixattn.integrations.vllm.scheduler import MemoryAdmission

    compared = {True: 0, False: 0}
    for seed in range(4):
        prompts = aligned_batch(seed)
        outs = [random.Random(seed * 100 + i).randrange(4, 80) for i in range(len(prompts))]
        kv_blocks = 24
        groups = order_groups(group_prompts(prompts, levels=1, min_shared_tokens=BLOCK), "batchllm")
        batcher = TokenBatcher(token_budget=96, kv_blocks=kv_blocks, block_size=BLOCK, output_lens=outs,
                               reservation_clip=clip, projection=projection)
        batcher.add_groups(groups)
        view = _SchedulerView(BLOCK, kv_blocks + 1)  # vLLM's pool keeps one null block
        vllm_admission = MemoryAdmission(view, kv_threshold=1.0, reservation_clip=clip, projection=projection)
        group_of = {i: k for k, g in enumerate(groups) if g.num_requests > 1 for i in g.request_ids}
        vllm_admission.group_of = {str(i): (group_of[i], groups[group_of[i]].prefix_len) for i in group_of}
        requests = make_requests(prompts, max_tokens=1)
        for r, out in zip(requests, outs):
            r.sampling_params.max_tokens = r.max_tokens = out
        computed, generated, level_group = {}, {}, {}
        while not batcher.done:
            step = batcher.step()
            if step.preempted:
                break
            for kind, rid, node, start, n in zip(step.kinds.tolist(), step.request_ids.tolist(), step.nodes.tolist(),
                                                  step.starts.tolist(), step.num_tokens.tolist()):
                if kind == 2:  # PREFIX: computed for the group by a level
                    level_group[node] = group_of[rid]
                else:
                    computed[rid] = start + n
            for v in step.freed_nodes:
                level_group.pop(v)
            for rid in set(step.request_ids.tolist()):
                if batcher.request_state(rid) == "decode":
                    generated[rid] = generated.get(rid, 0) + 1
                    if generated[rid] >= outs[rid]:
                        batcher.finish(rid)
                        del computed[rid]
            started = [i for i in computed if batcher.request_state(i) in ("prefill", "decode")]
            if set(level_group.values()) - {group_of.get(i) for i in started}:
                continue  # a started level without a started member: not a vLLM running set
            view.running = []
            for i in started:
                r = requests[i]
                r.num_computed_tokens = computed[i]
                r.append_output_token_ids([7] * (generated.get(i, 0) - r.num_output_tokens))
                view.running.append(r)
            for i in range(len(prompts)):
                if batcher.request_state(i) == "waiting":
                    decision = batcher.admits(i)
                    assert vllm_admission.admits(requests[i]) == decision, (seed, i, projection)
                    compared[decision] += 1
    print(f"\n{projection} clip={clip}: same decisions on {compared[True]} admits and {compared[False]} refusals")
    assert compared[True] >= 20 and compared[False] >= 20  # both outcomes exercised
