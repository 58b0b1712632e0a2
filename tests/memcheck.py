"""Out-of-bounds checks for kernels in the Triton interpreter: a CPU stand-in for compute-sanitizer's memcheck.

The interpreter runs loads and stores on raw host addresses: an unmasked access past a tensor reads another
allocation's bytes or, for a store, corrupts the host heap (the process dies later, at some ``free``, far from the
kernel that wrote). :func:`install` makes every active lane of every load, store and atomic lie inside one of the
launch's tensor arguments, and raises :class:`OutOfBounds` naming the kernel, the access and the first stray address.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np


class OutOfBounds(RuntimeError):
    """A kernel in the interpreter touched memory outside every tensor argument of its launch."""


_STATE: dict = {"ranges": None, "kernel": None}


def _ranges_of(args) -> np.ndarray:
    """``(n, 2)`` int64 ``[start, end)`` byte ranges of the tensors' storages, sorted by start and merged."""
    spans = []

    def visit(arg):
        if isinstance(arg, (tuple, list)):
            for a in arg:
                visit(a)
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            if storage.nbytes():
                spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    visit(args)
    spans.sort()
    merged: list = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return np.array(merged, dtype=np.int64).reshape(-1, 2)


def _check(kind: str, ptrs, mask, itemsize: int) -> None:
    ranges = _STATE["ranges"]
    if ranges is None:  # a launch this module did not see start (nothing to check against)
        return
    addr = np.asarray(ptrs, dtype=np.uint64).astype(np.int64)
    active = np.broadcast_to(np.asarray(mask, dtype=bool), addr.shape) if mask is not None else \
        np.ones(addr.shape, dtype=bool)
    addr = addr[active]
    if addr.size == 0:
        return
    idx = np.searchsorted(ranges[:, 0], addr, side="right") - 1
    ok = idx >= 0
    ok[ok] &= addr[ok] + itemsize <= ranges[idx[ok], 1]
    if not ok.all():
        bad = int(addr[~ok][0])
        near = ", ".join(f"[{lo:#x}, {hi:#x})" for lo, hi in ranges[:8])
        raise OutOfBounds(f"{_STATE['kernel']}: {kind} of {int((~ok).sum())} active lane(s) outside every tensor "
                          f"argument; first at {bad:#x} ({itemsize}-byte elements); arguments: {near}")


def checked():
    """:func:`installed` when kernels run in the Triton interpreter (``TRITON_INTERPRET=1``), else nothing."""
    return installed() if os.environ.get("TRITON_INTERPRET", "0") == "1" else contextlib.nullcontext()


@contextlib.contextmanager
def installed():
    """Check every interpreted launch inside the block (see the module docstring)."""
    from triton.runtime import interpreter as it

    builder = type(it.interpreter_builder)
    executor = it.GridExecutor
    saved = {name: getattr(builder, name) for name in
             ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")}
    saved_call = executor.__call__

    # Positional tails differ between Triton versions (cache and eviction arguments): passed through unread.
    def masked_load(self, ptrs, mask, *rest):
        _check("load", ptrs.data, mask.data, np.dtype(it._get_np_dtype(ptrs.get_element_ty())).itemsize)
        return saved["create_masked_load"](self, ptrs, mask, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        _check("store", ptrs.data, mask.data, value.data.dtype.itemsize)
        return saved["create_masked_store"](self, ptrs, value, mask, *rest)

    def atomic_rmw(self, op, ptr, val, mask, *rest):
        _check("atomic", ptr.data, mask.data, val.data.dtype.itemsize)
        return saved["create_atomic_rmw"](self, op, ptr, val, mask, *rest)

    def atomic_cas(self, ptr, cmp, val, *rest):
        _check("atomic_cas", ptr.data, None, val.data.dtype.itemsize)
        return saved["create_atomic_cas"](self, ptr, cmp, val, *rest)

    def call(self, *args, **kwargs):
        outer = dict(_STATE)
        _STATE.update(ranges=_ranges_of((args, tuple(kwargs.values()))), kernel=getattr(self.fn, "__name__", "?"))
        try:
            return saved_call(self, *args, **kwargs)
        finally:
            _STATE.update(outer)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    executor.__call__ = call
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(builder, name, fn)
        executor.__call__ = saved_call
