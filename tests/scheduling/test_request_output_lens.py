"""request_output_lens: the output lengths the engines' schedule policies hand to the orderings, from what the
requests carry (an estimate on some, a max_tokens limit on some)."""

import math

import numpy as np
import pytest

from prefixattn.scheduling import group_prompts, order_groups
from prefixattn.scheduling.output_lengths import request_output_lens

NAN = math.nan


def _groups():
    # group A: requests 0-2 (shared 40 tokens), group B: 3-4 (shared 40), request 5 alone
    a, b = list(range(100, 140)), list(range(200, 240))
    return group_prompts([a + [1], a + [2], a + [3], b + [4], b + [5], [7, 8, 9]])


def test_known_lengths_stand_for_their_group_and_limits_cap():
    lens = request_output_lens(_groups(), [10, NAN, NAN, NAN, 300, NAN], [64, 64, 5, 512, 512, math.inf])
    assert lens.tolist() == [10, 10, 5, 300, 300, 155]  # request 5: no group sample, the batch mean (10+300)/2


def test_limits_alone_are_the_lengths():
    lens = request_output_lens(_groups(), [NAN] * 6, [8, 8, 8, 256, 256, NAN])
    assert lens.tolist() == [8, 8, 8, 256, 256, (8 * 3 + 256 * 2) / 5]


def test_nothing_known_is_none():
    assert request_output_lens(_groups(), [NAN] * 6) is None
    assert request_output_lens(_groups(), [NAN] * 6, [math.inf] * 6) is None


def test_the_lengths_change_the_batchllm_order():
    groups = _groups()
    short_a = request_output_lens(groups, [NAN] * 6, [1, 1, 1, 500, 500, 1])
    first = order_groups(groups, "batchllm", output_lens=short_a)[0]
    assert first.request_ids == [3, 4]  # B's decode / prefill is the largest


@pytest.mark.parametrize("known, limits", [([NAN] * 5, None), ([NAN] * 6, [1] * 7), ([-1] + [NAN] * 5, None),
                                           ([math.inf] + [NAN] * 5, None), ([NAN] * 6, [-2] + [1] * 5)])
def test_bad_input_names_the_arguments(known, limits):
    with pytest.raises(ValueError, match="known, limits: expected"):
        request_output_lens(_groups(), known, limits)


def test_result_is_float64_per_request():
    lens = request_output_lens(_groups(), [NAN] * 6, [3] * 6)
    assert lens.dtype == np.float64 and lens.shape == (6,)
