"""A capacity-sized, reusable plan workspace: the device tables of every step in buffers allocated once.

:class:`PlanWorkspace` owns (FlashInfer's pattern: capacities given once, buffers reused every step)

* int32 host staging buffers (two, pinned, used in turn when the device is CUDA: :class:`HostStaging`) and one int32
  device buffer of the same size, cut at fixed offsets into the kernel's metadata tables (work-class ranges,
  ``items``, ``gather``, ``mrows``, block table);
* the merge counters and the fp32 partial-state workspace (``ws_o``, ``ws_lse``), sized by capacity.

:meth:`PlanWorkspace.load` writes a step's work list into the host buffer (the compiled planner writes it there itself,
:meth:`PlanWorkspace.host_buffer`) and moves it with ONE non-blocking copy on the current stream; it allocates nothing
on the device. Because every table sits at a fixed offset with a fixed row stride, each step's tensors have the same
``data_ptr`` and strides: a launch captured in a CUDA graph reads the next step's tables when replayed
(:class:`prefixattn.PrefixSharedAttention` with ``use_cuda_graph=True``).

Capacity bounds (:func:`derive_capacity`), for a step of at most ``T`` query tokens from ``R`` requests, ``L``
shared levels per request, ``S`` SMs, ``H`` KV heads and ``r_sh``/``r_sf`` query rows per shared/suffix tile:

* split-k: a range of ``n`` tokens over a piece budget ``b`` (at least ``SPLIT_TOLERANCE`` x its work class's fair
  share, :mod:`prefixattn.planner.split_rule`) is cut into fewer than ``4 n / b`` pieces (whole grains ``g <= b``,
  ``floor(b / g)`` of them per piece, i.e. more than ``b / 2`` tokens each; at most 2 pieces more from rounding).
  Summed over the items of one class that read each range, the extra programs are below ``4 / SPLIT_TOLERANCE x S /
  H``, and the wave-aware step adds at most ``WAVE_EXTRA_ITEMS_PER_SM x S / H`` more; over the step's
  ``NUM_CLASSES`` classes ``SPLIT_EXTRA`` is their sum times ``NUM_CLASSES``.
* items: suffix tiles ``<= R + T // r_sf``; shared tiles ``<= (R - 1) + L T // r_sh`` (at most ``R - 1`` nodes in
  a prefix tree of ``R`` leaves); plus the split extra.
* workspace rows: every row has at most ``L + 1`` unsplit states, and each extra split program adds at most one
  tile of rows: ``T (L + 1) + max(r_sh, r_sf) x SPLIT_EXTRA``. Gather rows: ``L T + r_sh x SPLIT_EXTRA``; merge
  rows ``<= T``.

A plan beyond a capacity is a ``ValueError`` naming the capacity (:meth:`PlanWorkspace.overflow`), never a write out
of bounds; :class:`prefixattn.PrefixSharedAttention` first retries such a step without sharing, which the bounds with
``L = 0`` always admit (unless a ``max_*`` was set below its derived value).

These bounds follow :mod:`prefixattn.planner.split_rule` and :mod:`prefixattn.planner.work_list` as they are; a
change to how they split or tile must keep them (``tests/test_workspace.py`` checks them on random plans).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from prefixattn.kernels import layout as K
from prefixattn.planner.split_rule import SPLIT_TOLERANCE, WAVE_EXTRA_ITEMS_PER_SM
from prefixattn.planner.work_list import ranges_table

#: Extra programs split-k may add, per ``num_sms / num_kv_heads`` (module docstring: pieces < 4 n / b, b >= 1.2 fair).
SPLIT_EXTRA_PER_SM_PER_HEAD = 4.0 / SPLIT_TOLERANCE
#: Shared levels (nested kept nodes) per request the derived capacity admits: system prompt > document covers the
#: common cases; a deeper step is re-planned without sharing (PrefixSharedAttention) or refused.
DEFAULT_MAX_SHARED_LEVELS = 2


@dataclass(frozen=True)
class Capacity:
    """Most of everything one step may hold; every buffer of :class:`PlanWorkspace` is sized from these."""

    max_tokens: int  # query rows (qo_indptr[-1])
    max_requests: int
    max_blocks_per_request: int  # block-table columns (the kernel's row stride: fixed); 0: the caller's device table
    max_items: int
    max_gather_rows: int
    max_merge_rows: int
    max_ws_rows: int


def _positive(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def _non_negative(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return int(value)


def derive_capacity(*, max_tokens: int, max_requests: int, max_blocks_per_request: int, num_kv_heads: int,
                    num_sms: int, rows_per_tile: tuple[int, int],
                    max_shared_levels: int = DEFAULT_MAX_SHARED_LEVELS, max_items: int | None = None,
                    max_gather_rows: int | None = None, max_merge_rows: int | None = None,
                    max_ws_rows: int | None = None) -> Capacity:
    """The capacities the module docstring's bounds give; an explicit ``max_*`` replaces its derived value.

    ``rows_per_tile = (lo, hi)``: the fewest query rows per tile (shared or suffix) any plan may use bounds the items
    (more tiles), the most bounds the rows one extra split program adds (``r_sh``, ``r_sf`` in the bounds above).
    """
    t = _positive("max_tokens", max_tokens)
    r = _positive("max_requests", max_requests)
    w = _non_negative("max_blocks_per_request", max_blocks_per_request)
    if not isinstance(max_shared_levels, int) or max_shared_levels < 0:
        raise ValueError(f"max_shared_levels: expected a non-negative int, got {max_shared_levels!r}")
    lv = max_shared_levels
    extra = K.NUM_CLASSES * class_split_extra(num_sms=num_sms, num_kv_heads=num_kv_heads)
    lo, hi = max(1, rows_per_tile[0]), max(1, rows_per_tile[1])
    derived = dict(
        max_items=r + t // lo + (r - 1 + lv * t // lo if lv else 0) + extra,
        max_gather_rows=max(lv * t + (hi * extra if lv else 0), 1),
        max_merge_rows=t,
        max_ws_rows=t * (lv + 1) + hi * extra,
    )
    given = dict(max_items=max_items, max_gather_rows=max_gather_rows, max_merge_rows=max_merge_rows,
                 max_ws_rows=max_ws_rows)
    for name, value in given.items():
        if value is not None:
            derived[name] = _positive(name, value)
    return Capacity(max_tokens=t, max_requests=r, max_blocks_per_request=w, **derived)


def class_split_extra(*, num_sms: int, num_kv_heads: int) -> int:
    """Most extra items split-k adds to one work class (module docstring)."""
    return (math.ceil(SPLIT_EXTRA_PER_SM_PER_HEAD * num_sms / num_kv_heads)
            + WAVE_EXTRA_ITEMS_PER_SM * num_sms // num_kv_heads)


def class_grid_items(*, num_tokens: int, num_requests: int, rows_per_tile: tuple[int, int, int], chunk_class: bool,
                     max_shared_levels: int, num_sms: int, num_kv_heads: int,
                     max_items: int) -> tuple[int, int, int]:
    """Items each work class of a step of at most ``num_tokens`` query rows from ``num_requests`` requests can have
    (``(shared, chunk, decode)``, each at most ``max_items``): the grid of that class's launch in a CUDA graph.
    ``rows_per_tile``: query rows of a shared, chunk and decode tile: a request with more rows than a decode tile is
    cut into chunk tiles, or (``chunk_class`` False: one binary serves both) into decode tiles of the decode class.
    See the module docstring for the rest."""
    t, r = num_tokens, min(num_requests, num_tokens)
    r_sh, r_ch, r_de = (max(1, x) for x in rows_per_tile)
    extra = class_split_extra(num_sms=num_sms, num_kv_heads=num_kv_heads)
    lv = max_shared_levels
    shared = r - 1 + lv * t // r_sh + extra if lv else 0
    chunk = t // r_ch + min(r, t // (r_de + 1)) + extra if chunk_class else 0
    decode = (r if chunk_class else t // r_de + r) + extra
    return min(shared, max_items), min(chunk, max_items), min(decode, max_items)


#: Row-count triples whose views a workspace keeps (a bound on its memo; each entry is four tensor views).
_MAX_LIVE_VIEWS = 1024
#: Pinned host staging buffers a CUDA workspace uses in turn. With one, planning step N+1 waited until step N's copy
#: had read the buffer, i.e. until the GPU reached step N: an engine that plans ahead (vLLM's async scheduling) could
#: not plan while the GPU worked. With two, it waits for step N-1's copy, which step N's queued work follows.
STAGING_SLOTS = 2


class HostStaging:
    """The int32 host buffers a workspace's tables are written into and copied from, one per step in turn.

    Buffer ``slot`` is written by a step's planner, copied to the device by one non-blocking copy, then left to that
    copy while the next step writes the next buffer; a buffer is written again only once the copy that read it is
    done (an event per buffer). On the CPU one buffer (the device buffer itself: no copy, kernels run synchronously).

    Parameters
    ----------
    size : int
        int32 elements per buffer.
    slots : int
        Buffers used in turn (>= 1).
    pinned : bool
        Page-locked buffers (CUDA): a copy from pageable memory would wait for the work queued on its stream.
    event : callable, optional
        Makes the event recorded after each copy (``torch.cuda.Event``); None: no copy to wait for.
    """

    def __init__(self, size: int, *, slots: int, pinned: bool, event=None) -> None:
        if slots < 1:
            raise ValueError(f"slots: expected at least 1, got {slots}")
        self.buffers = [torch.zeros(size, dtype=torch.int32, pin_memory=pinned) for _ in range(slots)]
        self.arrays = [b.numpy() for b in self.buffers]
        self._events = [event() if event is not None else None for _ in range(slots)]
        self._pending = [False] * slots  # a copy from that buffer was recorded and not yet waited for
        self.slot = 0

    @property
    def buffer(self) -> torch.Tensor:
        """This step's buffer (valid once :meth:`wait` returned)."""
        return self.buffers[self.slot]

    @property
    def array(self) -> np.ndarray:
        return self.arrays[self.slot]

    def wait(self) -> None:
        """Block until the last copy from this step's buffer has read it (a no-op when none is pending)."""
        if self._pending[self.slot]:
            self._events[self.slot].synchronize()
            self._pending[self.slot] = False

    def copied(self) -> None:
        """This step's copy from the buffer is queued: record its event and move on to the next buffer."""
        event = self._events[self.slot]
        if event is not None:
            event.record()
            self._pending[self.slot] = True
            self.slot = (self.slot + 1) % len(self.buffers)


class PlanWorkspace:
    """Device buffers for one step's tables, allocated once at capacity (see the module docstring).

    Parameters
    ----------
    capacity : Capacity
    num_qo_heads, head_dim : int
        Shape of the partial-state workspace ``ws_o [max_ws_rows, num_qo_heads, head_dim]`` fp32 (the output's head
        size: V's).
    device : torch.device
        Where the kernel runs; the host staging buffer is pinned when it is a CUDA device.
    """

    def __init__(self, capacity: Capacity, *, num_qo_heads: int, head_dim: int, device: torch.device) -> None:
        self.capacity = c = capacity
        self.device = device
        self.num_qo_heads = num_qo_heads
        # Fixed offsets (int32 elements); the block table last, so a step copies only up to its live rows.
        sizes = dict(ranges=K.RANGES_SIZE, items=c.max_items * K.ITEM_FIELDS, gather=c.max_gather_rows * K.GATHER_FIELDS,
                     mrows=c.max_merge_rows * K.MROW_FIELDS, table=c.max_requests * c.max_blocks_per_request)
        self._offsets, pos = {}, 0
        for name, size in sizes.items():
            self._offsets[name] = (pos, size)
            pos = K.section_end(pos + size)  # every section 16-byte aligned (K.SECTION_ALIGN)
        self._table_starts = tuple(self._offsets[name][0] for name in ("items", "gather", "mrows"))
        cuda = device.type == "cuda"
        self._staging = HostStaging(pos, slots=STAGING_SLOTS if cuda else 1, pinned=cuda,
                                    event=torch.cuda.Event if cuda else None)
        # On the CPU the staging buffer is the device buffer: nothing to copy (kernels there run synchronously, so no
        # launch still reads the previous step's tables). A CPU tensor copy of ~0.3 MB also took 7-15 ms per step on
        # the loaded 2-core host (torch parallelizes it over both cores and waits for the busy one), numpy's 12 us.
        self._on_host = device.type == "cpu"
        self._dev = self._staging.buffer if self._on_host else torch.zeros(pos, dtype=torch.int32, device=device)
        self.step = 0  # loads so far: a plan remembers its step, so a stale plan is refused
        ranges = self._section(self._dev, "ranges").view(K.NUM_CLASSES, K.RANGE_FIELDS)
        self.ranges = tuple(ranges[c] for c in range(K.NUM_CLASSES))  # each class's record (one launch's pointer)
        self.items = self._section(self._dev, "items").view(c.max_items, K.ITEM_FIELDS)
        self.gather = self._section(self._dev, "gather").view(c.max_gather_rows, K.GATHER_FIELDS)
        self.mrows = self._section(self._dev, "mrows").view(c.max_merge_rows, K.MROW_FIELDS)
        self.block_table = self._section(self._dev, "table").view(c.max_requests, c.max_blocks_per_request)
        self._host_tables = [self._section(a, "table").reshape(c.max_requests, c.max_blocks_per_request)
                             for a in self._staging.arrays]
        self.counters = torch.zeros((max(c.max_merge_rows, 1), num_qo_heads), dtype=torch.int32, device=device)
        self.ws_o = torch.empty((c.max_ws_rows, num_qo_heads, head_dim), dtype=torch.float32, device=device)
        self.ws_lse = torch.empty((c.max_ws_rows, num_qo_heads), dtype=torch.float32, device=device)
        self._live_views: dict = {}  # (items, gather, merge rows) -> the live-row views load() returns

    def _section(self, buf, name: str):
        start, size = self._offsets[name]
        return buf[start:start + size]

    @property
    def device_bytes(self) -> int:
        """Device memory the workspace holds (metadata, counters, partial states)."""
        return sum(t.numel() * t.element_size() for t in (self._dev, self.counters, self.ws_o, self.ws_lse))

    def overflow(self, *, num_requests: int, num_tokens: int, table_width: int, num_items: int, num_gather: int,
                 num_mrows: int, num_ws_rows: int) -> str | None:
        """The first capacity a step exceeds, as ``"name: expected at most C (...), got N"``; None if it fits."""
        c = self.capacity
        if (num_requests <= c.max_requests and num_tokens <= c.max_tokens and table_width <= c.max_blocks_per_request
                and num_items <= c.max_items and num_gather <= c.max_gather_rows and num_mrows <= c.max_merge_rows
                and num_ws_rows <= c.max_ws_rows):
            return None  # every step that fits (one expression: the loop below costs ~1 us a step)
        for name, got, cap in (("max_requests", num_requests, c.max_requests),
                               ("max_tokens", num_tokens, c.max_tokens),
                               ("max_blocks_per_request", table_width, c.max_blocks_per_request),
                               ("max_items", num_items, c.max_items),
                               ("max_gather_rows", num_gather, c.max_gather_rows),
                               ("max_merge_rows", num_mrows, c.max_merge_rows),
                               ("max_ws_rows", num_ws_rows, c.max_ws_rows)):
            if got > cap:
                return (f"{name}: expected at most {cap} (the workspace capacity given to PrefixSharedAttention), "
                        f"got {got}")
        return None

    def host_table(self) -> np.ndarray:
        """The host block table ``[max_requests, max_blocks_per_request]`` int32 that :meth:`load` copies, for a
        planner that stages the table itself (``load(staged_rows=...)``), once the previous step's copy is done
        reading it. A step refused after writing it calls :meth:`refused_after_writing`."""
        self._staging.wait()
        return self._host_tables[self._staging.slot]

    def host_buffer(self) -> np.ndarray:
        """The whole int32 host buffer (sections at :meth:`section_start`), for a planner that writes the tables
        there itself (``load(tables_written=True)``); as :meth:`host_table`."""
        self._staging.wait()
        return self._staging.array

    def section_start(self, name: str) -> int:
        """Offset (int32 elements) of a section of the host buffer: ``ranges``, ``items``, ``gather``, ``mrows`` or
        ``table``."""
        return self._offsets[name][0]

    def refused_after_writing(self, *, table: bool, work_list: bool) -> None:
        """A step refused after the planner wrote its ``table`` (:meth:`host_table`) or its ``work_list``
        (:meth:`host_buffer`) here: the plans loaded so far become stale (:meth:`prefixattn.Plan.is_current`) where
        that changed what they read. Their ``Plan.work`` views the work list's sections; on a CPU device the whole
        host buffer is their device tables. (On CUDA a staged table alone changes nothing they read.)"""
        if work_list or (table and self._on_host):
            self.step += 1

    def load(self, *, items: np.ndarray, gather: np.ndarray, mrows: np.ndarray, class_ends: tuple,
             table: np.ndarray | None, table_width: int = 0, staged_rows: int | None = None,
             tables_written: bool = False) -> dict:
        """Write one step's int32 tables into the pinned host buffer and move them with one non-blocking copy.

        ``items``, ``gather``, ``mrows``, ``class_ends``: the work list's tables and each work class's end item,
        already in their sections of :meth:`host_buffer` with ``tables_written`` (the compiled planner writes them
        there). ``table`` is the used part of the block
        table ``[num_requests, <= table_width]`` (int64 or int32; the ids the kernel reads < 2**31, a cell it never
        reads is staged wrapped; columns up to ``table_width`` it lacks are staged as 0), or None: ``staged_rows``
        rows of it are in :meth:`host_table` already, or (``staged_rows`` None) the kernel reads a block table the
        caller keeps on the device. The caller checked the sizes (:meth:`overflow`). Zeroes the step's merge counters.
        Returns the device views of the live rows (same ``data_ptr`` at every step).
        """
        self._staging.wait()
        h, c = self._staging.array, self.capacity
        n_items = items.shape[0]
        if not tables_written:
            h[:K.RANGES_SIZE] = ranges_table(class_ends).ravel()
            for start, arr in zip(self._table_starts, (items, gather, mrows)):
                h[start:start + arr.size] = arr.ravel()
        # Copy everything up to the end of the live metadata (small, capacity-sized sections), then the live table
        # rows (row stride fixed at max_blocks_per_request so a captured launch keeps its stride).
        end = self._table_starts[2] + mrows.size
        rows = staged_rows or 0
        if table is not None and table.shape[0] and max(table.shape[1], table_width):
            rows, cols = table.shape
            view = self._host_tables[self._staging.slot][:rows]
            view[:, :cols] = table
            if table_width > cols:  # an empty slice's assignment still costs ~0.5 us
                view[:, cols:table_width] = 0
        if rows:
            end = self._offsets["table"][0] + rows * c.max_blocks_per_request
        if not self._on_host:
            self._dev[:end].copy_(self._staging.buffer[:end], non_blocking=True)
        self._staging.copied()
        self.step += 1
        views = self._views(n_items, gather.shape[0], mrows.shape[0])
        if mrows.shape[0]:
            # The step's merge counters start at 0 (a memset queued behind the copy): the kernels leave them at 0
            # after every layer, so this is the only reset, once a step; it undoes what an interrupted step left.
            views[3].zero_()
        return dict(ranges=self.ranges, items=views[0], gather=views[1], mrows=views[2],
                    # Whole rows of capacity (a view with no rows would have data_ptr 0); rows past the step's
                    # requests are stale and never read.
                    block_table=None if table is None and staged_rows is None else self.block_table,
                    counters=views[3], ws_o=self.ws_o, ws_lse=self.ws_lse)

    def _views(self, n_items: int, n_gather: int, n_mrows: int) -> tuple:
        """The live rows of the tables and counters as views of the fixed buffers, made once per row counts: a
        decode loop has the same counts step after step, and four torch slices cost ~4 us a step on the 2-core
        host. The views only name rows of buffers whose contents every load rewrites."""
        key = (n_items, n_gather, n_mrows)
        views = self._live_views.get(key)
        if views is None:
            if len(self._live_views) >= _MAX_LIVE_VIEWS:
                self._live_views.clear()
            views = self._live_views[key] = (self.items[:n_items], self.gather[:n_gather], self.mrows[:n_mrows],
                                             self.counters[:max(n_mrows, 1)])
        return views
