"""Layout of the fused kernel's int32 work tables: the one definition that the host (:mod:`prefixattn.planner.work_list`,
numpy) and the kernel (:mod:`prefixattn.kernels.prefix_attention_kernel`, Triton) both read. No triton import here,
so host code and tests can use the layout without loading the compiler.

Tables of one step (row-major int32, built once per step by :func:`prefixattn.plan`):

* ``ranges[NUM_CLASSES, RANGE_FIELDS]``: the items of each work class (:data:`WORK_CLASSES`). Items are stored class by
  class, and each class runs as its own launch with its own tiles, warps and occupancy: a launch reads its class's
  record (``[first item, end item)``) and its programs past the end exit at once, so a grid sized by capacity serves
  every smaller step. Records are 16 bytes apart (``RANGE_FIELDS`` int32): every record's address has the same
  alignment, so the launches of all classes share one pointer specialization.
* ``items[num_items, ITEM_FIELDS]``: one work item per row; within a class longest KV range first (LPT). A program is
  (item, KV head).
* ``gather[num_gather, GATHER_FIELDS]``: the packed query rows of SHARED items (rows of many requests).
* ``mrows[num_mrows, MROW_FIELDS]``: merge rows, one per query row that gets more than one partial state (shared
  levels, split-k chunks). State ``s`` of merge row ``r`` lives at workspace row
  ``mrows[r, MROW_WS_FIRST] + s * mrows[r, MROW_WS_STRIDE]``. Every program that produces a state of a merge row
  reports it on the row's counter (one per merge row and query head); the report that completes
  ``MROW_NUM_STATES`` merges that (row, head) in the same launch. Rows with one state write straight to ``out``.
"""

# Work-item kinds.
KIND_SHARED = 0  # every packed row of a shared prefix node against ONE copy of the node's KV range
KIND_SUFFIX = 1  # a tile of one request's consecutive query rows against its own KV range (causal near the end)

# Work classes: the kinds of program that get their own launch (tiles, warps, registers, so their own occupancy).
# A one-row decode tile must not pay the registers of a 128-row prefill tile, and a suffix program not those of a
# shared-node tile (an H100 sweep: a 256-decode step took 1184 us under the mixed step's config and 650 us under its
# own, bench/results/gpu/nvidia-h100-80gb-hbm3-82be9f2-tiles.csv). Launched in this order on one stream.
CLASS_SHARED = 0  # SHARED items: a shared node's packed rows against its KV range
CLASS_CHUNK = 1  # SUFFIX items of requests with more query rows than a decode tile holds (prefill chunks)
CLASS_DECODE = 2  # SUFFIX items of requests whose rows fit one decode tile (decode, short spec-decode verifies)
NUM_CLASSES = 3
WORK_CLASSES = ("shared", "chunk", "decode")

# Columns of ``ranges``.
RANGE_FIRST = 0  # first item of the class
RANGE_END = 1  # one past its last item
RANGE_FIELDS = 4  # 2 used + 2 padding: 16-byte records
RANGES_SIZE = NUM_CLASSES * RANGE_FIELDS  # int32 entries of the ranges table

# The metadata tables share one int32 buffer (ranges, items, gather, mrows, block table): each section starts at a
# multiple of SECTION_ALIGN entries (16 bytes). Triton specializes a pointer argument on its 16-byte alignment, so a
# section whose start moved with the step's item count made a later step compile another binary (H200, the warm-up
# test: a mixed step after the warm-up compiled 2 more).
SECTION_ALIGN = 4


def section_end(end: int) -> int:
    """``end`` (int32 entries) rounded up to the next section start."""
    return -(-end // SECTION_ALIGN) * SECTION_ALIGN


# Columns of ``items``.
ITEM_KIND = 0
ITEM_REQ = 1  # block-table row whose blocks hold the item's KV range (any member of a shared node)
ITEM_KV_START = 2
ITEM_KV_END = 3
ITEM_ROW_START = 4  # SHARED: first packed row in ``gather``; SUFFIX: token index of its first row
ITEM_NUM_ROWS = 5
ITEM_Q_POS = 6  # row j of the item sees KV positions <= q_pos + j
ITEM_DEST = 7  # SUFFIX: workspace row of its first row's state (row j: dest + j), or -1 = straight to ``out``
ITEM_MROW = 8  # SUFFIX with a workspace state: merge row of its first row (row j: mrow + j); else -1
ITEM_FIELDS = 9

# Columns of ``gather``.
GATHER_TOKEN = 0  # token index (row of q and out)
GATHER_WS_ROW = 1  # workspace row of this item's state of the row
GATHER_MROW = 2  # merge row of the row (shared rows always merge: they have a suffix or a deeper state too)
GATHER_FIELDS = 3

# Columns of ``mrows``.
MROW_WS_FIRST = 0
MROW_WS_STRIDE = 1
MROW_NUM_STATES = 2
MROW_FIELDS = 3

# Block sizes the kernel is compiled for as a constant (its ``PAGE_SIZE``): page and slot of a KV position become a
# shift and a mask instead of an integer divide and remainder per element. These are the sizes engines use: 1
# (SGLang's token pool), 16 (vLLM's default on GPUs), 32 (vLLM on CPU, FlashInfer), 64. Any other block size runs the
# generic binary (``PAGE_SIZE=0``: run-time ``block_size``); each specialized size is one more compile.
SPECIALIZED_PAGE_SIZES = (1, 16, 32, 64)


def page_size_constexpr(block_size: int) -> int:
    """The kernel's ``PAGE_SIZE`` for a cache with ``block_size`` tokens per block (0 = the generic binary)."""
    return block_size if block_size in SPECIALIZED_PAGE_SIZES else 0
