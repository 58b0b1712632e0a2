"""sharing="auto" plans a short step without sharing when that is faster (modeled): the shared class's own launch
can cost more than the reads its nodes save; and a mixed step with its prefill chunks out of the shared nodes when
that is faster (prefixattn.planner.choose)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import prefixattn
from prefixattn import PrefixSharedAttention, reference_attention
from prefixattn.autotune.lookup import current_target, planning_target
from prefixattn.autotune.program_cost import class_costs
from prefixattn.autotune.targets import get_target
from prefixattn.planner import choose
from prefixattn.planner.backend import using
from prefixattn.planner.split_rule import shared_reads_saved
from prefixattn.planner.tiles import choose_tiles
from tests.tolerances import ATTENTION_TOL

BLOCK_SIZE = 16
#: The GPU check's decode shapes on an H100 (modeled): GQA 32:4, head_dim 128, fp16, 132 SMs.
GPU_SHAPE = dict(num_qo_heads=32, num_kv_heads=4, head_dim=128, q_dtype=torch.float16, num_sms=132)


def _decode_batch(num_requests: int, shared: int, own: int):
    """``num_requests`` decodes whose first ``shared`` KV positions are the same blocks, then ``own`` each."""
    own_blocks = -(-own // BLOCK_SIZE)
    rows = [list(range(shared // BLOCK_SIZE)) + [1000 + r * own_blocks + j for j in range(own_blocks)]
            for r in range(num_requests)]
    return (torch.arange(num_requests + 1), torch.full((num_requests,), shared + own),
            torch.tensor(rows, dtype=torch.int64))


def _mixed_batch(num_decodes: int, num_chunks: int, chunk_rows: int, shared: int, own: int, per_prefix: int):
    """The GPU check's mixed steps: ``num_chunks`` prefill chunks of ``chunk_rows`` (first) and ``num_decodes``
    decodes, each with ``shared`` KV positions of its prefix group's (``per_prefix`` requests a group), then ``own``
    positions (a chunk: then its rows)."""
    n = num_chunks + num_decodes
    rows, q_len, kv_len = [], [], []
    next_block = -(-n // per_prefix) * (shared // BLOCK_SIZE)  # past the groups' shared blocks
    for r in range(n):
        q = chunk_rows if r < num_chunks else 1
        kv = shared + own + (q if r < num_chunks else 0)
        own_blocks = -(-kv // BLOCK_SIZE) - shared // BLOCK_SIZE
        group_base = (r // per_prefix) * (shared // BLOCK_SIZE)
        rows.append(list(range(group_base, group_base + shared // BLOCK_SIZE))
                    + list(range(next_block, next_block + own_blocks)))
        next_block += own_blocks
        q_len.append(q)
        kv_len.append(kv)
    width = max(len(row) for row in rows)
    table = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64)
    return torch.tensor([0] + q_len).cumsum(0), torch.tensor(kv_len), table


def _plan(batch, sharing, **shape):
    with planning_target("sm90"):
        return prefixattn.plan(*batch, block_size=BLOCK_SIZE, sharing=sharing, **(shape or GPU_SHAPE))


@pytest.fixture(params=["numpy", "numba"])
def planner(request):
    if request.param == "numba":
        pytest.importorskip("numba")
    with using(request.param):
        yield request.param


def test_a_short_step_runs_unshared_where_sharing_is_slower(planner):
    """32 decodes under a 256-token prefix with 2,048 own positions each: the node passes the byte rule, but its
    launch costs more than it saves; the step runs as sharing="never" would."""
    batch = _decode_batch(32, 256, 2048)
    auto, never, always = (_plan(batch, s) for s in ("auto", "never", "always"))
    assert always.has_shared and always.stats["modeled_step_us"] > never.stats["modeled_step_us"]
    assert auto.stats["sharing_declined"] and not auto.has_shared
    assert auto.stats["modeled_step_us"] == never.stats["modeled_step_us"]
    np.testing.assert_array_equal(auto.work.items, never.work.items)


def test_a_long_shared_prefix_keeps_sharing_without_a_second_plan(planner, monkeypatch):
    """32 decodes under an 8,192-token prefix: the screen does not fire (no second plan), sharing stays."""
    seen = []
    monkeypatch.setattr(choose, "modeled_faster", lambda *a: seen.append(1) or False)
    auto = _plan(_decode_batch(32, 8192, 128), "auto")
    assert auto.has_shared and not auto.stats["sharing_declined"] and not seen


def test_the_screen_prices_the_launch_against_the_reads_saved():
    """The screen fires when the shared launch outweighs UNSHARED_CHECK_RATIO of the estimated savings: a longer
    node saves more and silences it."""
    fired = []
    for shared in (256, 1024, 8192):
        p = _plan(_decode_batch(32, shared, 128), "always")
        costs = class_costs(p.tiles, head_dim=128, dtype="fp16", kv_bytes=2, target=get_target("sm90"))
        fired.append(choose.shared_launch_may_lose(shared_reads_saved(p.nodes), p.work.modeled_us, costs,
                                                   num_kv_heads=4, num_sms=132))
    assert fired[0] and not fired[-1]
    assert fired == sorted(fired, reverse=True)


@pytest.mark.parametrize("use_cuda_graph", [False, True])
def test_a_declined_step_through_a_wrapper_matches_the_reference(device, use_cuda_graph):
    """The wrapper's workspace gets the unshared plan (the sharing plan it wrote first is replaced), and the
    kernels give the reference's result."""
    torch.manual_seed(0)
    heads = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64)
    n, shared, own = 4, 32, 16
    metadata = [t.to(device) for t in _decode_batch(n, shared, own)]
    num_blocks = 1000 + n * own // BLOCK_SIZE
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, 2, 64, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(n, 4, 64, device=device)
    attn = PrefixSharedAttention(**heads, block_size=BLOCK_SIZE, q_dtype=torch.float32, device=device,
                                 use_cuda_graph=use_cuda_graph, max_tokens=8, max_requests=n,
                                 max_blocks_per_request=4, max_q_len=1)
    if current_target() is None:  # a host without a known GPU prices no launches
        assert not attn.plan(*metadata).stats["sharing_declined"]
    with planning_target("sm90"):
        p = attn.plan(*metadata)
    assert p.stats["sharing_declined"] and not p.has_shared
    want = reference_attention(q, k_cache, v_cache, *metadata, causal=True, sm_scale=p.sm_scale)
    atol, rtol = ATTENTION_TOL[q.dtype]
    torch.testing.assert_close(attn.run(q, k_cache, v_cache)[:n], want, atol=atol, rtol=rtol)


#: The GPU check's MHA shapes (modeled on sm90): 32 heads, head_dim 128, fp16, 132 SMs.
MHA_SHAPE = dict(GPU_SHAPE, num_kv_heads=32)


def test_long_chunks_stay_out_of_the_node_where_that_is_faster(planner, monkeypatch):
    """7 chunks of 2,048 rows and 256 decodes under one 256-token prefix (MHA): the node pays for the decodes; the
    chunks gain no reads from it and merged 14,592 rows (measured on an H200: 10% slower than no sharing). The plan
    keeps them apart: the node holds the 256 decodes, and its modeled step beats both the plan with the chunks in and
    the unshared one."""
    batch = _mixed_batch(256, 7, 2048, 256, 2048, per_prefix=263)
    auto = _plan(batch, "auto", **MHA_SHAPE)
    assert auto.stats["requests_apart"] and not auto.stats["sharing_declined"]
    assert auto.nodes.members.tolist() == list(range(7, 263))
    assert auto.stats["num_merge_rows"] == 256
    never = _plan(batch, "never", **MHA_SHAPE)
    monkeypatch.setattr(choose, "requests_may_stay_apart", lambda *a, **k: False)
    chunks_in = _plan(batch, "auto", **MHA_SHAPE)
    assert set(range(7)) <= set(chunks_in.nodes.members.tolist())
    assert auto.stats["modeled_step_us"] < min(chunks_in.stats["modeled_step_us"], never.stats["modeled_step_us"])


def test_short_chunks_stay_in_the_nodes_where_that_is_faster(planner, monkeypatch):
    """7 chunks of 128 rows and 256 decodes under 8,192-token prefixes, 64 requests each (MHA): apart, each chunk's
    tiles would read its whole prefix in a few long programs (modeled slower); the plan with both is priced and the
    chunks stay in their nodes."""
    priced = []
    original = choose.modeled_faster
    monkeypatch.setattr(choose, "modeled_faster", lambda *a: priced.append(1) or original(*a))
    auto = _plan(_mixed_batch(256, 7, 128, 8192, 128, per_prefix=64), "auto", **MHA_SHAPE)
    assert priced and not auto.stats["requests_apart"]
    assert set(range(7)) <= set(auto.nodes.members.tolist())


def test_a_step_with_requests_apart_through_a_wrapper_matches_the_reference(device, monkeypatch):
    """The plan with requests apart, forced to win (the wrapper replans it into its workspace): a chunk of one full
    chunk tile (as tall as a shared M tile here: no gain from the node) beside decodes under one prefix; the kernels
    give the reference's result."""
    monkeypatch.setattr(choose, "modeled_faster", lambda *a: True)
    monkeypatch.setattr(choose, "shared_launch_may_lose", lambda *a, **k: False)
    torch.manual_seed(0)
    heads = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64)
    with planning_target("sm90"):
        tiles = choose_tiles(head_dim=64, group=2, max_q_len=64, dtype=torch.float32)
    chunk_rows = tiles.rows_per_chunk_tile(2)
    assert tiles.rows_per_shared_tile(2) <= chunk_rows < 64
    metadata = [t.to(device) for t in _mixed_batch(5, 1, chunk_rows, 64, 16, per_prefix=6)]
    num_blocks = int(metadata[2].max()) + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, 2, 64, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(int(metadata[0][-1]), 4, 64, device=device)
    attn = PrefixSharedAttention(**heads, block_size=BLOCK_SIZE, q_dtype=torch.float32, device=device,
                                 max_tokens=int(metadata[0][-1]), max_requests=6, max_blocks_per_request=32,
                                 max_q_len=chunk_rows)
    with planning_target("sm90"):
        p = attn.plan(*metadata)
    assert p.stats["requests_apart"] and p.nodes.members.tolist() == [1, 2, 3, 4, 5]
    want = reference_attention(q, k_cache, v_cache, *metadata, causal=True, sm_scale=p.sm_scale)
    atol, rtol = ATTENTION_TOL[q.dtype]
    torch.testing.assert_close(attn.run(q, k_cache, v_cache), want, atol=atol, rtol=rtol)
