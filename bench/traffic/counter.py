"""Count the global-memory bytes and launches of Triton kernels running in the CPU interpreter.

The interpreter (``triton/runtime/interpreter.py``) runs every ``tl.load``/``tl.store`` through one builder object:
``create_load``/``create_store`` and the tensor-descriptor and atomic load/store ops all end in
``create_masked_load``/``create_masked_store``, and the read-modify-write atomics go through ``create_atomic_rmw``/
``create_atomic_cas``. Every launch goes through ``GridExecutor.__call__`` and every program through
``set_grid_idx``. :func:`count_traffic` wraps exactly those (and restores them on exit), so any kernel - ours or a
peer's - is measured the same way without touching its code.

What is counted: the bytes of the elements whose mask is true (a masked-off lane moves no data on a GPU), attributed
to the tensor whose memory the address falls in. Tensors are named by the caller (``tensors={"k_cache": k}``, so one
name means the same memory across kernels with different parameter names) and, for the rest, by the kernel's
parameter name. Addresses in no known tensor are counted under ``OTHER``.

This is the traffic a kernel *requests* from global memory, before any cache: a GPU's L2 may serve repeated reads,
so it is an upper bound on DRAM traffic and the exact L1/L2 request volume. Launch-to-launch reuse (a cascade reading
q twice) is counted twice, as it costs twice on a GPU whose L2 is smaller than the working set.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import numpy as np

#: Label of bytes whose address lies in no argument of the launch nor in any caller-named tensor.
OTHER = "<other>"


@dataclass
class Launch:
    """One kernel launch: its name, number of programs and bytes per tensor label."""

    kernel: str
    programs: int = 0
    loaded: dict = field(default_factory=dict)
    stored: dict = field(default_factory=dict)
    atomic: dict = field(default_factory=dict)  # read-modify-write atomics (bytes of the elements updated)

    def _add(self, table: dict, label: str, nbytes: int) -> None:
        table[label] = table.get(label, 0) + nbytes


@dataclass
class Traffic:
    """Everything measured inside one :func:`count_traffic` block."""

    launches: list = field(default_factory=list)
    _unique: dict = field(default_factory=dict)  # label -> (list of address arrays, element size)

    @property
    def num_launches(self) -> int:
        return len(self.launches)

    def _total(self, kind: str, labels=None) -> int:
        return sum(v for launch in self.launches for k, v in getattr(launch, kind).items()
                   if labels is None or k in labels)

    def loaded(self, *labels: str) -> int:
        """Bytes loaded from the given labels (all labels when none is given)."""
        return self._total("loaded", set(labels) if labels else None)

    def stored(self, *labels: str) -> int:
        """Bytes stored to the given labels (all labels when none is given)."""
        return self._total("stored", set(labels) if labels else None)

    def atomic(self, *labels: str) -> int:
        return self._total("atomic", set(labels) if labels else None)

    def by_label(self, kind: str = "loaded") -> dict:
        """``{label: bytes}`` summed over launches; ``kind`` is ``loaded``, ``stored`` or ``atomic``."""
        out: dict = {}
        for launch in self.launches:
            for k, v in getattr(launch, kind).items():
                out[k] = out.get(k, 0) + v
        return out

    def unique_loaded(self, label: str) -> int:
        """Bytes of *distinct* addresses loaded from ``label`` (needs ``track_unique=(label, ...)``)."""
        if label not in self._unique:
            raise ValueError(f"label: expected one of the tracked labels {sorted(self._unique)}, got {label!r}")
        arrays, elt = self._unique[label]
        if not arrays:
            return 0
        return int(np.unique(np.concatenate(arrays)).size) * elt


def _extent(t) -> tuple[int, int] | None:
    """Byte range ``[start, end)`` a tensor view can address (None for an empty tensor)."""
    base = getattr(t, "base", None)
    if base is not None and hasattr(base, "data_ptr") and not hasattr(t, "data_ptr"):
        t = base  # a TensorDescriptor: its base tensor
    if not hasattr(t, "data_ptr") or not hasattr(t, "stride"):
        return None
    if t.numel() == 0:
        return None
    elt = t.element_size()
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    start = t.data_ptr()
    return start, start + span * elt


class _AddressMap:
    """Map byte addresses to labels. Overlapping ranges: the earlier one in the given order wins."""

    def __init__(self, ranges: list[tuple[str, int, int]]) -> None:
        self.labels = [name for name, _, _ in ranges] + [OTHER]
        if not ranges:
            self.bounds = np.zeros(0, dtype=np.uint64)
            self.interval_label = np.zeros(0, dtype=np.int64)
            return
        bounds = np.unique(np.array([b for _, s, e in ranges for b in (s, e)], dtype=np.uint64))
        interval_label = np.full(max(len(bounds) - 1, 0), len(ranges), dtype=np.int64)  # default: OTHER
        lo, hi = bounds[:-1], bounds[1:]
        for i in range(len(ranges) - 1, -1, -1):  # reversed so the first range in the order is written last
            _, s, e = ranges[i]
            interval_label[(lo >= s) & (hi <= e)] = i
        self.bounds, self.interval_label = bounds, interval_label

    def count(self, addresses: np.ndarray) -> np.ndarray:
        """Elements per label (``len(self.labels)`` counts) and the label id of every address."""
        other = len(self.labels) - 1
        if self.bounds.size == 0:
            ids = np.full(addresses.shape, other, dtype=np.int64)
        else:
            idx = np.searchsorted(self.bounds, addresses, side="right") - 1
            valid = (idx >= 0) & (idx < self.interval_label.size)
            ids = np.where(valid, self.interval_label[np.clip(idx, 0, max(self.interval_label.size - 1, 0))], other)
        return np.bincount(ids, minlength=len(self.labels)), ids


def _element_bytes(ptr_handle) -> int:
    bits = ptr_handle.get_element_ty().primitive_bitwidth
    return max(bits // 8, 1)  # int1 is stored as one byte


class _Counter:
    def __init__(self, named: dict, track_unique) -> None:
        self.named = [(name, ext) for name, ext in ((n, _extent(t)) for n, t in named.items()) if ext is not None]
        self.track_unique = set(track_unique)
        self.traffic = Traffic(_unique={label: ([], 1) for label in self.track_unique})
        self.launch: Launch | None = None
        self.map: _AddressMap | None = None

    def begin(self, kernel: str, args: dict) -> None:
        ranges = [(name, s, e) for name, (s, e) in self.named]
        own = []
        for name, value in args.items():
            ext = _extent(value)
            if ext is not None:
                own.append((name, *ext))
        own.sort(key=lambda r: r[2] - r[1])  # the tightest argument wins where views of one buffer overlap
        self.map = _AddressMap(ranges + own)
        self.launch = Launch(kernel=kernel)

    def end(self) -> None:
        self.traffic.launches.append(self.launch)
        self.launch, self.map = None, None

    def record(self, kind: str, ptrs, mask) -> None:
        if self.launch is None:  # a load outside a launch (a device function called directly): not a kernel's
            return
        addresses = np.asarray(ptrs.data)
        if mask is not None:
            addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
        addresses = addresses.ravel().astype(np.uint64, copy=False)
        if addresses.size == 0:
            return
        elt = _element_bytes(ptrs)
        counts, ids = self.map.count(addresses)
        table = getattr(self.launch, kind)
        for i in np.nonzero(counts)[0]:
            label = self.map.labels[i]
            self.launch._add(table, label, int(counts[i]) * elt)
            if kind == "loaded" and label in self.track_unique:
                arrays, _ = self.traffic._unique[label]
                arrays.append(addresses[ids == i])
                self.traffic._unique[label] = (arrays, elt)


_ACTIVE: list = []


@contextlib.contextmanager
def count_traffic(*, tensors: dict | None = None, track_unique=()):
    """Measure every interpreted Triton launch inside the ``with`` block.

    Parameters
    ----------
    tensors : dict[str, Tensor], optional
        Caller names for memory regions (the extent of each view). They win over the kernels' parameter names, so
        ``{"k_cache": k, "v_cache": v}`` labels KV bytes the same way for every kernel that reads them.
    track_unique : iterable of str
        Labels whose loaded addresses are kept, for :meth:`Traffic.unique_loaded` (costs memory; keep it to KV).

    Yields
    ------
    Traffic
        Filled in as launches run; read it after the block.

    Examples
    --------
    >>> with count_traffic(tensors={"x": x}) as t:
    ...     copy_kernel[(1,)](out_ptr=y, x_ptr=x, n=x.numel(), BLOCK=1024)
    >>> t.loaded("x"), t.stored("out_ptr"), t.num_launches
    """
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        raise RuntimeError("count_traffic measures the Triton interpreter: set TRITON_INTERPRET=1 before importing "
                           "the kernels")
    if _ACTIVE:
        raise RuntimeError("count_traffic: already counting (blocks cannot nest)")
    counter = _Counter(tensors or {}, track_unique)
    with _hooks_installed(counter):
        _ACTIVE.append(counter)
        try:
            yield counter.traffic
        finally:
            _ACTIVE.pop()


@contextlib.contextmanager
def _hooks_installed(counter: _Counter):
    """The interpreter's masked loads and stores, atomics, program starts and launches, each reporting to
    ``counter`` before it runs; the originals are restored on exit."""
    from triton.runtime import interpreter as interp

    builder = interp.interpreter_builder
    orig = dict(load=builder.create_masked_load, store=builder.create_masked_store,
                rmw=builder.create_atomic_rmw, cas=builder.create_atomic_cas, grid_idx=builder.set_grid_idx)
    orig_call = interp.GridExecutor.__call__

    def masked_load(ptrs, mask, other, cache_policy, is_volatile):
        counter.record("loaded", ptrs, mask)
        return orig["load"](ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(ptrs, value, mask, cache_policy):
        counter.record("stored", ptrs, mask)
        return orig["store"](ptrs, value, mask, cache_policy)

    def atomic_rmw(rmw_op, ptr, val, mask, sem, scope):
        counter.record("atomic", ptr, mask)
        return orig["rmw"](rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(ptr, cmp, val, sem, scope):
        counter.record("atomic", ptr, None)
        return orig["cas"](ptr, cmp, val, sem, scope)

    def set_grid_idx(x, y, z):
        if counter.launch is not None:
            counter.launch.programs += 1
        return orig["grid_idx"](x, y, z)

    def grid_call(executor, *args_dev, **kwargs):
        named = dict(zip(executor.arg_names, args_dev))
        named.update(kwargs)
        counter.begin(getattr(executor.fn, "__name__", "kernel"), named)
        try:
            return orig_call(executor, *args_dev, **kwargs)
        finally:
            counter.end()

    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    builder.create_atomic_rmw = atomic_rmw
    builder.create_atomic_cas = atomic_cas
    builder.set_grid_idx = set_grid_idx
    interp.GridExecutor.__call__ = grid_call
    try:
        yield
    finally:
        interp.GridExecutor.__call__ = orig_call
        for name in ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas",
                     "set_grid_idx"):
            # The originals were bound methods found on the class: deleting the instance attribute restores them.
            builder.__dict__.pop(name, None)
