"""What the report renderers share: the results CSV's rows, the row index, number and ratio cells, table heads.

Every renderer of this package reads rows of the bench CSV schema (bench/conftest.py: ``benchmark, provider, shape,
device, metric, value, unit, commit, versions``, values as text) and writes markdown tables; the cells come from
here, so one number reads the same wherever it is shown.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path


def read_rows(path) -> list[dict]:
    """The rows of a results CSV, as :class:`csv.DictReader` gives them (every value a string)."""
    with Path(path).open() as f:
        return list(csv.DictReader(f))


def index(rows) -> dict:
    """``{benchmark: {shape: {provider: {metric: float}}}}``, shapes and providers in first-seen order.

    A row whose value is not a number is left out. The levels are defaultdicts: index with ``.get`` where a missing
    key must not be created.
    """
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in rows:
        try:
            out[r["benchmark"]][r["shape"]][r["provider"]][r["metric"]] = float(r["value"])
        except ValueError:
            continue
    return out


def pivot(rows, benchmark: str, metric: str) -> tuple[dict, list]:
    """One benchmark's metric as ``{shape: {provider: value}}``, and its providers in first-seen order."""
    table: dict = defaultdict(dict)
    providers: list = []
    for r in rows:
        if r["benchmark"] == benchmark and r["metric"] == metric:
            table[r["shape"]][r["provider"]] = float(r["value"])
            if r["provider"] not in providers:
                providers.append(r["provider"])
    return table, providers


def fixed(v, digits: int = 1) -> str:
    """``v`` with ``digits`` decimals and thousands separators (none from 100,000 up); ``-`` for None."""
    if v is None:
        return "-"
    return f"{v:,.{digits}f}" if abs(v) < 1e5 else f"{v:,.0f}"


def us(v) -> str:
    """A time as the performance page shows it: one decimal below 10,000, whole with separators from there; ``-``
    for None."""
    return "-" if v is None else (f"{v:.1f}" if v < 1e4 else f"{v:,.0f}")


def short(v: float) -> str:
    """A whole number with thousands separators, anything else to 3 significant digits."""
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):,}"
    return f"{v:.3g}"


def ratio_cell(a, b) -> str:
    """``a / b`` as a table cell (``-`` where either is missing or ``b`` is 0)."""
    return "-" if a is None or b is None or not b else f"{a / b:.2f}x"


def head(*cells: str, right: int = 0) -> list[str]:
    """A markdown table's head: the header row and its rule, the last ``right`` columns right-aligned."""
    return ["| " + " | ".join(cells) + " |", "|" + "---|" * (len(cells) - right) + "---:|" * right]
