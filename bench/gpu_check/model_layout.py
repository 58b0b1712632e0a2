"""Engine steps for the model step (model_step.py), from prefixattn's own scheduler.

A workload of :mod:`prefixattn.sim.workloads` (BatchLLM case 1: a 16-token instruction shared by all, documents of
~1,100 tokens shared by ~7 requests, ~400 distinct tokens; ``docs-qa-8k``: ~8K-token documents each shared by 32-64
~100-token questions; ``shared-prompt-4k``: one ~4K-token prompt shared by every request; ~200 output tokens each;
every prompt and output subsampled by ``scale`` for smaller runs, which keeps the sharing structure) is grouped (two
levels), ordered (BatchLLM's order) and batched step by step by :class:`prefixattn.scheduling.TokenBatcher`; requests
end at their workload output length (no sampling: outputs are forced to the workload's lengths).

Each step is laid out on a paged KV cache as a prefix-caching engine lays it out: block ``j`` of a request holds
positions ``j * block_size ...``; a block entirely inside a shared prefix level is one physical block for every request
under that level (keyed by the level that holds its last token), any other block is the request's own (a level's
partial last block is copied per member, as a paged cache does). prefixattn finds the sharing from the block ids;
the cascade peer is handed the groups (oracle). KV contents are random: the step is timed, and checked against the
reference on one layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prefixattn.scheduling import ChunkKind, TokenBatcher, group_prompts, order_groups


@dataclass
class StepLayout:
    """One engine step: rows are the step's chunks (decodes first, then prefill chunks; each part grouped by shared
    prefix), int32 metadata for the attention providers, positions / slots of the new tokens, the rows that produce
    a token, the oracle groups and, for the simulator, the shared runs."""

    step: int
    kind: str  # "decode" | "mixed"
    qo_indptr: np.ndarray  # [R + 1]
    kv_lens: np.ndarray  # [R]
    block_table: np.ndarray  # [R, W]
    num_blocks: int
    positions: np.ndarray  # [T] token positions (rotary)
    slots: np.ndarray  # [T] flat cache slot of each new token
    sampled_rows: np.ndarray  # [S] rows whose logits are computed
    groups: list = field(default_factory=list)  # [(request indices, consecutive), shared tokens)]
    shared_runs: list = field(default_factory=list)  # [(kv tokens, query rows)] of groups of >= 2 requests

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def q_lens(self) -> np.ndarray:
        return np.diff(self.qo_indptr)

    @property
    def shared_lens(self) -> np.ndarray:
        out = np.zeros(len(self.kv_lens), dtype=np.int64)
        for members, tokens in self.groups:
            out[members] = tokens
        return out


def workload(name: str, num_requests: int, scale: int, seed: int = 0):
    """(prompts, output lengths) of a named workload (:data:`prefixattn.sim.workloads.WORKLOADS`: BatchLLM case 1
    ``batchllm-case1``, ``docs-qa-8k``, ``shared-prompt-4k``), every sequence subsampled by ``scale``."""
    from prefixattn.sim.workloads import get_workload

    w = get_workload(name, num_requests=num_requests, seed=seed)
    prompts = [r.prompt[::scale].astype(np.int64) for r in w.requests]
    outputs = [max(1, r.output_len // scale) for r in w.requests]
    return prompts, outputs


def _chain(batcher: TokenBatcher, node: int) -> list:
    """Prefix levels from the root down to ``node``: [(start, size, level id)]."""
    out = []
    while node >= 0:
        p = batcher.prefix_node(node)
        out.append((p.start, p.size, node))
        node = p.parent
    return out[::-1]


def _block_keys(chain: list, kv_len: int, owner, block_size: int, shared_end: int) -> list:
    """Keys of the blocks holding positions [0, kv_len): a block inside [0, shared_end) belongs to the level holding
    its last position; any other block to ``owner``."""
    keys = []
    for j in range(-(-kv_len // block_size)):
        last = (j + 1) * block_size - 1
        if last < shared_end:
            level = next(lv for start, size, lv in chain if start <= last < start + size)
            keys.append(("level", level, j))
        else:
            keys.append((owner, j))
    return keys


def layout(batch, batcher: TokenBatcher, prompts, block_size: int) -> StepLayout:
    """Lay one :class:`prefixattn.scheduling.StepBatch` out (see the module docstring)."""
    chunks = []
    for kind, rid, node, start, n in zip(batch.kinds, batch.request_ids, batch.nodes, batch.starts,
                                         batch.num_tokens):
        kind, rid, node, start, n = ChunkKind(int(kind)), int(rid), int(node), int(start), int(n)
        chain = _chain(batcher, node) if node >= 0 else []
        if kind == ChunkKind.PREFIX:  # the level's own tokens: shared blocks are those inside its ancestors
            shared_end, owner = chain[-1][0], ("level-own", node)
        else:
            shared_end, owner = (chain[-1][0] + chain[-1][1]) if chain else 0, ("request", rid)
        keys = _block_keys(chain, start + n, owner, block_size, (shared_end // block_size) * block_size)
        shared = [k for k in keys if k[0] == "level"]
        samples = kind == ChunkKind.DECODE or (kind == ChunkKind.DISTINCT and start + n >= len(prompts[rid]))
        chunks.append(dict(kind=kind, start=start, n=n, keys=keys, group=shared[-1] if shared else ("alone", rid,
                           int(kind)), shared=len(shared) * block_size, samples=samples))
    # Decodes first, then prefill chunks; each part grouped by its deepest shared block.
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i]["kind"] != ChunkKind.DECODE, str(chunks[i]["group"])))
    chunks = [chunks[i] for i in order]
    ids: dict = {}
    rows = [[ids.setdefault(k, len(ids)) for k in c["keys"]] for c in chunks]
    width = max(len(r) for r in rows)
    table = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    q_lens = np.array([c["n"] for c in chunks], dtype=np.int64)
    kv_lens = np.array([c["start"] + c["n"] for c in chunks], dtype=np.int64)
    indptr = np.r_[0, np.cumsum(q_lens)]
    positions = np.concatenate([np.arange(c["start"], c["start"] + c["n"]) for c in chunks])
    req_of_row = np.repeat(np.arange(len(chunks)), q_lens)
    slots = table[req_of_row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    sampled = np.array([indptr[i + 1] - 1 for i, c in enumerate(chunks) if c["samples"]], dtype=np.int64)
    groups, runs = [], []
    i = 0
    while i < len(chunks):
        j = i
        while j + 1 < len(chunks) and chunks[j + 1]["group"] == chunks[i]["group"] and \
                (chunks[j + 1]["kind"] == ChunkKind.DECODE) == (chunks[i]["kind"] == ChunkKind.DECODE):
            j += 1
        members = list(range(i, j + 1))
        tokens = chunks[i]["shared"] if len(members) > 1 else 0
        groups.append((members, tokens))
        if tokens:
            runs.append((tokens, int(q_lens[i:j + 1].sum())))
        i = j + 1
    kind = "decode" if all(c["kind"] == ChunkKind.DECODE for c in chunks) else "mixed"
    return StepLayout(step=int(batch.step), kind=kind, qo_indptr=indptr.astype(np.int32),
                      kv_lens=kv_lens.astype(np.int32), block_table=table, num_blocks=len(ids), positions=positions,
                      slots=slots, sampled_rows=sampled, groups=groups, shared_runs=runs)


def kv_traffic(lay: StepLayout, block_size: int, bytes_per_token: int, l2_bytes: int) -> dict:
    """One layer's KV bytes of a step: ``read`` (every request reads its whole KV: no sharing), ``unique`` (every
    cached position once), ``l2_reread`` (the part of ``read`` that re-reads the prefix of a group of >= 2 requests
    whose prefix fits in ``l2_bytes``: what an unshared kernel serves from L2 when the group's rows run together)
    and ``l2_reread_fraction`` (``l2_reread / read``). ``bytes_per_token``: K and V of all KV heads of one layer."""
    kv_lens = lay.kv_lens.astype(np.int64)
    used = np.clip(kv_lens[:, None] - np.arange(lay.block_table.shape[1]) * block_size, 0, block_size)
    per_block = np.zeros(lay.num_blocks, dtype=np.int64)
    np.maximum.at(per_block, lay.block_table.astype(np.int64).ravel(), used.ravel())
    read = int(kv_lens.sum()) * bytes_per_token
    reread = sum((len(m) - 1) * t * bytes_per_token for m, t in lay.groups
                 if len(m) > 1 and t and t * bytes_per_token <= l2_bytes)
    return dict(read=read, unique=int(per_block.sum()) * bytes_per_token, l2_reread=reread,
                l2_reread_fraction=reread / read if read else 0.0)


def group_item_span(items: np.ndarray, class_ends, groups: list) -> float:
    """How far apart a plan issues the members of a prefix group that each read the group's prefix: per group of
    >= 2 requests and work class, the span of the positions of its items that start at KV position 0 over their
    count (1.0: adjacent, as a kernel walking a group-sorted batch issues them); the median over groups, NaN where
    no group has two such items. ``items``: the plan's work list (``prefixattn.kernels.layout`` columns);
    ``class_ends``: one past each class's last item; ``groups``: :attr:`StepLayout.groups`."""
    from prefixattn.kernels import layout as K

    spans, lo = [], 0
    for hi in class_ends:
        it = items[lo:hi]
        from_start = it[:, K.ITEM_KV_START] == 0
        for members, _ in groups:
            pos = np.flatnonzero(from_start & np.isin(it[:, K.ITEM_REQ], members))
            if pos.size > 1:
                spans.append((pos[-1] - pos[0] + 1) / pos.size)
        lo = hi
    return float(np.median(spans)) if spans else float("nan")


def run_batcher(prompts, outputs, *, token_budget: int, kv_blocks: int, block_size: int):
    """Every step of the workload through the TokenBatcher (requests end at their output lengths): (the batcher, its
    StepBatches). Lay a step out with :func:`layout` (only the selected ones: laying out every step costs seconds)."""
    batcher = TokenBatcher(token_budget=token_budget, kv_blocks=kv_blocks, block_size=block_size)
    groups = order_groups(group_prompts(prompts, levels=2, min_shared_tokens=block_size), "batchllm")
    batcher.add_groups(groups)
    generated = np.zeros(len(prompts), dtype=np.int64)
    steps = []
    while not batcher.done:
        batch = batcher.step()
        if batch.total_tokens == 0:
            raise RuntimeError("TokenBatcher planned an empty step with requests left")
        steps.append(batch)
        for kind, rid, start, n in zip(batch.kinds, batch.request_ids, batch.starts, batch.num_tokens):
            rid = int(rid)
            if kind == ChunkKind.DECODE:
                generated[rid] += 1
            elif kind == ChunkKind.DISTINCT and int(start + n) >= len(prompts[rid]) and generated[rid] == 0:
                generated[rid] = 1
            if generated[rid] >= outputs[rid] and batcher.request_state(rid) == "decode":
                batcher.finish(rid)
                generated[rid] = -10 ** 9  # finished: never again
    return batcher, steps


def step_kind(batch) -> str:
    return "decode" if bool((batch.kinds == int(ChunkKind.DECODE)).all()) else "mixed"


def select_steps(steps: list, per_kind: int) -> list:
    """StepBatches per kind (decode, mixed): the one with the most chunks, then steps spread over the run."""
    out = []
    for kind in ("decode", "mixed"):
        pool = [s for s in steps if step_kind(s) == kind and s.step > 0]  # step 0 computes the first level alone
        if not pool:
            continue
        picks = [max(pool, key=lambda s: (len(s.kinds), s.total_tokens))]
        for q in np.linspace(0.25, 0.75, max(per_kind - 1, 0)):
            s = pool[int(q * (len(pool) - 1))]
            if s not in picks:
                picks.append(s)
        out += picks[:per_kind]
    return out
