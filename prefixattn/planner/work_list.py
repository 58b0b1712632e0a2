"""The flat work list of one step: shared-node tiles, per-request suffix tiles, split-k chunks and merge units.

The planner's stage after the choice (:mod:`prefixattn.planner.choose`): the chosen candidate's nodes and split
(:mod:`prefixattn.planner.split_rule`) become the kernel's tables. Numpy, built on the host by :func:`prefixattn.plan`
(the compiled work list, :mod:`prefixattn.planner.compiled.work_list`, writes the same tables); the table layout (column
indices) is :mod:`prefixattn.kernels.layout`, shared with the kernel. Vectorized over requests, shared nodes and tiles:
no Python loop.

Vocabulary
----------
* suffix tile: up to ``rows_per_chunk`` consecutive query rows of one request; its KV range runs from the end of the
  request's deepest shared node to the last position its rows see (causal) or to ``kv_len``. A request with at most
  ``rows_per_decode`` query rows has one tile of the decode class, the others tiles of the chunk class
  (:data:`prefixattn.kernels.layout.WORK_CLASSES`).
* work class: the items of one launch (shared items; chunk tiles; decode tiles), stored class by class, longest KV
  range first within a class (LPT: the long programs start in the first wave, short ones fill the tail), the items
  of one prefix run together (below).
* prefix run: neighbouring requests (in the batch's order) outside every shared node that read one prefix
  (:func:`prefix_runs`). Their suffix items read that prefix each; issued together, the later ones find it in L2.
  Within a class a run's items sit together, at the place of its longest item (LPT between runs, longest first
  inside one). Modeled only (:mod:`prefixattn.sim.l2_reuse`'s stack distances, H200 preset, default constants):
  BatchLLM case 1's decode steps planned unshared (~1K-token documents read by ~7 requests each, 263 and 143
  requests) take 10.5 and 6.6 ms of attention over 32 layers in this order, 13.4 and 7.7 in plain LPT.
* merge unit: the rows of one suffix tile when they get more than one partial state (shared levels, split chunks);
  state ``s`` of the unit lives at workspace rows ``ws_base + s * num_rows + row``. Rows with a single state (no
  sharing, no split) have no unit: their item writes straight to ``out``, as plain paged attention does.
* merge row: one row of a merge unit, as the kernel sees it (``mrows`` table): where its states live and how many
  there are. Every state of a merge row is written by exactly one program per query head, so the kernel counts
  arrivals per (merge row, query head) and the arrival that completes the count merges that row and head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixattn.kernels import layout as K
from prefixattn.ragged import expand as _expand, run_starts, runs_longest_first
from prefixattn.planner.split_rule import Split, Tiles

_I32 = np.int32


@dataclass(frozen=True)
class SharedNode:
    """A shared prefix node chosen by the planner: KV positions ``[kv_start, kv_end)`` of every request in
    ``requests`` (ascending) live in the same physical blocks, and every query row of those requests sees them all."""

    kv_start: int
    kv_end: int
    requests: np.ndarray
    depth_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.kv_end - self.kv_start


#: SharedNodes and WorkList: plain slotted dataclasses, built once per plan step (not frozen: a frozen dataclass sets
#: each field through object.__setattr__, ~0.6 us a construction against ~0.2; ~1.5 us of a 256-decode engine step on
#: the 2-core host for the two). Their arrays are mutable either way; nothing changes them after the planner.
@dataclass(slots=True)
class SharedNodes:
    """The kept shared nodes as flat arrays, top-down (a node before its descendants).

    Node ``k`` covers KV ``[kv_start[k], kv_end[k])`` of requests ``members[offsets[k]:offsets[k + 1]]``
    (ascending).
    """

    kv_start: np.ndarray  # [num_nodes] int64
    kv_end: np.ndarray  # [num_nodes] int64
    depth_blocks: np.ndarray  # [num_nodes] int64
    offsets: np.ndarray  # [num_nodes + 1] int64
    members: np.ndarray  # [num_memberships] int64

    def __len__(self) -> int:
        return int(self.kv_start.shape[0])

    @staticmethod
    def empty() -> "SharedNodes":
        z = np.zeros(0, dtype=np.int64)
        return SharedNodes(kv_start=z, kv_end=z, depth_blocks=z, offsets=np.zeros(1, dtype=np.int64), members=z)

    def to_list(self) -> list[SharedNode]:
        return [SharedNode(kv_start=int(self.kv_start[k]), kv_end=int(self.kv_end[k]),
                           requests=self.members[self.offsets[k]:self.offsets[k + 1]],
                           depth_blocks=int(self.depth_blocks[k])) for k in range(len(self))]


@dataclass(slots=True)
class WorkList:
    """Host arrays of one step's work (int32, kernel column layout)."""

    items: np.ndarray  # [num_items, ITEM_FIELDS], class by class, longest KV range first within a class
    gather: np.ndarray  # [num_gather, GATHER_FIELDS]
    mrows: np.ndarray  # [num_mrows, MROW_FIELDS]
    num_ws_rows: int
    num_units: int  # merge units (suffix tiles whose rows merge); their rows are the merge rows
    class_ends: tuple  # [NUM_CLASSES] ints: one past the last item of each work class (layout.CLASS_* order)
    #: [NUM_CLASSES, 2] float64, modeled: each class's launch (makespan_us, its programs' time over the slots)
    modeled_us: np.ndarray

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])

    def class_range(self, work_class: int) -> tuple[int, int]:
        """``[first, end)`` items of ``work_class`` (a ``layout.CLASS_*`` index)."""
        return (self.class_ends[work_class - 1] if work_class else 0), self.class_ends[work_class]

    def ranges_table(self) -> np.ndarray:
        """The kernel's ``ranges`` table ``[NUM_CLASSES, RANGE_FIELDS]`` int32 (padding entries 0)."""
        return ranges_table(self.class_ends)


def ranges_table(class_ends) -> np.ndarray:
    """``ranges[NUM_CLASSES, RANGE_FIELDS]`` int32 of the item ends of each class (:mod:`prefixattn.kernels.layout`)."""
    r = np.zeros((K.NUM_CLASSES, K.RANGE_FIELDS), dtype=_I32)
    r[1:, K.RANGE_FIRST] = class_ends[:-1]
    r[:, K.RANGE_END] = class_ends
    return r


def _piece_bounds(lo, hi, piece, pieces, block_n: int, split: bool = True):
    """[start, end) of piece ``piece`` of ``pieces`` over [lo, hi): whole KV tiles dealt out evenly (the last piece
    takes the partial tile), so pieces differ by at most one tile. ``split=False``: one piece per range. ``block_n``
    is the split grain (:func:`prefixattn.planner.split_rule.split_grain`): the KV tile, or a fraction of it."""
    if not split:
        return lo, hi
    tiles = -(-(hi - lo) // block_n)
    start = lo + (piece * tiles // pieces) * block_n
    end = np.minimum(lo + ((piece + 1) * tiles // pieces) * block_n, hi)
    return start, end


def _slot_bases(*, mem_req: np.ndarray, mem_pieces: np.ndarray) -> np.ndarray:
    """Per membership (node-major order), the pieces of the earlier nodes holding the same request: an exclusive
    cumsum within each request's memberships."""
    by_req = np.argsort(mem_req, kind="stable")
    pieces = mem_pieces[by_req]
    csum = pieces.cumsum() - pieces
    reqs = mem_req[by_req]
    run_start = run_starts(reqs)
    base = np.empty_like(mem_req)
    base[by_req] = csum - csum[run_start][run_start.cumsum() - 1]
    return base


@dataclass(frozen=True)
class _TileStates:
    """Per suffix tile: its partial states and whether its rows merge."""

    shared: np.ndarray | int  # shared states of the tile's request (0 without nodes)
    pieces: np.ndarray  # split-k pieces of the tile's own KV range
    needs_unit: np.ndarray  # bool: more than one state, so the rows merge
    mem_slot_base: np.ndarray | None  # per membership: its first shared state (None without nodes)


def _tile_states(*, t: Tiles, nodes: SharedNodes, n_pieces: np.ndarray, t_pieces: np.ndarray,
                 num_reqs: int) -> _TileStates:
    """States per request and which tiles merge. A request's shared states are numbered node by node (top-down):
    its slot base in node k is the number of pieces of the earlier nodes that hold it."""
    if not len(nodes):
        return _TileStates(shared=0, pieces=t_pieces, needs_unit=t_pieces > 1, mem_slot_base=None)
    mem_req = nodes.members
    mem_pieces = n_pieces.repeat(nodes.offsets[1:] - nodes.offsets[:-1])
    shared_states = np.bincount(mem_req, weights=mem_pieces, minlength=num_reqs).astype(np.int64)
    # A request in one node only (one level of sharing) has its shared states from slot 0.
    nested = bool(np.bincount(mem_req, minlength=num_reqs).max() > 1)
    t_shared = shared_states[t.req]
    slot_base = _slot_bases(mem_req=mem_req, mem_pieces=mem_pieces) if nested else np.zeros_like(mem_req)
    return _TileStates(shared=t_shared, pieces=t_pieces, needs_unit=(t_shared > 0) | (t_pieces > 1),
                       mem_slot_base=slot_base)


@dataclass(frozen=True)
class _MergeUnits:
    """The merge units (tiles whose rows merge), their workspace rows and their merge rows."""

    num_units: int
    num_ws_rows: int
    mrows: np.ndarray  # [num_mrows, MROW_FIELDS] int32
    tile_ws_base: np.ndarray | None  # [num_tiles] first workspace row of each tile's unit, -1 if none
    tile_mrow_base: np.ndarray | None  # [num_tiles] first merge row of each tile's unit, -1 if none


def _merge_units(*, t: Tiles, states: _TileStates) -> _MergeUnits:
    unit_tiles = states.needs_unit.nonzero()[0]
    num_units = unit_tiles.shape[0]
    if not num_units:  # no tile merges
        return _MergeUnits(num_units=0, num_ws_rows=0, mrows=np.zeros((0, K.MROW_FIELDS), dtype=_I32),
                           tile_ws_base=None, tile_mrow_base=None)
    num_tiles = t.req.shape[0]
    unit_rows = t.rows[unit_tiles]
    unit_states = (states.shared + states.pieces)[unit_tiles]
    unit_ws = unit_states * unit_rows
    unit_ws_base = unit_ws.cumsum() - unit_ws
    unit_mrow_base = unit_rows.cumsum() - unit_rows
    tile_ws_base = np.full(num_tiles, -1, dtype=np.int64)
    tile_ws_base[unit_tiles] = unit_ws_base
    tile_mrow_base = np.full(num_tiles, -1, dtype=np.int64)
    tile_mrow_base[unit_tiles] = unit_mrow_base
    # Merge rows: the rows of the units, unit by unit; a unit's row i is merge row tile_mrow_base[tile] + i.
    m_unit, m_i = _expand(unit_rows)
    mrows = np.empty((m_unit.shape[0], K.MROW_FIELDS), dtype=_I32)
    mrows[:, K.MROW_WS_FIRST] = unit_ws_base[m_unit] + m_i
    mrows[:, K.MROW_WS_STRIDE] = unit_rows[m_unit]
    mrows[:, K.MROW_NUM_STATES] = unit_states[m_unit]
    return _MergeUnits(num_units=num_units, num_ws_rows=int(unit_ws_base[-1] + unit_ws[-1]), mrows=mrows,
                       tile_ws_base=tile_ws_base, tile_mrow_base=tile_mrow_base)


def prefix_runs(table: np.ndarray, kv_len: np.ndarray, members: np.ndarray, block_size: int) -> np.ndarray:
    """``[num_requests]`` int64: the first request of each request's prefix run (its own index when it is in none).

    Requests ``r - 1`` and ``r`` (``table``'s rows, ``kv_len`` their KV) are in one run when neither is a member of a
    shared node (``members``: the nodes' members; a node reads its prefix once) and both hold the same block at the
    middle of the shorter one's blocks: in a prefix cache a block id names its whole prefix (vLLM's block hashes
    chain their parents; SGLang's radix tree), so they share at least half of the shorter one's KV. One read per
    request; a false match (a window's null blocks) only moves items in the order, never what they compute."""
    n = kv_len.shape[0]
    run = np.arange(n, dtype=np.int64)
    if n < 2:
        return run
    blocks = -(-kv_len.astype(np.int64) // block_size)
    shorter = np.minimum(blocks[1:], blocks[:-1])
    col = np.maximum(shorter - 1, 0) // 2
    alone = np.zeros(n, dtype=bool)
    alone[members] = True
    rows = np.flatnonzero((shorter > 0) & ~alone[1:] & ~alone[:-1]) + 1  # only these have a column to compare
    joins = np.zeros(n - 1, dtype=bool)
    joins[rows - 1] = table[rows, col[rows - 1]] == table[rows - 1, col[rows - 1]]
    if not joins.any():
        return run
    run[1:][joins] = 0
    return np.maximum.accumulate(run)


def build_work_list(nodes: SharedNodes, split: Split, *, q_start: np.ndarray, q_len: np.ndarray,
                    rows_per_shared: int, rows_per_chunk: int, runs: np.ndarray | None = None) -> WorkList:
    """The work list of the chosen candidate: its nodes (top-down: a node before its descendants; a request's states
    are numbered in that order, shared levels with their split pieces, then the suffix pieces) and its split
    (:func:`prefixattn.planner.split_rule.split_work`: the suffix tiles, every node's and tile's pieces, the modeled
    launches). ``runs``: :func:`prefix_runs` (None: every request alone)."""
    t, nr = split.tiles, split.rows
    states = _tile_states(t=t, nodes=nodes, n_pieces=split.node_pieces, t_pieces=split.tile_pieces,
                          num_reqs=q_len.shape[0])
    units = _merge_units(t=t, states=states)
    if len(nodes):
        shared_items, gather = _shared_items(
            t=t, nodes=nodes, node_rows=nr.node_rows, node_mtiles=nr.node_mtiles, n_pieces=split.node_pieces,
            grain_shared=split.shared_grain, mem_ql=nr.mem_ql, row_off=nr.row_off, mem_slot_base=states.mem_slot_base,
            tile_ws_base=units.tile_ws_base, tile_mrow_base=units.tile_mrow_base, q_start=q_start,
            rows_per_suffix=rows_per_chunk, rows_per_shared=rows_per_shared)
    else:  # plain paged attention: skip ~30 numpy calls on empty arrays
        shared_items = np.zeros((0, K.ITEM_FIELDS), dtype=_I32)
        gather = np.zeros((0, K.GATHER_FIELDS), dtype=_I32)
    items, class_ends = _assemble_items(shared_items=shared_items, t=t, states=states, units=units,
                                        grains=split.tile_grains, has_nodes=bool(len(nodes)), runs=runs)
    return WorkList(items=items, gather=gather, mrows=units.mrows, num_ws_rows=units.num_ws_rows,
                    num_units=units.num_units, class_ends=class_ends, modeled_us=split.modeled)


def _assemble_items(*, shared_items: np.ndarray, t: Tiles, states: _TileStates, units: _MergeUnits,
                    grains: tuple, has_nodes: bool, runs: np.ndarray | None) -> tuple[np.ndarray, tuple]:
    """The item table and each class's end: the shared items, then the suffix items (suffix tile, split chunk) of
    the chunk class and of the decode class, longest KV range first within each class, a prefix run's items
    together (``runs``: :func:`prefix_runs`). ``grains``: the split grain of the chunk class and of the decode
    class."""
    t_pieces = states.pieces
    s_decode = t.decode
    if t.req.shape[0] and t_pieces.min() == 1 and t_pieces.max() == 1:  # one item per tile: no gathers
        s_c = 0
        s_lo, s_hi, s_req, s_tok0, s_rows, s_qpos = t.lo, t.hi, t.req, t.tok0, t.rows, t.qpos
        s_unit, s_ws_base, s_mrow_base = states.needs_unit, units.tile_ws_base, units.tile_mrow_base
        s_shared = states.shared
    else:
        s_tile, s_c = _expand(t_pieces)
        if isinstance(s_decode, np.ndarray):
            s_decode = s_decode[s_tile]
            grain = np.where(s_decode, grains[1], grains[0])
        else:
            grain = grains[1] if s_decode else grains[0]
        s_lo, s_hi = _piece_bounds(lo=t.lo[s_tile], hi=t.hi[s_tile], piece=s_c, pieces=t_pieces[s_tile],
                                   block_n=grain, split=bool(s_c.shape[0] and s_c.any()))
        s_req, s_tok0, s_rows, s_qpos = t.req[s_tile], t.tok0[s_tile], t.rows[s_tile], t.qpos[s_tile]
        if units.num_units:
            s_unit = states.needs_unit[s_tile]
            s_ws_base, s_mrow_base = units.tile_ws_base[s_tile], units.tile_mrow_base[s_tile]
            s_shared = states.shared[s_tile] if has_nodes else 0
    num_suffix, num_shared = s_req.shape[0], shared_items.shape[0]
    it = np.empty((num_suffix + num_shared, K.ITEM_FIELDS), dtype=_I32)
    it[:num_shared] = shared_items
    su = it[num_shared:]
    su[:, K.ITEM_KIND] = K.KIND_SUFFIX
    su[:, K.ITEM_REQ] = s_req
    su[:, K.ITEM_KV_START] = s_lo
    su[:, K.ITEM_KV_END] = s_hi
    su[:, K.ITEM_ROW_START] = s_tok0
    su[:, K.ITEM_NUM_ROWS] = s_rows
    su[:, K.ITEM_Q_POS] = s_qpos
    if units.num_units:
        su[:, K.ITEM_DEST] = np.where(s_unit, s_ws_base + (s_shared + s_c) * s_rows, -1)
        su[:, K.ITEM_MROW] = np.where(s_unit, s_mrow_base, -1)
    else:
        su[:, K.ITEM_DEST:K.ITEM_MROW + 1] = -1
    # Class by class (shared, chunk, decode), longest KV range first within a class (LPT). One int64 key, class in
    # the high bits; a stable sort of a table already in that order is the identity (a decode step of equal
    # lengths): skipped.
    key = np.empty(num_shared + num_suffix, dtype=np.int64)
    key[:num_shared] = K.CLASS_SHARED
    key[num_shared:] = np.where(s_decode, K.CLASS_DECODE, K.CLASS_CHUNK)
    num_decode = int(np.count_nonzero(key[num_shared:] == K.CLASS_DECODE))
    n = num_shared + num_suffix
    length = it[:, K.ITEM_KV_END].astype(np.int64) - it[:, K.ITEM_KV_START]  # in [0, 2^31)
    if runs is not None and num_suffix:
        in_run = np.bincount(runs, minlength=runs.shape[0])[runs] > 1  # per request: in a run of >= 2
        if in_run.any():
            group = runs.shape[0] + np.arange(n)  # alone: a group of its own, after every run's id
            group[num_shared:] = np.where(in_run[s_req], runs[s_req], group[num_shared:])
            return it[runs_longest_first(length, group, key)], (num_shared, n - num_decode, n)
    key <<= 32
    key -= length
    if key.shape[0] > 1 and (key[1:] < key[:-1]).any():
        it = it[np.argsort(key, kind="stable")]
    return it, (num_shared, n - num_decode, n)


def _shared_items(*, t: Tiles, nodes: SharedNodes, node_rows, node_mtiles, n_pieces, grain_shared, mem_ql, row_off,
                  mem_slot_base, tile_ws_base, tile_mrow_base, q_start, rows_per_suffix, rows_per_shared):
    """Shared items (node, split chunk, M tile of packed rows) and their gather rows (int32 tables)."""
    mem_req = nodes.members
    # Packed rows of each node: its members' query rows, request by request.
    row_mem, row_i = _expand(mem_ql)
    row_req = mem_req[row_mem]
    tok = q_start[row_req] + row_i
    tile = t.first[row_req] + row_i // rows_per_suffix
    in_tile = row_i % rows_per_suffix
    tile_rows = t.rows[tile]
    ws0 = tile_ws_base[tile] + mem_slot_base[row_mem] * tile_rows + in_tile
    mrow = tile_mrow_base[tile] + in_tile
    # One segment per (node, split piece): it repeats the node's packed rows.
    split = bool((n_pieces > 1).any())
    if split:
        seg_node, seg_c = _expand(n_pieces)
        seg_rows = node_rows[seg_node]
        g_seg, g_i = _expand(seg_rows)
        g_row = row_off[nodes.offsets[:-1]][seg_node][g_seg] + g_i
        gather = np.empty((g_row.shape[0], K.GATHER_FIELDS), dtype=_I32)
        gather[:, K.GATHER_TOKEN] = tok[g_row]
        gather[:, K.GATHER_WS_ROW] = ws0[g_row] + seg_c[g_seg] * tile_rows[g_row]
        gather[:, K.GATHER_MROW] = mrow[g_row]
    else:  # one segment per node (n_pieces is 1: nodes have KV): the packed rows in order, no gathers
        seg_node, seg_c, seg_rows = np.arange(node_rows.shape[0], dtype=np.int64), 0, node_rows
        gather = np.empty((tok.shape[0], K.GATHER_FIELDS), dtype=_I32)
        gather[:, K.GATHER_TOKEN] = tok
        gather[:, K.GATHER_WS_ROW] = ws0
        gather[:, K.GATHER_MROW] = mrow
    seg_gather_off = seg_rows.cumsum() - seg_rows
    i_seg, i_mt = _expand(node_mtiles[seg_node])
    i_node, i_c = seg_node[i_seg], (seg_c[i_seg] if split else 0)
    kv_lo, kv_hi = _piece_bounds(lo=nodes.kv_start[i_node], hi=nodes.kv_end[i_node], piece=i_c,
                                 pieces=n_pieces[i_node], block_n=grain_shared, split=split)
    node_end = nodes.kv_end[i_node]
    items = np.empty((i_seg.shape[0], K.ITEM_FIELDS), dtype=_I32)
    items[:, K.ITEM_KIND] = K.KIND_SHARED
    items[:, K.ITEM_REQ] = mem_req[nodes.offsets[:-1][i_node]]  # any member: same blocks
    items[:, K.ITEM_KV_START] = kv_lo
    items[:, K.ITEM_KV_END] = kv_hi
    items[:, K.ITEM_ROW_START] = seg_gather_off[i_seg] + i_mt * rows_per_shared
    items[:, K.ITEM_NUM_ROWS] = np.minimum(rows_per_shared, node_rows[i_node] - i_mt * rows_per_shared)
    items[:, K.ITEM_Q_POS] = node_end
    items[:, K.ITEM_DEST:K.ITEM_MROW + 1] = -1
    return items, gather
