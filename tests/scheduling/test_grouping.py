"""group_prompts (BatchLLM Algorithm 1 and nested levels), saving_ratio and optimal_saving_ratio."""

import numpy as np
import pytest

from prefixattn.scheduling import PrefixGroup, group_prompts, optimal_saving_ratio, saving_ratio
from tests.scheduling.synthetic import case1_like, nested_random


def _tok(start, n):
    return list(range(start, start + n))


def _summary(groups):
    return sorted((g.prefix_len, sorted(g.request_ids)) for g in groups)


def _check_partition(groups, n):
    ids = [r for g in groups for r in g.request_ids]
    assert sorted(ids) == list(range(n))
    for top in groups:
        for g, _ in top.walk():
            assert len(g.prompt_lens) == len(g.request_ids)
            nested = [r for c in g.children for r in c.request_ids]
            assert len(nested) == len(set(nested)) and set(nested) <= set(g.request_ids)
            assert all(c.parent_prefix_len == g.prefix_len for c in g.children)


def test_fork_when_gain_beats_penalty():
    # S (2 tokens) shared by 4; D1, D2 (8 tokens) shared by 2 each: gain (2-1)*8 = 8 > penalty 2 -> fork both,
    # S is left empty and disappears.
    s, d1, d2 = _tok(100, 2), _tok(200, 8), _tok(300, 8)
    prompts = [s + d1 + [1, 2], s + d1 + [3, 4], s + d2 + [5, 6], s + d2 + [7, 8]]
    groups = group_prompts(prompts)
    assert _summary(groups) == [(10, [0, 1]), (10, [2, 3])]
    _check_partition(groups, 4)


def test_no_fork_when_penalty_wins():
    # S (10 tokens) shared by 4; D1, D2 (3 tokens) by 2 each: gain 3 < penalty 10 -> one group with prefix S.
    s, d1, d2 = _tok(100, 10), _tok(200, 3), _tok(300, 3)
    prompts = [s + d1 + [1, 2], s + d1 + [3, 4], s + d2 + [5, 6], s + d2 + [7, 8]]
    assert _summary(group_prompts(prompts)) == [(10, [0, 1, 2, 3])]


def test_gain_equal_to_penalty_does_not_fork():
    # gain (3-1)*4 = 8 == penalty 8: the rule is strict (gain > penalty), so S stays the prefix.
    s, d = _tok(100, 8), _tok(200, 4)
    prompts = [s + d + [1, 9], s + d + [2, 9], s + d + [3, 9], s + [7, 7, 7, 7, 7]]
    assert _summary(group_prompts(prompts)) == [(8, [0, 1, 2, 3])]


def test_partial_fork_keeps_the_rest_and_merges_lone_child():
    # S (5) shared by 5 prompts: D1 (10 tokens, 2 prompts) forks (10 > 5); D2 (2 tokens, 2 prompts) does not
    # (2 < 5); prompt 4 is alone under S. S keeps D2's pair and prompt 4.
    s, d1, d2 = _tok(100, 5), _tok(200, 10), _tok(300, 2)
    prompts = [s + d1 + [1, 1], s + d1 + [2, 2], s + d2 + [3, 3], s + d2 + [4, 4], s + [9, 9, 9]]
    assert _summary(group_prompts(prompts)) == [(5, [2, 3, 4]), (15, [0, 1])]
    # Without prompt 4 and D2, S is left with one child after the fork: merged, nothing shares S alone.
    prompts = [s + d1 + [1, 1], s + d1 + [2, 2], s + [9, 9, 9]]
    assert _summary(group_prompts(prompts)) == [(0, [2]), (15, [0, 1])]


def test_bottom_up_enlarges_through_two_levels():
    # Root -> A (1 token, all 6) -> B (2 tokens, 4 prompts) -> C (21 tokens, 2 prompts). MaximizeReuse(A) first
    # forks C out of B (gain 21 > penalty 2), then at the root C's enlarged node forks out of A (gain 23 > 1); the
    # pairs left under B (sharing [8]) and under A (sharing [9]) fork too, and A is left empty.
    a, b, c = [1], [2, 2], _tok(500, 20)
    prompts = [a + b + c + [7, 1], a + b + c + [7, 2], a + b + [8, 1], a + b + [8, 2], a + [9, 9], a + [9, 8]]
    groups = group_prompts(prompts)
    assert _summary(groups) == [(2, [4, 5]), (4, [2, 3]), (24, [0, 1])]
    assert saving_ratio(prompts, groups) >= saving_ratio(prompts, group_prompts(prompts, min_shared_tokens=30))


def test_case1_saving_ratio_levels_1_and_unlimited():
    prompts = case1_like(700)
    optimal = optimal_saving_ratio(prompts)
    one = group_prompts(prompts, levels=1)
    _check_partition(one, len(prompts))
    assert all(not g.children for g in one)
    r1 = saving_ratio(prompts, one)
    assert 0.5 < optimal < 0.75  # the case-1 shape: most of each prompt is a shared document
    assert r1 >= 0.98 * optimal
    full = group_prompts(prompts, levels=None)
    _check_partition(full, len(prompts))
    assert saving_ratio(prompts, full) == pytest.approx(optimal, abs=1e-12)
    two = group_prompts(prompts, levels=2)  # system prompt, then documents
    assert saving_ratio(prompts, two) >= r1


def test_unlimited_levels_reach_optimal_on_deep_random_trees():
    rng = np.random.default_rng(7)
    for _ in range(40):
        prompts = nested_random(rng, int(rng.integers(1, 40)))
        full = group_prompts(prompts, levels=None)
        _check_partition(full, len(prompts))
        assert saving_ratio(prompts, full) == pytest.approx(optimal_saving_ratio(prompts), abs=1e-12)
        for levels in (1, 2, 3):
            groups = group_prompts(prompts, levels=levels)
            _check_partition(groups, len(prompts))
            assert max(lv for g in groups for _, lv in g.walk()) <= levels
            ratio = saving_ratio(prompts, groups)
            assert ratio <= optimal_saving_ratio(prompts) + 1e-12


def test_duplicates_and_length_one_prompts():
    prompts = [[4, 5, 6], [4, 5, 6], [4, 5, 6], [9], [9], [4, 5]]
    groups = group_prompts(prompts)
    # identical prompts share all but their last token; [4, 5] shares [4] only; length-1 prompts share nothing
    assert (2, [0, 1, 2]) in _summary(groups) or (1, [0, 1, 2, 5]) in _summary(groups)
    assert (0, [3]) in _summary(groups) and (0, [4]) in _summary(groups)
    _check_partition(groups, 6)
    assert saving_ratio(prompts, groups) <= optimal_saving_ratio(prompts)
    assert optimal_saving_ratio([[1], [1]]) == 0.0


def test_min_shared_tokens_dissolves_short_prefixes():
    s = _tok(100, 3)
    prompts = [s + [1, 1], s + [2, 2], _tok(50, 20) + [1], _tok(50, 20) + [2]]
    groups = group_prompts(prompts, min_shared_tokens=4)
    assert _summary(groups) == [(0, [0]), (0, [1]), (20, [2, 3])]


def test_nested_group_fields():
    s, d = _tok(100, 4), _tok(200, 6)
    prompts = [s + d + [1], s + d + [2], s + [7, 7], s + [8, 8]]
    (top,) = group_prompts(prompts, levels=None)
    assert top.prefix_len == 4 and top.parent_prefix_len == 0
    (child,) = top.children
    assert child.prefix_len == 10 and child.shared_tokens == 6 and child.parent_prefix_len == 4
    assert sorted(top.direct_request_ids) == [2, 3]
    assert top.processed_tokens == sum(len(p) for p in prompts) - 3 * 4 - 1 * 6
    assert top.members == top.request_ids


def test_output_is_deterministic_and_in_dfs_order():
    prompts = case1_like(200, seed=3)
    a, b = group_prompts(prompts), group_prompts(list(prompts))
    assert [(g.prefix_len, g.request_ids) for g in a] == [(g.prefix_len, g.request_ids) for g in b]
    ranks = [g.dfs_rank for g in a]
    assert ranks == sorted(ranks)


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(levels=0), r"levels: expected a positive int or None", id="levels-zero"),
    pytest.param(dict(levels=1.5), r"levels: expected a positive int or None", id="levels-float"),
    pytest.param(dict(min_shared_tokens=0), r"min_shared_tokens: expected a positive int", id="min-shared-tokens-zero"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_prompts([[1, 2], [1, 3]], **kwargs)


def test_bad_prompts():
    with pytest.raises(ValueError, match=r"prompts: expected at least one sequence"):
        group_prompts([])
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected at least 1 id"):
        group_prompts([[1], []])
    with pytest.raises(ValueError, match=r"prompts: expected at least one sequence"):
        optimal_saving_ratio([])


def test_saving_ratio_rejects_bad_groups():
    prompts = [[1, 2, 3], [1, 2, 4], [5, 6]]
    ok = group_prompts(prompts)
    assert saving_ratio(prompts, ok) == pytest.approx(2 / 8)
    cases = [
        ([PrefixGroup(2, [0, 1], [3, 3])], r"groups: expected every request in exactly one top-level group, got "
                                           r"request 2 in 0"),
        (ok + [PrefixGroup(0, [2], [2])], r"request 2 in 2"),
        ([PrefixGroup(2, [0, 2], [3, 2]), PrefixGroup(0, [1], [3])], r"groups\[0\]: expected prefix_len <= 1"),
        ([PrefixGroup(1, [0, 2], [3, 2]), PrefixGroup(0, [1], [3])], r"groups\[0\]: expected all requests to "
                                                                     r"share the first prefix_len=1 tokens"),
        ([PrefixGroup(2, [0, 7], [3, 3])], r"groups\[0\]: expected request ids in \[0, 3\), got 7"),
        ([PrefixGroup(1, [0, 1], [3, 3], children=[PrefixGroup(2, [0, 2], [3, 2], parent_prefix_len=1)]),
          PrefixGroup(0, [2], [2])], r"groups\[0\].children\[0\]: expected the requests of a nested group"),
        ("nope", r"groups: expected a list of PrefixGroup"),
    ]
    for groups, match in cases:
        with pytest.raises(ValueError, match=match):
            saving_ratio(prompts, groups)


@pytest.mark.parametrize("levels", [1, 2, None])
def test_untouched_subtree_slices_match_the_walk(monkeypatch, levels):
    # A group whose subtree Algorithm 1 left alone takes its requests as one slice of the sorted order; with every
    # node marked touched they come from walking the children lists. Both must give the same groups, fields and
    # order, on deep irregular trees (many forks) and on case-1 batches (few).
    from prefixattn.scheduling import grouping

    def fields(groups):
        return [[(g.prefix_len, g.parent_prefix_len, g.dfs_rank, g.request_ids, g.prompt_lens, lv)
                 for g, lv in top.walk()] for top in groups]

    rng = np.random.default_rng(3)
    batches = [nested_random(rng, 200, alphabet=2, max_len=20) for _ in range(5)] + [case1_like(300, seed=4)]
    for prompts in batches:
        fast = group_prompts(prompts, levels=levels)
        with monkeypatch.context() as m:
            m.setattr(grouping, "_untouched_subtrees", lambda tree, changed: [False] * tree.num_nodes)
            walked = group_prompts(prompts, levels=levels)
        assert fields(fast) == fields(walked)
