"""prefixattn.memo.typed_memo: the memo of plan()'s per-step checks never lets a bad argument through."""

import pytest
import torch

import prefixattn
from prefixattn.memo import typed_memo


def _checked_int():
    calls = []

    @typed_memo(maxsize=8)
    def check(value):
        calls.append(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"value: expected an int, got {value!r}")
        return value * 2

    return check, calls


def test_remembers_by_value_and_type():
    check, calls = _checked_int()
    assert check(16) == 32 and check(16) == 32
    assert calls == [16]  # the second call came from the memo
    with pytest.raises(ValueError, match="got 16.0"):
        check(16.0)  # equal to a remembered valid value, another type: checked again
    with pytest.raises(ValueError, match="got True"):
        check(True)  # True == 1 and hash(True) == hash(1)


def test_raising_calls_are_not_remembered_and_unhashable_arguments_reach_the_check():
    check, calls = _checked_int()
    for _ in range(2):
        with pytest.raises(ValueError, match="got 'x'"):
            check("x")
    assert calls == ["x", "x"]
    with pytest.raises(ValueError, match=r"got \[16\]"):
        check([16])  # unhashable: lru_cache's TypeError is not what the user sees


def test_plan_refuses_an_option_of_the_wrong_type_after_planning_with_the_right_one():
    args = (torch.tensor([0, 1]), torch.tensor([20]), torch.tensor([[0, 1]]))
    kw = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, q_dtype=torch.float32)
    prefixattn.plan(*args, block_size=16, **kw)
    with pytest.raises(ValueError, match="block_size: expected a positive int, got 16.0"):
        prefixattn.plan(*args, block_size=16.0, **kw)
    with pytest.raises(ValueError, match="sharing: expected one of"):
        prefixattn.plan(*args, block_size=16, sharing=["auto"], **kw)
