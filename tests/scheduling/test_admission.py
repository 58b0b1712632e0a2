"""The admission rule (BatchLLM Algorithm 2) shared by TokenBatcher, the simulator and the vLLM scheduler: its
reservation, its two projections, its pass bookkeeping, and TokenBatcher applying it with either projection (the
vLLM side: tests/vllm/test_scheduler_admission.py)."""

import numpy as np
import pytest

from prefixattn.scheduling import TokenBatcher, group_prompts
from prefixattn.scheduling.admission import PROJECTIONS, AdmissionRule, ends_blocks, peak_blocks


def test_reservation_is_the_estimate_at_most_the_limit_rounded_up_and_clipped():
    rule = AdmissionRule(capacity=100, block_size=4, clip=30)
    assert rule.reservation(10.2) == (11, 11)
    assert rule.reservation(50.0) == (50, 30)
    assert rule.reservation(50.0, limit=20) == (20, 20)
    assert AdmissionRule(capacity=100, block_size=4).reservation(50.0) == (50, 50)


def test_projections_on_a_hand_case():
    # 8 tokens growing 32 more (10 blocks at its end) and 4 tokens growing 4 more: the second ends long before the
    # first peaks, so the peak (10 blocks: the first alone at its end) is below the ends sum (12)
    now, more = np.array([8, 4]), np.array([32, 4])
    assert ends_blocks(now, more, 4) == 12
    assert peak_blocks(now, more, 4) == 10
    assert peak_blocks(np.zeros(0, np.int64), np.zeros(0, np.int64), 4) == 0
    with pytest.raises(ValueError, match="projection: expected one of"):
        AdmissionRule(capacity=10, block_size=4, projection="mean")


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_a_pass_counts_started_requests_as_a_fresh_projection_would(projection):
    rng = np.random.default_rng(0)
    rule = AdmissionRule(capacity=60, block_size=4, projection=projection)
    now, more = rng.integers(1, 40, 12), rng.integers(0, 30, 12)
    adm = rule.start(now[:5], more[:5], shared_blocks=3)
    for k in range(5, 12):
        # a candidate is tested as part of the started set, then counted when it starts
        assert adm.projected(now[k], more[k]) == rule.projected(now[:k + 1], more[:k + 1]) + 3
        adm.add(int(now[k]), int(more[k]))
    adm.add(shared=2)
    assert adm.projected() == rule.projected(now, more) + 5
    assert adm.fits(anything_started=False)  # the first request always starts
    assert adm.fits(shared=rule.capacity - adm.projected(), anything_started=True)
    assert not adm.fits(shared=rule.capacity - adm.projected() + 1, anything_started=True)


@pytest.mark.parametrize("projection, starts_both", [("ends", False), ("peak", True)])
def test_token_batcher_admits_by_its_projection(projection, starts_both):
    """Request 0 (8 prompt tokens, 32 reserved) fills 10 blocks at its end; request 1 (4 + 4) ends long before that:
    ``ends`` refuses it next to request 0 (12 > 10 blocks), ``peak`` admits it (its peak is 10)."""
    b = TokenBatcher(token_budget=16, kv_blocks=10, block_size=4, output_lens=[32, 4], projection=projection)
    b.add_groups(group_prompts([list(range(1, 9)), list(range(20, 24))]))
    first = b.step()
    assert sorted(set(first.request_ids.tolist())) == ([0, 1] if starts_both else [0])
    if not starts_both:
        assert b.admits(1) is False
        with pytest.raises(ValueError, match="request_id: expected a waiting request"):
            b.admits(0)


def test_token_batcher_refuses_an_unknown_projection():
    with pytest.raises(ValueError, match="projection: expected one of"):
        TokenBatcher(token_budget=16, kv_blocks=10, block_size=4, projection="mean")


@pytest.mark.parametrize("max_output_len, starts_both", [(None, False), (20, True)])
def test_token_batcher_reserves_at_most_the_hard_output_cap(max_output_len, starts_both):
    """Request 0 estimates 100 output tokens; capped at 20 it reserves 8 + 20 tokens (7 blocks), leaving room for
    request 1 (2 blocks) in 10, as vLLM reserves at most ``max_tokens``."""
    b = TokenBatcher(token_budget=16, kv_blocks=10, block_size=4, output_lens=[100, 4], max_output_len=max_output_len)
    b.add_groups(group_prompts([list(range(1, 9)), list(range(20, 24))]))
    assert sorted(set(b.step().request_ids.tolist())) == ([0, 1] if starts_both else [0])
