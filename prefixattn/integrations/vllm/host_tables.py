"""Host copies of the block ids a metadata builder plans with, read without synchronizing with the device.

The planner finds shared prefixes from identical leading block ids, so it must see the ids on the host; the kernel
reads vLLM's device table in place. Copying the device table to the host each step (``.to("cpu")``) waits for every
kernel queued before it: under vLLM's async scheduling (the CUDA default since 0.33) that is the whole previous
step's forward, so the next step's preparation stops overlapping the GPU. Instead the ids come from host data vLLM
already has, found through two read-only taps installed when this module is imported (the backend's import, while
vLLM builds the model: before any block table of the KV cache exists):

* Model runner V1 (``GPUModelRunner``, and the ``CPUModelRunner`` of vLLM's CPU build): the input batch keeps each
  KV cache group's table in a ``CpuGpuBuffer``; the host half is the source of truth and
  ``BlockTable.commit_block_table(num_reqs)`` copies its first rows to the device before the metadata is built. The
  tap records each committing table; the builder finds the one whose device buffer holds its
  ``block_table_tensor`` (same storage; micro-batch slices are row offsets of it) and reads the host rows.
* Model runner V2 (``vllm.v1.worker.gpu``, the CUDA default in 0.33): the per-request tables live on the device only,
  written by staged writes (``StagedWriteTensor.stage_write``) whose contents are host lists. The tap wraps the
  ``stage_write`` of every ``BlockTables`` a runner creates and mirrors each write into a host array per group; the
  builder gathers its rows with the metadata's ``req_idx`` (the batch's request-state indices, on the host), exactly
  as the runner's gather kernel does on the device.

Either way the rows are the ones the device table holds when the kernel runs (vLLM writes the device table from
them), so the plan stays exact when requests are added, finished, preempted or reordered. Padding rows (a full CUDA
graph's requests without queries) are zero on the host, as vLLM's null block on the device. Where neither tap
applies (a device table on the CPU: read in place; anything else: one device-to-host copy, logged once and counted
in ``HostBlockTables.device_copies``) the builder still plans correctly.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Model runner V1's committing block tables -> the rows their last commit copied to the device.
_V1_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: Model runner V2's BlockTables -> their host mirror.
_V2_MIRRORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class PlanInputs:
    """Host-side ``prefixattn.plan`` inputs derived from one ``CommonAttentionMetadata``."""

    qo_indptr: torch.Tensor  # [num_reqs + 1] CPU
    kv_lens: torch.Tensor  # [num_reqs] CPU
    block_table: torch.Tensor  # [num_reqs, max_blocks], on vLLM's device: the kernel reads it in place
    #: ``[num_reqs, >= used blocks]`` CPU: the same ids on the host, what the planner reads
    host_block_table: torch.Tensor
    #: where ``host_block_table`` came from: "runner" (V1 host table), "mirror" (V2 staged writes), "cpu" (the
    #: device table is on the CPU: read in place) or "device_copy" (a synchronizing copy)
    route: str


# ---------------------------------------------------------------------------------------------------------------
# Taps (installed once per process, on import)
# ---------------------------------------------------------------------------------------------------------------

def _tap_v1() -> None:
    """Record every V1 ``BlockTable`` that commits rows to the device, and how many."""
    try:
        from vllm.v1.worker.block_table import BlockTable
    except ImportError:
        return
    commit = BlockTable.commit_block_table
    if getattr(commit, "_prefixattn_tap", False):
        return

    @functools.wraps(commit)
    def commit_block_table(self, num_reqs: int) -> None:
        commit(self, num_reqs)
        _V1_TABLES[self] = int(num_reqs)

    commit_block_table._prefixattn_tap = True
    BlockTable.commit_block_table = commit_block_table


class StagedWriteMirror:
    """Host copy of a model runner V2 ``BlockTables``: every staged write of every group, as vLLM stages it.

    ``valid[g][r]``: row ``r`` of group ``g`` was written from its start since the mirror exists (a row written
    before, by a request the mirror never saw begin, is not trusted: the builder copies from the device instead).
    """

    def __init__(self, block_tables) -> None:
        staged = list(block_tables.block_tables)
        self.rows = [np.zeros(tuple(t.gpu.shape), dtype=np.int32) for t in staged]
        # Rows with blocks already written (none, when the tap runs at construction) are not trusted.
        num_blocks = np.asarray(block_tables.num_blocks.np)
        self.valid = [num_blocks[g] == 0 for g in range(len(staged))]
        for g, t in enumerate(staged):
            t.stage_write = functools.partial(self._stage_write, g, t.stage_write)

    def _stage_write(self, group: int, stage_write, index: int, start: int, x) -> None:
        stage_write(index, start, x)
        values = list(x)
        if values:
            self.rows[group][index, start:start + len(values)] = values
        if start == 0:
            self.valid[group][index] = True


def _tap_v2() -> None:
    """Mirror every model runner V2 ``BlockTables`` from its construction on."""
    try:
        from vllm.v1.worker.gpu.block_table import BlockTables
    except ImportError:
        return
    init = BlockTables.__init__
    if getattr(init, "_prefixattn_tap", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        _V2_MIRRORS[self] = StagedWriteMirror(self)

    __init__._prefixattn_tap = True
    BlockTables.__init__ = __init__


def install_taps() -> None:
    """Install both taps (idempotent): vLLM's methods keep their behaviour; the taps only record."""
    _tap_v1()
    _tap_v2()


# ---------------------------------------------------------------------------------------------------------------
# Lookup (per builder, per step)
# ---------------------------------------------------------------------------------------------------------------

def _row_offset(view: torch.Tensor, base: torch.Tensor) -> int | None:
    """Row of ``base`` where ``view`` (a row slice of it) starts, or None when ``view`` is not one."""
    if view.dim() != 2 or base.dim() != 2 or view.dtype != base.dtype or view.stride() != base.stride():
        return None
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return None
    delta = view.storage_offset() - base.storage_offset()
    row_stride = base.stride(0)
    if delta < 0 or delta % row_stride or view.shape[1] > base.shape[1]:
        return None
    row = delta // row_stride
    return row if row + view.shape[0] <= base.shape[0] else None


class HostBlockTables:
    """One builder's source of host block ids (the lookup is cached: one storage comparison per step)."""

    def __init__(self) -> None:
        install_taps()
        self._v1 = None  # weakref to the V1 BlockTable last matched
        #: synchronizing device-to-host copies made (a route neither tap covers)
        self.device_copies = 0

    def rows(self, common, n: int, cols: int) -> tuple[torch.Tensor, str]:
        """``[n, >= cols]`` host block ids (a CPU tensor) of the first ``n`` rows of ``common.block_table_tensor``,
        and the route they came by."""
        table = common.block_table_tensor
        host = self._v1_rows(table, n, cols)
        if host is not None:
            return torch.from_numpy(host), "runner"
        host = self._v2_rows(common, table, n, cols)
        if host is not None:
            return torch.from_numpy(host), "mirror"
        if table.device.type == "cpu":
            return table[:n], "cpu"
        self.device_copies += 1
        if self.device_copies == 1:
            logger.warning("prefixattn: no host copy of vLLM's block table for this builder (neither model runner "
                           "V1's input batch nor V2's staged writes hold it): copying the used columns from the "
                           "device, which waits for the work queued before it (HostBlockTables.device_copies counts "
                           "them)")
        return table[:n, :max(1, min(cols, table.shape[1]))].to("cpu"), "device_copy"

    def _v1_rows(self, table: torch.Tensor, n: int, cols: int) -> np.ndarray | None:
        cached = self._v1() if self._v1 is not None else None
        for bt in ([cached] if cached is not None else []) + [t for t in list(_V1_TABLES) if t is not cached]:
            buf = bt.block_table
            row = _row_offset(table, buf.gpu)
            if row is None:
                continue
            self._v1 = weakref.ref(bt)
            committed = _V1_TABLES.get(bt, 0)
            host = buf.np[row:row + n, :cols]
            if row + n > committed:  # padding rows: vLLM's null block (0) on the device, stale on the host
                host = host.copy()
                host[max(committed - row, 0):] = 0
            return host
        return None

    @staticmethod
    def _v2_rows(common, table: torch.Tensor, n: int, cols: int) -> np.ndarray | None:
        req_idx = getattr(common, "req_idx", None)
        if req_idx is None:
            return None
        for block_tables, mirror in list(_V2_MIRRORS.items()):
            for g, base in enumerate(block_tables.input_block_tables):
                if _row_offset(table, base) is None:
                    continue
                # req_idx is row-aligned with this metadata (a micro-batch's too): row b was gathered on the device
                # from request-state row req_idx[b], as here.
                idx = np.asarray(req_idx)[:n]
                if not mirror.valid[g][idx].all():
                    return None  # a row written before the mirror existed
                host = np.zeros((n, cols), dtype=np.int32)
                host[:idx.shape[0]] = mirror.rows[g][idx, :cols]  # rows past req_idx: padding, the null block
                return host
        return None


def exact_seq_lens_on_host(vllm_config) -> bool:
    """Whether vLLM's ``seq_lens_cpu_upper_bound`` is exact for ``vllm_config``: always but under asynchronous
    speculative decoding (optimistic drafts), where :func:`plan_inputs` copies ``seq_lens`` from the device."""
    spec = getattr(vllm_config, "speculative_config", None)
    speculative = spec is not None and bool(getattr(spec, "num_speculative_tokens", None))
    asynchronous = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))
    return not (speculative and asynchronous)


def plan_inputs(common, *, block_size: int, host_tables: HostBlockTables | None = None,
                exact_seq_lens_on_host: bool = True) -> PlanInputs:
    """Convert vLLM's per-step metadata to ``prefixattn.plan``'s ``(qo_indptr, kv_lens, block_table)``.

    vLLM's ``seq_lens`` already count the new tokens (prefixattn's ``kv_lens`` convention) and its block table rows
    are in request order, so this is slicing to the ``num_reqs`` rows plus picking host copies:
    ``query_start_loc_cpu`` always; ``seq_lens_cpu_upper_bound`` when it is exact (everything but asynchronous
    speculative decoding: ``exact_seq_lens_on_host``), else one device-to-host copy of ``seq_lens``; the block ids
    from ``host_tables`` (:class:`HostBlockTables`), only the columns the longest request uses.
    """
    n = int(common.num_reqs)
    qo_indptr = common.query_start_loc_cpu[: n + 1]
    host_lens = getattr(common, "seq_lens_cpu_upper_bound", None) if exact_seq_lens_on_host else None
    kv_lens = host_lens[:n] if host_lens is not None else common.seq_lens[:n].to("cpu")
    table = common.block_table_tensor[:n]
    cols = -(-int(kv_lens.max()) // block_size) if n else 0
    cols = max(1, min(cols, table.shape[1]))
    host, route = (host_tables or HostBlockTables()).rows(common, n, cols)
    return PlanInputs(qo_indptr=qo_indptr, kv_lens=kv_lens, block_table=table, host_block_table=host, route=route)


install_taps()  # on import: the backend's, while vLLM builds the model (before any KV cache block table exists)
