"""A plan's device tensors: new ones for each plan (the free :func:`prefixattn.plan`) or the fixed buffers of a
:class:`~prefixattn.planner.workspace.PlanWorkspace` (an engine's wrapper), filled from the host tables in one copy.

The host tables (:class:`~prefixattn.planner.work_list.WorkList` and the block table) come from the planner
(:mod:`prefixattn.planner.plans`); the kernel reads the layout :mod:`prefixattn.kernels.layout` names.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from prefixattn.kernels import layout as K
from prefixattn.validation import INT32_MAX, same_device
from prefixattn.planner.work_list import WorkList
from prefixattn.planner.workspace import PlanWorkspace


def device_tables(work: WorkList, inputs, *, workspace: PlanWorkspace | None,
                  device_block_table: torch.Tensor | None, device: torch.device, staged, num_qo_heads: int,
                  head_dim: int, tables_written: bool = False, stage_table=None) -> dict:
    """The plan's device tensors: new ones (:func:`_allocate_tables`) or ``workspace``'s buffers
    (:func:`_workspace_tables`). ``inputs``: the checks' (:class:`~prefixattn.planner.checks.Inputs`: the block table,
    the columns the batch reads, the largest id it reads); ``staged``: the buffer the compiled work list wrote (or
    None); ``tables_written``: the compiled work list wrote into ``workspace``'s host buffer; ``stage_table``: the
    back-end's staging of the block table into the workspace's host table (``stage_table(stage, table, rows, width,
    max_block_id) -> bool``; False: the workspace copies it). The caller checked ``workspace`` and
    ``device_block_table`` (:func:`check_workspace_args`) and marks the workspace's plans stale when this raises
    after a write (:meth:`PlanWorkspace.refused_after_writing`)."""
    if workspace is None:
        return _allocate_tables(work, inputs.table, inputs.width, num_qo_heads=num_qo_heads, head_dim=head_dim,
                                device=device, staged=staged)
    return _workspace_tables(work, inputs.table, inputs.width, workspace=workspace, num_tokens=inputs.num_tokens,
                             device_block_table=device_block_table, max_block_id=inputs.max_block_id,
                             tables_written=tables_written, stage_table=stage_table)


def check_workspace_args(*, workspace: PlanWorkspace | None, device_block_table: torch.Tensor | None,
                         device: torch.device, num_requests: int, width: int) -> None:
    """Refuse a ``workspace`` on another device than the plan's and a ``device_block_table`` without a workspace or
    too small for the batch's ``num_requests`` rows and ``width`` used blocks (:func:`_check_device_table`)."""
    if workspace is None:
        if device_block_table is not None:
            raise ValueError("device_block_table: expected a workspace too (the free plan() copies its own table), "
                             "got workspace=None")
        return
    if workspace.device is not device and not same_device(workspace.device, device):
        raise ValueError(f"workspace: expected the plan's device {device}, got a workspace on {workspace.device}")
    if device_block_table is not None:
        _check_device_table(device_block_table, (num_requests, width), workspace.device)


def metadata_to_device(work: WorkList, table: np.ndarray, width: int, device: torch.device, staged=None):
    """``(ranges, items, gather, mrows, block_table)`` on ``device``: one int32 host buffer, one copy (``ranges``: a
    ``[RANGE_FIELDS]`` view per work class).

    The block table's columns past every request's KV (``width`` on) are never read; columns the table lacks are 0.
    It joins the buffer when its ids fit in int32 (int32 tables always do: no scan), else it is copied as int64.
    ``staged``: ``(buffer, table_fits)`` the compiled planner already wrote in this layout.
    """
    items, gather, mrows = work.items, work.gather, work.mrows
    rows, cols = table.shape[0], min(width, table.shape[1])
    if staged is not None:  # the compiled work list wrote the buffer
        flat, table_fits = staged
    else:
        table_fits = table.dtype == np.int32 or rows * cols == 0 or int(table[:, :cols].max()) <= INT32_MAX
    # Section starts in the buffer: [ranges, items, gather, mrows, table], each 16-byte aligned (K.SECTION_ALIGN);
    # plain arithmetic (the list and accumulate it replaced cost ~3 us a free plan() on the 2-core host).
    n_items, n_gather, n_mrows = items.shape[0], gather.shape[0], mrows.shape[0]
    end_items = K.RANGES_SIZE + n_items * K.ITEM_FIELDS
    at_gather = K.section_end(end_items)
    at_mrows = K.section_end(at_gather + n_gather * K.GATHER_FIELDS)
    at_table = K.section_end(at_mrows + n_mrows * K.MROW_FIELDS)
    table_cols = width if table_fits else 0
    if staged is None:
        flat = np.empty(at_table + rows * table_cols, dtype=np.int32)
        flat[:K.RANGES_SIZE] = work.ranges_table().ravel()
        flat[K.RANGES_SIZE:end_items] = items.ravel()
        flat[end_items:at_gather] = 0  # the padding before each section
        end_gather = at_gather + n_gather * K.GATHER_FIELDS
        flat[at_gather:end_gather] = gather.ravel()
        flat[end_gather:at_mrows] = 0
        end_mrows = at_mrows + n_mrows * K.MROW_FIELDS
        flat[at_mrows:end_mrows] = mrows.ravel()
        flat[end_mrows:at_table] = 0
        if table_fits:
            _copy_table(flat[at_table:at_table + rows * width].reshape(rows, width), table, cols)
    # Views of one tensor: every table shares its storage (the interpreter copies a pointer argument's whole
    # storage; a tensor of a 0-element numpy slice has a 0-byte one). One as_strided per table (a split and five
    # views cost ~2x its torch calls).
    view = _to_device(flat, device).as_strided
    table_dev = view((rows, table_cols), (table_cols, 1), at_table)
    if not table_fits:
        table_i64 = np.empty((rows, width), dtype=np.int64)
        _copy_table(table_i64, table, cols)
        table_dev = _to_device(table_i64, device)
    ranges = tuple(view((K.RANGE_FIELDS,), (1,), c * K.RANGE_FIELDS) for c in range(K.NUM_CLASSES))
    return (ranges, view((n_items, K.ITEM_FIELDS), (K.ITEM_FIELDS, 1), K.RANGES_SIZE),
            view((n_gather, K.GATHER_FIELDS), (K.GATHER_FIELDS, 1), at_gather),
            view((n_mrows, K.MROW_FIELDS), (K.MROW_FIELDS, 1), at_mrows), table_dev)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` (on the CPU: the same memory). To a CUDA/HIP device through page-locked memory from
    PyTorch's caching host allocator, by one non-blocking copy on the current stream: a copy from pageable memory
    waits for the work queued on the stream, so the host could not plan the next step while the GPU runs this one.
    The allocator keeps the page-locked block until the copy has read it (the copy records an event for it); a
    launch on another stream must wait for the current one."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _copy_table(dst: np.ndarray, table: np.ndarray, cols: int) -> None:
    dst[:, :cols] = table[:, :cols]  # an int64 table reaches an int32 dst only when its largest id fits
    dst[:, cols:] = 0


def _allocate_tables(work: WorkList, table: np.ndarray, width: int, *, num_qo_heads: int, head_dim: int,
                     device: torch.device, staged=None) -> dict:
    """New device tensors for one plan (the free :func:`plan`): the metadata in one copy
    (:func:`metadata_to_device`), new workspace (uninitialized) and zeroed counters: the one reset of the plan's
    counters, which every launch leaves at zero (:func:`prefixattn.attention`)."""
    ranges, items, gather, mrows, table_dev = metadata_to_device(work, table, width, device, staged)
    ws_rows, n_mrows = work.num_ws_rows, work.mrows.shape[0]
    if ws_rows or n_mrows:  # (merge rows come with workspace rows; max() keeps every pointer valid regardless)
        counters = torch.zeros((max(n_mrows, 1), num_qo_heads), dtype=torch.int32, device=device)
        ws_o = torch.empty((max(ws_rows, 1), num_qo_heads, head_dim), dtype=torch.float32, device=device)
        ws_lse = torch.empty((max(ws_rows, 1), num_qo_heads), dtype=torch.float32, device=device)
    else:  # no rows merge: placeholders no launch touches
        counters, ws_o, ws_lse = _placeholders(device, num_qo_heads, head_dim)
    return dict(ranges=ranges, items=items, gather=gather, mrows=mrows, block_table=table_dev,
                counters=counters, ws_o=ws_o, ws_lse=ws_lse)


@functools.lru_cache(maxsize=None)
def _placeholders(device: torch.device, num_qo_heads: int, head_dim: int) -> tuple:
    """The counters ``[1, num_qo_heads]`` int32 and workspace ``[1, num_qo_heads, head_dim]``/``[1, num_qo_heads]``
    fp32 of plans in which no rows merge, one set per (device, head count, head size). No launch reads or writes them
    (programs merge nothing; without ``return_lse`` the kernel gets ``ws_lse`` as its unused lse pointer; no program
    reports on the counters and attention() zeroes them only where rows merge), so every such plan can share them: 3
    allocations less a plan (~6 us on the 2-core host; on a GPU 3 allocator calls). Shaped like a real workspace
    row, so their strides are a real workspace's: Triton specializes an int argument on ``== 1`` and ``% 16``, and
    ``[1, 1]`` placeholders (strides 1) made a step without merges compile other binaries than one with them."""
    return (torch.empty((1, num_qo_heads), dtype=torch.int32, device=device),
            torch.empty((1, num_qo_heads, head_dim), dtype=torch.float32, device=device),
            torch.empty((1, num_qo_heads), dtype=torch.float32, device=device))


class CapacityError(ValueError):
    """A step that does not fit a :class:`~prefixattn.planner.workspace.PlanWorkspace` (``capacity``: which one)."""

    def __init__(self, message: str, capacity: str) -> None:
        super().__init__(message)
        self.capacity = capacity


def _workspace_tables(work: WorkList, table: np.ndarray, width: int, *, workspace: PlanWorkspace, num_tokens: int,
                      device_block_table: torch.Tensor | None, max_block_id: int, tables_written: bool,
                      stage_table) -> dict:
    """The step's tables in ``workspace``'s fixed buffers: capacity checks, then one non-blocking copy. The block
    table's first ``width`` columns (the batch's used blocks; columns the table lacks are 0) are staged unless the
    kernel reads ``device_block_table``: by the back-end (``stage_table``), else by the workspace's own copy; the
    work list is written unless the compiled work list wrote it (``tables_written``)."""
    rows, cols = table.shape[0], min(width, table.shape[1])
    reason = workspace.overflow(num_requests=rows, num_tokens=num_tokens,
                                table_width=width if device_block_table is None else 0,
                                num_items=work.num_items, num_gather=work.gather.shape[0],
                                num_mrows=work.mrows.shape[0], num_ws_rows=work.num_ws_rows)
    if reason is not None:
        raise CapacityError(reason, reason.split(":", 1)[0])
    # The ids the kernel reads (the checks' max_block_id, no scan here: a scan of the bench's 256 x ~150 ids cost
    # ~6 us a step on the 2-core host) must fit the int32 staging table; cells past a request's own blocks are never
    # read (staged wrapped).
    if device_block_table is None and max_block_id > INT32_MAX:
        raise ValueError(f"block_table: expected block ids below 2**31 with a workspace (int32 table), got "
                         f"{max_block_id}")
    tables = dict(items=work.items, gather=work.gather, mrows=work.mrows, class_ends=work.class_ends,
                  tables_written=tables_written)
    if device_block_table is not None:
        dev = workspace.load(**tables, table=None, table_width=width)
        dev["block_table"] = device_block_table
        return dev
    if stage_table is not None and stage_table(workspace.host_table(), table, rows, width, max_block_id):
        return workspace.load(**tables, table=None, table_width=width, staged_rows=rows)
    used = table[:, :cols]  # a view: staged straight into the pinned buffer (no int64 copy first)
    return workspace.load(**tables, table=used, table_width=width)


def _check_device_table(t, used_shape: tuple[int, int], device: torch.device) -> None:
    """Refuse a ``device_block_table`` that is not a 2-D int32/int64 tensor with contiguous rows on ``device``
    covering ``used_shape`` (the batch's requests and used blocks)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"device_block_table: expected a 2-D int32/int64 tensor, got "
                         f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
                         f"{'' if not isinstance(t, torch.Tensor) else f' of shape {tuple(t.shape)}'}")
    if t.shape[0] < used_shape[0] or t.shape[1] < used_shape[1]:
        raise ValueError(f"device_block_table: expected at least {used_shape[0]} rows and {used_shape[1]} columns "
                         f"(the batch's requests and used blocks), got shape {tuple(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError(f"device_block_table: expected contiguous rows (stride 1 in dim 1), got strides {t.stride()}")
    if not same_device(t.device, device):
        raise ValueError(f"device_block_table: expected device {device} (the workspace's), got {t.device}")
