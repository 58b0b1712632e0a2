"""prefixattn: plan once on the host, one fused launch. ``prefixattn-nosharing`` plans with ``sharing="never"``:
the same kernel as plain paged attention, our own no-sharing baseline."""

from __future__ import annotations

import torch

import prefixattn
from peers.base import Prepared


def prepare(batch, provider: str = "prefixattn") -> Prepared:
    s = batch.shape
    p = prefixattn.plan(batch.qo_indptr, batch.kv_lens, batch.block_table, block_size=s.block_size,
                        num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                        q_dtype=batch.q.dtype, num_blocks=batch.num_blocks,
                        sharing="never" if provider == "prefixattn-nosharing" else "auto")
    out = torch.empty_like(batch.q)

    def run():
        return prefixattn.attention(batch.q, batch.k_cache, batch.v_cache, p, out=out)

    return Prepared(run=run, labels=dict(out=out, workspace_o=p.ws_o, workspace_lse=p.ws_lse),
                    notes=f"shared_nodes={len(p.shared_nodes)};items={p.num_items}",
                    extra=dict(planned_kv_bytes=p.kv_bytes_read(), work_items=p.num_items,
                               shared_nodes=len(p.shared_nodes)))
