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
    from integrations.vllm.scheduler import PrefixGroupSyncScheduler

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
    from integrations.vllm.scheduler import scheduling_options

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

    from integrations.vllm.scheduler import OUTPUT_LEN_KEY, PrefixGroupSyncScheduler, group_order

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
