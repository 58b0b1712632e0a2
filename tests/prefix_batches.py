"""Random paged batches with REAL prefix sharing (identical leading block ids) and the tree they were built from.

A batch is built as a paged engine's prefix cache would lay it out: a tree of shared prefixes (system prompt >
document > ...), each tree node owning whole physical blocks that every request under it lists in its block table,
then per-request blocks for the rest of its KV. Physical block ids are shuffled so the table is a real indirection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int

    @property
    def metadata(self):
        return self.qo_indptr, self.kv_lens, self.block_table

    @property
    def heads(self):
        return dict(num_qo_heads=self.q.shape[1], num_kv_heads=self.k_cache.shape[2], head_dim=self.q.shape[2],
                    block_size=self.block_size)



def on_device(b: Batch, device) -> Batch:
    """``b`` with every tensor moved to ``device`` (in place; returns it)."""
    for name in ("q", "k_cache", "v_cache", "qo_indptr", "kv_lens", "block_table"):
        setattr(b, name, getattr(b, name).to(device))
    return b


#: The model switches a kernel variant is tested under: ``(plan() options, attention() options)``, the latter by the
#: name of the ones :func:`model_switch_call` builds for a batch; pytest ids in :data:`MODEL_SWITCH_IDS`.
MODEL_SWITCHES = [(dict(logits_soft_cap=2.0), {}), (dict(window_left=5), {}), ({}, "sinks"), ({}, "fp8")]
MODEL_SWITCH_IDS = ["soft-cap", "window", "sinks", "fp8"]


def model_switch_call(b: Batch, call, device) -> dict:
    """attention()'s options of a :data:`MODEL_SWITCHES` entry for ``b``: a sink per query head, or per-tensor scales
    with ``b``'s caches made fp8 (e4m3) in place."""
    if call == "sinks":
        return dict(sinks=torch.linspace(-1.0, 3.0, b.q.shape[1], device=device))
    if call == "fp8":
        b.k_cache, b.v_cache = (b.k_cache * 4).to(torch.float8_e4m3fn), (b.v_cache * 2).to(torch.float8_e4m3fn)
        return dict(k_scale=0.25, v_scale=torch.tensor([0.5], device=device))
    return call


def check_against_reference(b: Batch, p, **call) -> None:
    """``prefixattn.attention`` of the batch with plan ``p`` (and ``call``'s sinks or scales) against the reference
    with the plan's soft cap and window: output (its shape too) and LSE, at the dtype's tolerances."""
    from prefixattn import attention, reference_attention
    from tests.tolerances import ATTENTION_TOL, LSE_TOL

    ref_kw = {k: v for k, v in (("logits_soft_cap", p.logits_soft_cap or None),
                                ("window_left", p.window_left if p.window_left >= 0 else None)) if v is not None}
    got = attention(b.q, b.k_cache, b.v_cache, p, return_lse=True, **call)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True, **ref_kw, **call)
    assert got[0].shape == want[0].shape
    atol, rtol = ATTENTION_TOL[b.q.dtype]
    torch.testing.assert_close(got[0].float(), want[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(got[1], want[1], atol=LSE_TOL[0], rtol=LSE_TOL[1])


def make_batch(seed: int, *, q_lens, extra_lens, paths, level_blocks, block_size: int, num_qo_heads: int,
               num_kv_heads: int, head_dim: int, dtype=torch.float32, spare_blocks: int = 3) -> Batch:
    """Build a batch from an explicit sharing tree.

    Parameters
    ----------
    q_lens, extra_lens : list[int]
        Per request: query rows, and KV tokens after its shared prefix (``kv_len = shared + extra``; when
        ``extra < q_len`` the queries start inside the shared blocks, which the planner must cap).
    paths : list[tuple]
        Per request, its path of tree-node names from the root, e.g. ``("sys", "doc1")``; ``()`` shares nothing.
    level_blocks : dict
        Blocks owned by each tree-node name (whole blocks, as a prefix cache shares them).
    """
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_reqs = len(q_lens)
    next_block = 0
    node_blocks: dict = {}
    for path in paths:
        for depth in range(1, len(path) + 1):
            key = path[:depth]
            if key not in node_blocks:
                n = level_blocks[path[depth - 1]]
                node_blocks[key] = list(range(next_block, next_block + n))
                next_block += n
    rows, kv_lens = [], []
    for r in range(num_reqs):
        shared = [b for d in range(1, len(paths[r]) + 1) for b in node_blocks[paths[r][:d]]]
        kv_len = len(shared) * block_size + extra_lens[r]
        assert kv_len >= q_lens[r], "a request's KV includes its queries"
        own = -(-kv_len // block_size) - len(shared)
        own_blocks = list(range(next_block, next_block + max(own, 0)))
        next_block += max(own, 0)
        rows.append(shared + own_blocks)
        kv_lens.append(kv_len)
    num_blocks = next_block + spare_blocks
    perm = rng.permutation(num_blocks)
    width = max(1, max(len(r) for r in rows))
    table = np.zeros((num_reqs, width), dtype=np.int64)
    for r, row in enumerate(rows):
        table[r, :len(row)] = perm[row]
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_qo_heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    qo_indptr = torch.tensor(np.r_[0, np.cumsum(q_lens)], dtype=torch.int32)
    return Batch(q=q, k_cache=k_cache, v_cache=v_cache, qo_indptr=qo_indptr,
                 kv_lens=torch.tensor(kv_lens, dtype=torch.int32), block_table=torch.tensor(table, dtype=torch.int32),
                 block_size=block_size)


def random_batch(seed: int, *, num_requests: int, levels: int, block_size: int, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, dtype=torch.float32, max_q_len: int = 40,
                 decode_fraction: float = 0.5, max_level_blocks: int = 3, max_extra: int = 24) -> Batch:
    """A random batch with ``levels`` (0-3) of sharing: groups > subgroups > ..., shared lengths of 0, 1 or several
    blocks, suffixes of 0, 1 or odd lengths, decode (q_len 1) mixed with chunked prefill (q_len 2..max_q_len)."""
    rng = np.random.default_rng(seed + 1000)
    paths, level_blocks = [], {}
    for r in range(num_requests):
        path = []
        for level in range(levels):
            # Few branches per level so that nodes really hold several requests.
            branch = int(rng.integers(0, 2 if level else 2 + num_requests // 8))
            name = f"L{level}-{'/'.join(path)}-{branch}"
            level_blocks.setdefault(name, int(rng.choice([0, 1, max_level_blocks])) if level else
                                    int(rng.integers(1, max_level_blocks + 1)))
            path.append(name)
        paths.append(tuple(path))
    q_lens = [1 if rng.random() < decode_fraction else int(rng.integers(2, max_q_len + 1))
              for _ in range(num_requests)]
    # Suffix after the queries' start: 0 (queries right after the shared prefix), 1, or an odd length.
    extra = [q + int(rng.choice([0, 1, 2 * int(rng.integers(0, max_extra // 2)) + 1])) for q in q_lens]
    return make_batch(seed, q_lens=q_lens, extra_lens=extra, paths=paths, level_blocks=level_blocks,
                      block_size=block_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, dtype=dtype)
