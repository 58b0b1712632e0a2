"""Benchmark batches: BatchLLM Fig. 8 shapes (full size for the GPU, scaled down for the CPU interpreter) and
FlashInfer's old cascade grid, built deterministically so a peer running in another process sees the same batch.

Fig. 8 labels a batch ``i/j/k``: shared-prefix length / distinct length per request / requests per prefix group
("all" = one group). Scenarios: pure decode with 32 and 256 requests, and mixed chunked prefill (7 prefill requests
whose distinct part is the query chunk) + 256 decodes.

The interpreter costs ~10 ms per program and more per KV tile, so the CPU shapes divide lengths by
:data:`LENGTH_SCALE`, request counts by :data:`REQUEST_SCALE` and use few heads; the ratios between providers'
bytes (what the suite reports) do not depend on the scale, only on the sharing structure, which is kept.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

#: CPU lengths = paper lengths / 32 (at least one block): the longest Fig. 8 prefix (32768) becomes 1024 tokens. A
#: peer that re-reads the prefix per request costs requests x prefix interpreter iterations: this keeps the slowest
#: shape at ~10 s per provider on this 2-core machine.
LENGTH_SCALE = 32
#: CPU request counts = paper counts / 16: 256 decodes -> 16; at least MIN_SCALED_REQUESTS (32 -> 4). Group sizes
#: scale the same way, at least 2 (a group of one shares nothing).
REQUEST_SCALE = 16
MIN_SCALED_REQUESTS = 4
#: Fig. 8 (prefix / distinct / per group), as the issue lists them; "all" = one group.
FIG8_SETTINGS = [(256, 2048, "all"), (2048, 256, 16), (8192, 128, 64), (32768, 128, 256)]
#: The mixed scenario's prefill requests (Fig. 8c); not scaled: it is already small.
FIG8_PREFILLS = 7
#: Batches with no sharing at all, for the "never worse than the best peer" target: (distinct length, requests).
NO_SHARING_SETTINGS = [(2048, 32), (256, 256)]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """One benchmark batch. ``per_group=0`` means every request in one group; ``shared=0`` means no sharing."""

    scenario: str  # "decode" | "mixed"
    num_decode: int
    num_prefill: int
    shared: int
    distinct: int
    per_group: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "float16"
    paper: str = ""  # the unscaled setting this shape stands for
    seed: int = 0

    @property
    def num_requests(self) -> int:
        return self.num_decode + self.num_prefill

    @property
    def name(self) -> str:
        group = "all" if self.per_group in (0, self.num_requests) else str(self.per_group)
        reqs = f"{self.num_prefill}p+{self.num_decode}d" if self.num_prefill else f"{self.num_decode}d"
        heads = f"h{self.num_qo_heads}:{self.num_kv_heads}"
        return f"{self.scenario}/{reqs}/{self.shared}-{self.distinct}-{group}/{heads}/d{self.head_dim}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Shape":
        return cls(**json.loads(text))


def fig8_shapes(*, scaled: bool = True, gqa: bool = False, head_dim: int | None = None,
                block_size: int = 16) -> list[Shape]:
    """Fig. 8: decode x {32, 256} requests and mixed 7 prefill + 256 decode, over :data:`FIG8_SETTINGS`, then
    :data:`NO_SHARING_SETTINGS`.

    ``scaled`` divides lengths by :data:`LENGTH_SCALE` and request/group counts by :data:`REQUEST_SCALE`, with 2 heads
    and head_dim 64 (interpreter); unscaled uses 32 heads and head_dim 128. ``gqa`` uses 8:1 heads (8:1 scaled,
    32:4 full size).
    """
    if scaled:
        qo, kv = (8, 1) if gqa else (2, 2)
    else:
        qo, kv = (32, 4) if gqa else (32, 32)
    d = head_dim or (64 if scaled else 128)
    length = (lambda t: max(block_size, t // LENGTH_SCALE)) if scaled else (lambda t: t)
    count = (lambda c: max(MIN_SCALED_REQUESTS, c // REQUEST_SCALE)) if scaled else (lambda c: c)
    group_size = (lambda c: max(2, c // REQUEST_SCALE)) if scaled else (lambda c: c)
    common = dict(num_qo_heads=qo, num_kv_heads=kv, head_dim=d, block_size=block_size)
    shapes = []
    for scenario, decodes, prefills in (("decode", 32, 0), ("decode", 256, 0), ("mixed", 256, FIG8_PREFILLS)):
        n_dec = count(decodes)
        for shared, distinct, group in FIG8_SETTINGS:
            per_group = 0 if group == "all" else group_size(group)
            per_group = 0 if per_group >= n_dec + prefills else per_group
            shapes.append(Shape(scenario=scenario, num_decode=n_dec, num_prefill=prefills, shared=length(shared),
                                distinct=length(distinct), per_group=per_group,
                                paper=f"{scenario}{decodes}:{shared}/{distinct}/{group}", **common))
    for distinct, decodes in NO_SHARING_SETTINGS:
        shapes.append(Shape(scenario="decode", num_decode=count(decodes), num_prefill=0, shared=0,
                            distinct=length(distinct), per_group=1, paper=f"decode{decodes}:0/{distinct}/1",
                            **common))
    return shapes


#: The interpreter traffic suite: Fig. 8 at MHA (2:2 heads) in full, and the GQA 8:1 variant on the 256-request
#: decode and mixed batches with sharing.
def _traffic_shapes() -> list[Shape]:
    return fig8_shapes() + [s for s in fig8_shapes(gqa=True) if s.num_decode > MIN_SCALED_REQUESTS and s.shared]


#: The part of the traffic grid a default ``pytest bench/`` runs, as (paper setting, GQA): every scenario, every
#: Fig. 8 setting, both no-sharing batches and both GQA scenarios at least once - all of decode256 and mixed at MHA,
#: two settings of decode32 and of each GQA scenario. The other 6 shapes carry the ``slow`` marker (``pytest -m slow``
#: or ``prefixattn bench --slow``): they repeat a pattern the default shapes show (decode32 = decode256 with fewer
#: requests) and hold ~30% of the grid's interpreter time (the two GQA 32768-token prefixes alone ~15%).
TRAFFIC_DEFAULT = {
    ("decode32:2048/256/16", False), ("decode32:8192/128/64", False),
    *((f"{scenario}256:{shared}/{distinct}/{group}", False) for scenario in ("decode", "mixed")
      for shared, distinct, group in FIG8_SETTINGS),
    *((f"decode{decodes}:0/{distinct}/1", False) for distinct, decodes in NO_SHARING_SETTINGS),
    ("decode256:256/2048/all", True), ("decode256:8192/128/64", True),
    ("mixed256:2048/256/16", True), ("mixed256:8192/128/64", True),
}


def in_default_traffic_grid(shape: Shape) -> bool:
    """Whether a default (not ``-m slow``) run measures ``shape``'s traffic."""
    return (shape.paper, shape.num_qo_heads != shape.num_kv_heads) in TRAFFIC_DEFAULT


def flashinfer_cascade_grid() -> list[Shape]:
    """FlashInfer's old cascade benchmark: batch 1..256 x shared 1024..32768 x unique 128..2048, 32 heads, d=128,
    one group (GPU only: far too large for the interpreter)."""
    shapes = []
    for batch in (1, 16, 64, 256):
        for shared in (1024, 8192, 32768):
            for unique in (128, 512, 2048):
                shapes.append(Shape(scenario="decode", num_decode=batch, num_prefill=0, shared=shared,
                                    distinct=unique, per_group=0, num_qo_heads=32, num_kv_heads=32, head_dim=128,
                                    paper=f"flashinfer:{batch}/{shared}/{unique}"))
    return shapes


@dataclass
class Batch:
    """A paged batch: q ``[T, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]``, ragged metadata (int32)."""

    shape: Shape
    qo_indptr: torch.Tensor  # [R + 1]
    kv_lens: torch.Tensor  # [R]
    block_table: torch.Tensor  # [R, max_blocks]
    groups: list  # per group: (request ids, shared tokens)
    num_blocks: int
    dtype: torch.dtype
    q: torch.Tensor | None = None  # None with metadata_only
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None

    @property
    def q_lens(self) -> np.ndarray:
        return np.diff(self.qo_indptr.cpu().numpy())

    def kv_slots(self, r: int) -> np.ndarray:
        """Flat token slots (``block * block_size + offset``) of request ``r``'s KV positions, in order."""
        bs = self.shape.block_size
        pos = np.arange(int(self.kv_lens[r]))
        return self.block_table[r].cpu().numpy()[pos // bs].astype(np.int64) * bs + pos % bs

    def unique_kv_bytes(self) -> int:
        """Lower bound: every distinct KV position of the batch read once, K and V, all KV heads.

        A request uses slots ``0 .. used-1`` of each of its blocks, so a block holds ``max(used)`` distinct positions
        over the requests listing it.
        """
        s = self.shape
        table = self.block_table.cpu().numpy().astype(np.int64)
        width = table.shape[1]
        used = np.clip(self.kv_lens.cpu().numpy()[:, None].astype(np.int64) - np.arange(width) * s.block_size, 0,
                       s.block_size)
        per_block = np.zeros(self.num_blocks, dtype=np.int64)
        np.maximum.at(per_block, table.ravel(), used.ravel())
        return int(per_block.sum()) * s.num_kv_heads * s.head_dim * 2 * self.dtype.itemsize


def build_batch(shape: Shape, device: str = "cpu", *, metadata_only: bool = False) -> Batch:
    """Lay a batch out as a paged prefix cache would: each group's shared prefix in blocks every member lists, then
    per-request blocks for the distinct tokens; physical block ids shuffled. Prefill requests come first; a prefill
    request's query chunk is its distinct part, a decode's is its last token. ``metadata_only`` skips q and the
    caches (full-size shapes for plan() alone)."""
    if shape.shared % shape.block_size:
        raise ValueError(f"shared: expected a multiple of block_size {shape.block_size}, got {shape.shared}")
    g = torch.Generator().manual_seed(shape.seed)
    rng = np.random.default_rng(shape.seed)
    bs, n = shape.block_size, shape.num_requests
    per_group = shape.per_group or n
    q_lens = [shape.distinct] * shape.num_prefill + [1] * shape.num_decode
    kv_len = shape.shared + shape.distinct
    shared_blocks = shape.shared // bs
    own_blocks = math.ceil(kv_len / bs) - shared_blocks
    rows, groups, next_block = [], [], 0
    for start in range(0, n, per_group):
        members = list(range(start, min(start + per_group, n)))
        prefix = list(range(next_block, next_block + shared_blocks))
        next_block += shared_blocks
        groups.append((members, shape.shared if len(members) > 1 else 0))
        for _ in members:
            rows.append(prefix + list(range(next_block, next_block + own_blocks)))
            next_block += own_blocks
    num_blocks = next_block
    perm = rng.permutation(num_blocks)
    table = torch.tensor(perm[np.array(rows)], dtype=torch.int32)
    dtype = DTYPES[shape.dtype]
    qo_indptr = torch.tensor(np.r_[0, np.cumsum(q_lens)], dtype=torch.int32)
    kv_lens = torch.full((n,), kv_len, dtype=torch.int32)
    meta = dict(shape=shape, qo_indptr=qo_indptr.to(device), kv_lens=kv_lens.to(device),
                block_table=table.to(device), groups=groups, num_blocks=num_blocks, dtype=dtype)
    if metadata_only:
        return Batch(**meta)
    if torch.device(device).type != "cpu":
        # Full-size GPU batches hold gigabytes of KV: draw them on the device (deterministic there, not equal to the
        # CPU draw; every provider of a run sees the same tensors either way).
        g = torch.Generator(device=device).manual_seed(shape.seed)
    draw = lambda *size: torch.randn(*size, generator=g, device=g.device).to(dtype)  # noqa: E731
    q = draw(sum(q_lens), shape.num_qo_heads, shape.head_dim)
    k_cache = draw(num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    v_cache = draw(num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    return Batch(q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device), **meta)


TRAFFIC_SHAPES = _traffic_shapes()
