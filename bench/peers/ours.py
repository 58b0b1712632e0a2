"""prefixattn: plan once on the host, one launch per work class. ``prefixattn-nosharing`` plans with
``sharing="never"``: the same kernel as plain paged attention, our own no-sharing baseline. ``prefixattn-overlap``
plans with ``overlap=True`` (the decode launch beside the compute launches: :mod:`prefixattn.planner.overlap`),
only on a batch whose plan overlaps (else it is the ``prefixattn`` run again: :class:`~peers.base.Unavailable`).
``prefixattn-kv-heads`` plans with the shipped decode tile packing as many KV heads into a decode program as its
lanes hold (a tile's ``kv_heads``, which no shipped table sets yet: docs/tuning.md), where that is more than one.
``prefixattn-hopper`` plans asking for the matrix classes' Hopper build (``PREFIXATTN_BUILD=hopper``:
:mod:`prefixattn.autotune.builds`), on a batch whose plan has a shared or chunk class the build serves.
``prefixattn-pdl`` plans asking for its launches chained by programmatic dependent launch (``PREFIXATTN_PDL=1``:
:mod:`prefixattn.autotune.pdl`), on a batch whose plan has two launches or more and chains them.

``Prepared.parts`` runs each work class of the plan alone (the per-class times of the GPU check). One class alone
is no public call: it launches the class's prepared launch through :mod:`prefixattn.prefix_attention`'s own
``_prepare``/``_launch`` (what ``attention()`` runs for every class in turn). A row whose partial states come from
several classes is merged by whichever class reports its last state: a class run alone reports only its own, so it
never completes such a merge, and its merge counters must start from zero before every run (``Prepared.reset``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

import prefixattn
from peers.base import Prepared, Unavailable
from prefixattn import prefix_attention as _attention
from prefixattn.autotune.builds import HOPPER, asking_for
from prefixattn.autotune.lookup import fixed_config, select_config
from prefixattn.autotune.pdl import asking_for_pdl
from prefixattn.kernels.layout import WORK_CLASSES


def prepare(batch, provider: str = "prefixattn") -> Prepared:
    s = batch.shape
    with (fixed_config(packed_decode_config(batch)) if provider == "prefixattn-kv-heads" else nullcontext(),
          asking_for(HOPPER) if provider == "prefixattn-hopper" else nullcontext(),
          asking_for_pdl(provider == "prefixattn-pdl")):
        p = prefixattn.plan(batch.qo_indptr, batch.kv_lens, batch.block_table, block_size=s.block_size,
                            num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                            q_dtype=batch.q.dtype, num_blocks=batch.num_blocks,
                            sharing="never" if provider == "prefixattn-nosharing" else "auto",
                            overlap=provider == "prefixattn-overlap")
    if provider == "prefixattn-overlap" and not p.overlapped:
        raise Unavailable(f"nothing to overlap: the plan runs its classes in series (modeled "
                          f"{p.stats['modeled_step_us']} us in series, classes {p.work_classes})")
    if provider == "prefixattn-kv-heads" and p.tiles.decode.kv_heads == 1:
        raise Unavailable(f"one KV head per decode program here (the tile's {p.tiles.decode.block_m} lanes, "
                          f"{s.num_kv_heads} KV heads of GQA {s.num_qo_heads // s.num_kv_heads}, head_dim "
                          f"{s.head_dim})")
    if provider == "prefixattn-pdl" and (not p.pdl or p.num_launches < 2):
        raise Unavailable(f"nothing to chain: {p.stats['pdl_why']}" if not p.pdl else
                          f"one launch (classes {p.work_classes})")
    if provider == "prefixattn-hopper" and HOPPER not in map(p.build_of, p.work_classes):
        raise Unavailable(f"the portable build: shared class {p.stats['shared_build_why']}; chunk class "
                          f"{p.stats['chunk_build_why']} (classes {p.work_classes})")
    out = torch.empty_like(batch.q)

    def run():
        return prefixattn.attention(batch.q, batch.k_cache, batch.v_cache, p, out=out)

    return Prepared(run=run, labels=dict(out=out, workspace_o=p.ws_o, workspace_lse=p.ws_lse),
                    notes=f"shared_nodes={len(p.shared_nodes)};items={p.num_items};overlapped={p.overlapped};"
                          f"shared_build={p.shared_build};chunk_build={p.chunk_build};pdl={p.pdl}",
                    extra=dict(tile_kv_load_bytes=p.kv_bytes_read(), work_items=p.num_items,
                               shared_nodes=len(p.shared_nodes), kv_heads=p.tiles.decode.kv_heads,
                               **modeled_times(p)),
                    # The classes alone are timed once, on the prefixattn provider (the same launches), and on the
                    # never-share one (no shared class); a packed decode step's time is mostly its decode class.
                    parts={} if p.overlapped or provider in ("prefixattn-kv-heads", "prefixattn-pdl") else
                    class_runs(p, batch.q, batch.k_cache, batch.v_cache, out),
                    reset=counters_reset(p))


def packed_decode_config(batch):
    """The config a plan of ``batch`` looks up for its decode tile, that tile asking for as many KV heads per program
    as it has lanes (the plan fits them: :func:`prefixattn.planner.tiles.fit_kv_heads`)."""
    s = batch.shape
    cfg = select_config(head_dim=s.head_dim, dtype=batch.q.dtype, group=s.num_qo_heads // s.num_kv_heads,
                        max_q_len=1).config
    return replace(cfg, suffix=replace(cfg.suffix, kv_heads=min(cfg.suffix.block_m, cfg.suffix.block_n)))


def class_runs(p, q, k_cache, v_cache, out) -> dict:
    """``{work class name: run}``: each work class of plan ``p`` launched alone on ``q`` and the caches, writing
    ``out`` (and the plan's workspace); run ``counters_reset(p)`` before each."""
    features = _attention._feature_args(p, q, None, None, None)
    runs = {}
    for work_class in p.work_classes:
        first, end = p.work.class_range(work_class)
        launch = _attention._prepare(p, None, out=out, lse=p.ws_lse, q=q, k_cache=k_cache, v_cache=v_cache,
                                     classes=(work_class,), grid_items=(end - first,), has_lse=False,
                                     features=features)
        runs[WORK_CLASSES[work_class]] = (lambda launch=launch: _attention._launch(
            launch, None, out, p.ws_lse, q, k_cache, v_cache, features))
    return runs


def modeled_times(p) -> dict:
    """Plan ``p``'s modeled times (:mod:`prefixattn.autotune.program_cost`, on the planning GPU): ``modeled_step_us``
    (its classes in series), ``modeled_overlap_us`` where the plan overlaps them, ``modeled_pdl_us`` where it chains
    them by PDL, and ``modeled_class_<name>_us`` per
    class it launches, beside which the GPU check's measured times (the whole call, each class alone) show the cost
    model's error per class and card."""
    stats = p.stats
    return dict(modeled_step_us=stats["modeled_step_us"],
                **({"modeled_overlap_us": stats["modeled_overlap_us"]} if p.overlapped else {}),
                **({"modeled_pdl_us": stats["modeled_pdl_us"]} if p.pdl else {}),
                **{f"modeled_class_{WORK_CLASSES[c]}_us": stats["modeled_class_us"][c] for c in p.work_classes})


def counters_reset(p):
    """Zero plan ``p``'s merge counters (a class run alone leaves the merges of other classes' rows incomplete)."""
    return (lambda: p.counters.zero_()) if p.num_merge_rows else None
