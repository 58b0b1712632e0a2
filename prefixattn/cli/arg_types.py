"""Argument types shared by the ``prefixattn`` subcommands: each refuses a bad value while the command line is parsed.

argparse then exits with code 2 and ``argument --NAME: expected X, got Y``, before any work starts.
"""

from __future__ import annotations

import argparse
import math
import os


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (``--num-requests -2`` must not slice, ``0`` must not mean "all")."""
    return _int_at_least(text, 1, "a positive int")


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int_at_least(text, 0, "a non-negative int")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def int_list(allowed=None, *, positive: bool = False):
    """argparse type factory: comma-separated ints, each in ``allowed`` (when given) or >= 1 (``positive``)."""
    def parse(text: str) -> list[int]:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        what = "comma-separated positive ints" if positive else "comma-separated ints"
        try:
            values = [int(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}") from None
        if not values or (positive and min(values) < 1):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        if allowed is not None and not set(values) <= set(allowed):
            bad = [v for v in values if v not in allowed]
            raise argparse.ArgumentTypeError(f"expected values in {tuple(allowed)}, got {bad[0]}")
        return values
    parse.__name__ = "int_list"
    return parse


def output_file(text: str) -> str:
    """argparse type: a file path whose folder exists (checked before the run, not after it)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"expected a file in an existing folder, got {text!r} (no folder {folder})")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file in an existing folder, got {text!r} (a folder)")
    return text
