"""Argument checks shared by the scheduler's entry points ("name: expected X, got Y")."""

from __future__ import annotations

import numpy as np


def check_int(name: str, value, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]`` (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def check_positive_int(name: str, value) -> int:
    """``value`` as an int >= 1 (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)
