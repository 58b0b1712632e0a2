"""Memory classes in the TokenBatcher (BlendServe's dual-scanner memory split), the class split itself, and output
sampling that covers small groups."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixattn.scheduling import ChunkKind, DensityModel, PrefixGroup, TokenBatcher, group_prompts, sample_requests
from prefixattn.scheduling.blendserve import densities, memory_classes
from prefixattn.scheduling.admission import projected_peak_blocks as _projected_peak_blocks


def _drive(batcher, groups, outputs: dict[int, int], max_steps=5000):
    """Run like an engine (each request ends after ``outputs[r]`` tokens); per step the started requests and the
    waiting ones."""
    batcher.add_groups(groups)
    produced: dict[int, int] = {}
    started_per_step = []
    for _ in range(max_steps):
        if batcher.done:
            return started_per_step
        plan = batcher.step()
        for r in plan.preempted:
            produced.pop(r, None)
        for kind, r in zip(plan.kinds.tolist(), plan.request_ids.tolist()):
            if kind == ChunkKind.DECODE:
                produced[r] = produced.get(r, 1) + 1
        for r in list(outputs):
            if batcher.request_state(r) == "decode":
                produced.setdefault(r, 1)
                if produced[r] >= outputs[r]:
                    batcher.finish(r)
                    del produced[r]
        started_per_step.append(({r for r in outputs if batcher.request_state(r) in ("prefill", "decode")},
                                 {r for r in outputs if batcher.request_state(r) == "waiting"}))
    raise AssertionError("not done")


def _long_and_short(num_long=4, num_short=40, long_out=60, short_out=4):
    """Long-output requests (ids 0..num_long-1, class 1) then short ones (class 0), one prompt block each."""
    groups = [PrefixGroup(0, [i], [4]) for i in range(num_long + num_short)]
    outputs = {i: long_out if i < num_long else short_out for i in range(num_long + num_short)}
    classes = np.array([1 if i < num_long else 0 for i in range(num_long + num_short)])
    return groups, outputs, classes


def test_long_output_class_is_held_to_its_share_while_short_requests_wait():
    groups, outputs, classes = _long_and_short()
    est = np.array([outputs[i] for i in range(len(outputs))], dtype=float)
    kv = 80  # blocks of 4 tokens: one long request alone peaks at 16 blocks
    b = TokenBatcher(token_budget=64, kv_blocks=kv, block_size=4, output_lens=est, memory_classes=classes,
                     class_shares=[0.6, 0.4])
    per_step = _drive(b, groups, outputs)
    assert b.stats["finished"] == len(outputs) and b.stats["preemptions"] == 0
    shorts = set(range(4, len(outputs)))
    held = [started & {0, 1, 2, 3} for started, waiting in per_step if waiting & shorts]
    # 0.4 x 80 = 32 blocks: two long requests (16 blocks at their end each), never more while short ones wait
    assert held and max(len(x) for x in held) == 2
    # once no short request waits, the share no longer applies: the other long requests start
    assert max(len(started & {0, 1, 2, 3}) for started, _ in per_step) > 2
    # short requests start in the very first step beside the long ones
    assert per_step[0][0] & {0, 1} and per_step[0][0] & shorts


def test_a_class_at_zero_share_still_runs_one_request():
    groups, outputs, classes = _long_and_short(num_long=3, num_short=10)
    b = TokenBatcher(token_budget=64, kv_blocks=60, block_size=4, output_lens=60.0, memory_classes=classes,
                     class_shares=[1.0, 0.0])
    per_step = _drive(b, groups, outputs)
    assert per_step[0][0] & {0, 1, 2}  # the first long request starts at once: nothing starves
    assert max(len(started & {0, 1, 2}) for started, _ in per_step[:5]) == 1
    assert b.stats["finished"] == len(outputs)


def test_classes_keep_their_own_admission_order():
    groups = [PrefixGroup(0, [i], [4]) for i in range(12)]
    classes = np.array([1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    b = TokenBatcher(token_budget=8, kv_blocks=100, block_size=4, output_lens=50.0, memory_classes=classes,
                     class_shares=[0.8, 0.2])
    b.add_groups(groups)
    first = b.step().request_ids.tolist()
    # request 0 starts (first of its class); 1 and 2 would exceed 20 blocks; class 0 goes on in its order
    assert first == [0, 3]



def test_clipped_reservation_projects_a_rolling_horizon():
    """A long output past its clipped reservation still counts as growing (for up to ``clip`` more steps), not as
    about to end: the class does not start a second long request on the strength of the first's clipped estimate."""
    clip, long_out, num_short = 8, 60, 300
    # request 0: long, prompt 4; request 1: long, prompt 10; then short requests (class 0) that keep waiting
    groups = [PrefixGroup(0, [0], [4]), PrefixGroup(0, [1], [10])] + \
        [PrefixGroup(0, [i], [4]) for i in range(2, 2 + num_short)]
    outputs = {0: long_out, 1: long_out, **{i: 4 for i in range(2, 2 + num_short)}}
    est = np.array([outputs[i] for i in range(len(outputs))], dtype=float)
    classes = np.array([1, 1] + [0] * num_short)
    # class 1's share: 25 tokens (block size 1). Both long requests growing `clip` steps need 11 + 17 = 28 > 25:
    # request 1 waits at step 0. A projection that ends request 0 at its clipped estimate admits request 1 a step
    # later (5 + 5 + 10 + 5 = 25 tokens at the peak); the rolling horizon keeps request 0 growing and does not.
    b = TokenBatcher(token_budget=16, kv_blocks=250, block_size=1, output_lens=est, reservation_clip=clip,
                     memory_classes=classes, class_shares=[0.9, 0.1])
    per_step = _drive(b, groups, outputs)
    shorts = set(range(2, 2 + num_short))
    both = [i for i, (started, waiting) in enumerate(per_step) if {0, 1} <= started and waiting & shorts]
    assert 0 in per_step[0][0] and 1 not in per_step[0][0]
    assert len([1 for started, waiting in per_step if 0 in started and waiting & shorts]) > 2 * clip  # non-vacuous
    assert both == []
    assert b.stats["finished"] == len(outputs)


def test_reservation_clip_caps_reservations_only():
    """The clip limits what a request reserves (more requests start than full estimates allow), as the policy's
    reservations before it; requests whose estimate is within the clip are unaffected."""
    groups = [PrefixGroup(0, [i], [4]) for i in range(6)]
    full = TokenBatcher(token_budget=64, kv_blocks=40, block_size=4, output_lens=60.0)
    clipped = TokenBatcher(token_budget=64, kv_blocks=40, block_size=4, output_lens=60.0, reservation_clip=8)
    for b in (full, clipped):
        b.add_groups(groups)
    # full: 4 + 60 tokens = 16 blocks each, two fit in 40; clipped: 4 + 8 = 3 blocks each, all six
    assert len(full.step().request_ids) == 2
    assert len(clipped.step().request_ids) == 6
    with pytest.raises(ValueError, match=r"reservation_clip: expected an int in \[1, "):
        TokenBatcher(token_budget=8, kv_blocks=8, reservation_clip=0)

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 40)), min_size=1, max_size=12),
       st.sampled_from([1, 4, 16]))
def test_projected_peak_matches_brute_force(reqs, block_size):
    cur = np.array([c for c, _ in reqs], dtype=np.int64)
    rem = np.array([r for _, r in reqs], dtype=np.int64)
    brute = max(sum(math.ceil((c + t) / block_size) for c, r in reqs if t < r) for t in range(int(rem.max())))
    got = _projected_peak_blocks(cur, rem, block_size)
    # the ceil per request is bounded from above by (tokens + block_size - 1) // block_size per request
    assert brute <= got <= brute + len(reqs)
    if block_size == 1:
        assert got == brute


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(memory_classes=[0, 1]), r"memory_classes: expected memory_classes and class_shares together",
                 id="classes-without-shares"),
    pytest.param(dict(class_shares=[1.0]), r"memory_classes: expected memory_classes and class_shares together",
                 id="shares-without-classes"),
    pytest.param(dict(memory_classes=[0, 2], class_shares=[0.5, 0.5]), r"memory_classes: expected classes in \[0, 2\)",
                 id="class-beyond-shares"),
    pytest.param(dict(memory_classes=[0, 1], class_shares=[0.5, 1.5]),
                 r"class_shares: expected a 1-D sequence of fractions", id="share-above-one"),
    pytest.param(dict(memory_classes=[0.5, 1], class_shares=[0.5, 0.5]), r"memory_classes: expected a 1-D array of int",
                 id="float-classes"),
])
def test_bad_classes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenBatcher(token_budget=8, kv_blocks=8, **kwargs)


def test_memory_classes_is_the_dual_scanner_partition():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, int(rng.integers(100, 900))).tolist() for _ in range(60)]
    out = np.where(np.arange(60) < 6, 16384.0, 250.0)
    groups = group_prompts(prompts)
    cm = DensityModel()
    classes, shares = memory_classes(groups, out, cm)
    assert classes.tolist() == [1] * 6 + [0] * 54
    assert shares.sum() == pytest.approx(1.0) and 0 < shares[1] < 1
    # M_L rho_L + M_R rho_R = M rho_root with each class's aggregate density
    p = np.array([len(x) for x in prompts], dtype=float)
    comp, mem = cm.comp_time(p + out, p ** 2), cm.mem_time(p, out)
    rho = [comp[classes == c].sum() / mem[classes == c].sum() for c in (0, 1)]
    assert shares[0] * rho[0] + shares[1] * rho[1] == pytest.approx(comp.sum() / mem.sum())
    # nothing memory-intensive: one class, the whole memory
    classes, shares = memory_classes(groups, np.full(60, 100.0), cm)
    assert classes.sum() == 0 and shares.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"threshold: expected a density > 0"):
        memory_classes(groups, out, threshold=0)
    assert densities(groups, out, cm)[0].shape == (len(groups),)


def test_sampling_covers_small_groups_within_twice_the_rate():
    rng = np.random.default_rng(1)
    big = [[1, 2, 3] + rng.integers(10, 10_000, 5).tolist() for _ in range(3000)]
    small = [[[7, 7, k] + rng.integers(10, 10_000, 5).tolist() for _ in range(20)] for k in range(8)]
    groups = group_prompts(big + [p for grp in small for p in grp])
    n = 3000 + 160
    for seed in range(5):
        plain = sample_requests(groups, rate=0.01, seed=seed, cover_groups=False)
        ids = sample_requests(groups, rate=0.01, seed=seed)
        assert set(plain.tolist()) <= set(ids.tolist())  # the same draw, plus the cover
        assert len(ids) - len(plain) <= math.ceil(0.01 * n)
        for k in range(8):  # every small group holds a sample
            members = set(range(3000 + 20 * k, 3000 + 20 * (k + 1)))
            assert members & set(ids.tolist())
    # the cover is bounded: 300 groups of 2 at rate 1% get at most ceil(0.01 * 600) = 6 extra samples
    pairs = group_prompts([[k, k, k, j] for k in range(300) for j in range(2)])
    plain = sample_requests(pairs, rate=0.01, seed=0, cover_groups=False)
    assert len(sample_requests(pairs, rate=0.01, seed=0)) - len(plain) == 6
