"""Compiled (numba) staging of the block table, for :mod:`prefixattn.planner.device_tables`: the used columns of a
checked table into a workspace's int32 host table (:func:`stage_table`) or after the work list's tables in the free
plan()'s one staging buffer (:func:`table_into_flat`), in the layout
:func:`~prefixattn.planner.device_tables.metadata_to_device` reads.

Imported only when numba is (:mod:`prefixattn.planner.compiled`); every function is ``@njit(cache=True)``.
"""

from __future__ import annotations

from numba import njit

_INT32_MAX = 2 ** 31 - 1


@njit(cache=True, nogil=True)
def table_fits(table, cols):
    """Every entry of ``table[:, :cols]`` fits int32 (int32 tables: no scan)."""
    if table.itemsize == 4 or cols == 0:
        return True
    for r in range(table.shape[0]):
        row = table[r, :cols]
        hi = row[0]
        for k in range(row.shape[0]):
            hi = max(hi, row[k])
        if hi > _INT32_MAX:
            return False
    return True


@njit(cache=True, nogil=True)
def stage_table(stage, table, n, width, max_id):
    """Copy the first ``width`` columns of the ``n`` rows of a checked ``table`` into int32 ``stage`` (columns the
    table lacks: 0), when they fit it and the ids the kernel reads fit int32 (cells past a request's blocks are never
    read: wrapped); False, with nothing written, otherwise (the caller stages or refuses). Here rather than in
    numpy: no int64 temporary and no Python slicing, ~4 us less a step for 256 x 148 ids on the 2-core host."""
    if n > stage.shape[0] or width > stage.shape[1] or max_id > _INT32_MAX:
        return False
    cols = min(width, table.shape[1])
    for r in range(n):
        for c in range(cols):
            stage[r, c] = table[r, c]
        for c in range(cols, width):
            stage[r, c] = 0
    return True


@njit(cache=True, nogil=True)
def table_into_flat(flat, table, width):
    """The first ``width`` columns of ``table``'s rows (columns it lacks: 0) into the last ``rows * width`` entries
    of int32 ``flat``, when every id there fits int32 (int32 tables always do): whether they did."""
    rows = table.shape[0]
    cols = min(width, table.shape[1])
    if not table_fits(table, cols):
        return False
    base = flat.shape[0] - rows * width
    for r in range(rows):
        dst = flat[base + r * width:base + (r + 1) * width]
        src = table[r, :cols]
        for k in range(cols):
            dst[k] = src[k]
        for k in range(cols, width):
            dst[k] = 0
    return True
