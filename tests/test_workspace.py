"""PrefixSharedAttention's capacity-sized workspace and graph-safe launch (interpreter on CPU, or a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import prefixattn
from prefixattn import PrefixSharedAttention, attention, reference_attention
from prefixattn import prefix_attention
from prefixattn.kernels import layout as K
from prefixattn.planner.backend import using
from prefixattn.planner.workspace import HostStaging, derive_capacity
from tests.launch_count import RecordingKernel
from tests.prefix_batches import random_batch
from tests.tolerances import ATTENTION_TOL, LSE_TOL

HEADS = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
#: Capacities of the wrapper under test: the batches below stay within them (4-5 requests, <= 80 rows).
CAPS = dict(max_tokens=96, max_requests=6, max_blocks_per_request=8)


class NoLaunch:
    """``kernel[grid](...)`` that does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _two_batches_on_one_cache(device, dtype=torch.float32):
    """Two different batches (sharing levels, request counts, q lengths) over ONE cache, as an engine has."""
    a = random_batch(41, num_requests=4, levels=1, block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                     dtype=dtype, max_q_len=20)
    b = random_batch(42, num_requests=5, levels=2, block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                     dtype=dtype, max_q_len=12)
    k_cache = torch.cat([a.k_cache, b.k_cache]).to(device)
    v_cache = torch.cat([a.v_cache, b.v_cache]).to(device)
    b.block_table = b.block_table + a.k_cache.shape[0]
    return [a, b], k_cache, v_cache


def _assert_matches_reference(out, q, k_cache, v_cache, batch, p, lse=None):
    n = p.num_tokens
    want, want_lse = reference_attention(q[:n], k_cache, v_cache, *batch.metadata, causal=True, sm_scale=p.sm_scale,
                                         return_lse=True)
    atol, rtol = ATTENTION_TOL[q.dtype]
    torch.testing.assert_close(out[:n].float(), want, atol=atol, rtol=rtol)
    if lse is not None:
        torch.testing.assert_close(lse[:n], want_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1])


def test_graph_mode_same_grid_and_buffers_for_two_batches(device, monkeypatch):
    """Two different batches planned on one use_cuda_graph wrapper launch the same grid over the same device
    buffers (addresses and strides), with the same scalars and constexprs - what a captured launch replays - and
    both match the reference."""
    (a, b), k_cache, v_cache = _two_batches_on_one_cache(device)
    rec = RecordingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", rec)
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, use_cuda_graph=True,
                                 sharing="always", min_split_tokens=16, num_sms=8, **CAPS)
    q_static = torch.zeros(CAPS["max_tokens"], 4, 64, device=device)  # the engine's static buffers
    out_static = torch.zeros_like(q_static)
    plans = []
    for batch in (a, b):
        q_static[:batch.q.shape[0]] = batch.q.to(device)
        p = attn.plan(*(t.to(device) for t in batch.metadata))
        plans.append(p)
        attn.run(q_static, k_cache, v_cache, out=out_static)
        _assert_matches_reference(out_static, q_static, k_cache, v_cache, batch, p)
    per_step = len(attn.graph_work_classes)
    assert per_step == 2 and len(rec.launches) == 2 * per_step  # the shared and the decode class, every step
    assert plans[0].num_items != plans[1].num_items and plans[1].has_shared  # really different work
    grid = attn.graph_grid_items(CAPS["max_tokens"])
    assert [g for g, _ in rec.launches] == [(n * HEADS["num_kv_heads"],) for n in grid] * 2
    assert rec.launches[:per_step] == rec.launches[per_step:]


def test_graph_mode_lse_and_an_unshared_step(device, monkeypatch):
    """The fixed launches (the shared class's too) also serve a step without shared items or merges (empty gather
    and merge tables: the launches still get the workspace's buffers, never a null pointer), with LSE."""
    (a, b), k_cache, v_cache = _two_batches_on_one_cache(device)
    rec = RecordingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", rec)
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, use_cuda_graph=True, num_sms=1,
                                 **CAPS)
    q, out, lse = (torch.zeros(CAPS["max_tokens"], 4, 64, device=device), torch.zeros(CAPS["max_tokens"], 4, 64,
                   device=device), torch.zeros(CAPS["max_tokens"], 4, device=device))
    for batch, sharing in ((b, "always"), (a, "never")):
        p = attn.plan(*(t.to(device) for t in batch.metadata), sharing=sharing)
        q[:batch.q.shape[0]] = batch.q.to(device)
        got, got_lse = attn.run(q, k_cache, v_cache, out=out, return_lse=True)
        _assert_matches_reference(got, q, k_cache, v_cache, batch, p, got_lse)
    assert not p.has_shared and p.work.gather.shape[0] == 0 and p.num_merge_rows == 0
    launches_b, launches_a = rec.launches[:2], rec.launches[2:]
    assert len(rec.launches) == 4
    for (grid_b, args_b), (grid_a, args_a) in zip(launches_b, launches_a):
        assert grid_a == grid_b
        assert ({k: v for k, v in args_a.items() if k != "lse_ptr"}
                == {k: v for k, v in args_b.items() if k != "lse_ptr"})
        assert all(v[0] != 0 for v in args_a.values() if isinstance(v, tuple))


@pytest.mark.parametrize("use_cuda_graph", [False, True])
def test_workspace_plan_allocates_nothing_and_copies_once(device, monkeypatch, use_cuda_graph):
    """plan() on a wrapper with capacities: one host->device copy (none on the CPU), no device allocation; run() with
    ``out``: no allocation either (the kernel itself stubbed while recording: the interpreter copies tensors). The
    tables are views of the workspace's buffers."""
    (a, _), k_cache, v_cache = _two_batches_on_one_cache(device)
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, sharing="always",
                                 use_cuda_graph=use_cuda_graph, **CAPS)
    metadata = [t.to(device) for t in a.metadata]
    with RecordOps() as rec:
        p = attn.plan(*metadata)
    # One host->device copy on a GPU; none on the CPU, where the staging buffer is the device buffer. One memset:
    # the step's merge counters start at zero (the launches leave them at zero).
    assert rec.ops.count("copy_") == (torch.device(device).type != "cpu"), rec.ops
    assert p.num_merge_rows and rec.ops.count("zero_") == 1, rec.ops
    assert not {"empty", "zeros", "empty_strided", "full", "new_empty", "_to_copy"} & set(rec.ops), rec.ops
    ws = attn.workspace
    assert p.items.data_ptr() == ws.items.data_ptr() and p.ws_o.data_ptr() == ws.ws_o.data_ptr()
    assert p.block_table.stride(0) == CAPS["max_blocks_per_request"]
    q, out = a.q.to(device), torch.empty_like(a.q, device=device)
    with monkeypatch.context() as m:
        m.setattr(prefix_attention, "prefix_attention_kernel", NoLaunch())
        with RecordOps() as rec:
            attn.run(q, k_cache, v_cache, out=out)
    assert rec.ops == [], rec.ops  # only the launches: no memset, no allocation, no copy
    attn.run(q, k_cache, v_cache, out=out)
    _assert_matches_reference(out, q, k_cache, v_cache, a, p)


def test_workspace_matches_the_free_plan(device):
    """Same work list and same output as the free plan()/attention() (which allocates per plan)."""
    from prefixattn import plan

    (a, _), k_cache, v_cache = _two_batches_on_one_cache(device)
    metadata = [t.to(device) for t in a.metadata]
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, **CAPS)
    p_ws = attn.plan(*metadata)
    p_free = plan(*metadata, **HEADS, q_dtype=torch.float32)
    np.testing.assert_array_equal(p_ws.work.items, p_free.work.items)
    torch.testing.assert_close(p_ws.items.cpu(), p_free.items.cpu(), atol=0, rtol=0)
    torch.testing.assert_close(p_ws.block_table[:p_free.num_requests, :p_free.block_table.shape[1]].cpu(),
                               p_free.block_table.cpu(), atol=0, rtol=0)
    q = a.q.to(device)
    torch.testing.assert_close(attn.run(q, k_cache, v_cache), attention(q, k_cache, v_cache, p_free), atol=0, rtol=0)


@pytest.mark.parametrize("use_cuda_graph", [False, True])
def test_over_capacity_is_a_value_error_naming_it(device, use_cuda_graph):
    (a, b), _, _ = _two_batches_on_one_cache(device)
    cases = [(dict(CAPS, max_requests=4), b, "max_requests: expected at most 4 \\(the workspace capacity"),
             (dict(CAPS, max_tokens=8), a, "max_tokens: expected at most 8"),
             (dict(CAPS, max_blocks_per_request=1), a, "max_blocks_per_request: expected at most 1")]
    for caps, batch, match in cases:
        attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, use_cuda_graph=use_cuda_graph,
                                     **caps)
        with pytest.raises(ValueError, match=match):
            attn.plan(*(t.to(device) for t in batch.metadata))


def test_sharing_overflow_replans_without_sharing(device):
    """A step whose sharing needs more workspace rows than the capacity is re-planned without sharing (still
    correct, the reason recorded); with sharing="never" the same capacity is a ValueError naming it."""
    (_, b), k_cache, v_cache = _two_batches_on_one_cache(device)
    metadata = [t.to(device) for t in b.metadata]
    num_tokens = int(b.qo_indptr[-1])
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, sharing="always", num_sms=1,
                                 max_ws_rows=num_tokens, **CAPS)
    p = attn.plan(*metadata)
    assert not p.has_shared and "max_ws_rows: expected at most" in p.stats["capacity_fallback"]
    q = b.q.to(device)
    _assert_matches_reference(attn.run(q, k_cache, v_cache), q, k_cache, v_cache, b, p)
    tight = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, sharing="never", num_sms=64,
                                  min_split_tokens=16, max_ws_rows=1, **CAPS)
    with pytest.raises(ValueError, match="max_ws_rows: expected at most 1"):
        tight.plan(*metadata)


def test_stale_plan_and_graph_overrides_are_refused(device):
    (a, b), k_cache, v_cache = _two_batches_on_one_cache(device)
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, use_cuda_graph=True, **CAPS)
    old = attn.plan(*(t.to(device) for t in a.metadata))
    attn.plan(*(t.to(device) for t in b.metadata))
    with pytest.raises(ValueError, match="plan: expected the latest plan of its workspace"):
        attention(a.q.to(device), k_cache, v_cache, old)
    with pytest.raises(ValueError, match="sm_scale: expected no per-step override with use_cuda_graph=True"):
        attn.plan(*(t.to(device) for t in a.metadata), sm_scale=0.5)
    never = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, use_cuda_graph=True,
                                  sharing="never", **CAPS)
    with pytest.raises(ValueError, match="sharing: expected 'never' with use_cuda_graph=True"):
        never.plan(*(t.to(device) for t in a.metadata), sharing="always")
    with pytest.raises(ValueError, match="max_tokens: expected the capacities"):
        PrefixSharedAttention(**HEADS, use_cuda_graph=True)
    with pytest.raises(ValueError, match="max_requests: expected an int with the other capacities"):
        PrefixSharedAttention(**HEADS, max_tokens=8)


def test_device_block_table_is_read_in_place(device, monkeypatch):
    """An engine's persistent device block table (wider than needed, int32) is what the kernel reads: no table copy,
    same address at every step."""
    (a, b), k_cache, v_cache = _two_batches_on_one_cache(device)
    engine_table = torch.zeros(CAPS["max_requests"], 16, dtype=torch.int32, device=device)
    rec = RecordingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", rec)
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, use_cuda_graph=True, **CAPS)
    for batch in (a, b):
        n, w = batch.block_table.shape
        engine_table.zero_()
        engine_table[:n, :w] = batch.block_table.to(device)
        p = attn.plan(*(t.to(device) for t in batch.metadata), device_block_table=engine_table[:n])
        q = batch.q.to(device)
        _assert_matches_reference(attn.run(q, k_cache, v_cache), q, k_cache, v_cache, batch, p)
    assert rec.launches[0][1]["block_table_ptr"] == rec.launches[1][1]["block_table_ptr"] == (
        engine_table.data_ptr(), engine_table.stride())


def test_derived_capacity_bounds_random_plans():
    """The derived capacities hold every plan of random batches within them (split-k forced by a small launch)."""
    from prefixattn import plan

    for seed in range(12):
        batch = random_batch(seed, num_requests=6, levels=2, block_size=16, num_qo_heads=8, num_kv_heads=2,
                             head_dim=64, max_q_len=24)
        for num_sms in (4, 132):
            p = plan(*batch.metadata, **dict(HEADS, num_qo_heads=8), q_dtype=torch.float32, sharing="always",
                     num_sms=num_sms, min_split_tokens=16)
            levels = int(np.bincount(p.nodes.members, minlength=6).max()) if len(p.nodes) else 0
            rows = [p.tiles.rows_per_shared_tile(4), p.tiles.rows_per_chunk_tile(4), p.tiles.rows_per_decode_tile(4)]
            cap = derive_capacity(max_tokens=p.num_tokens, max_requests=6, max_blocks_per_request=8, num_kv_heads=2,
                                  num_sms=num_sms, rows_per_tile=(min(rows), max(rows)), max_shared_levels=levels)
            assert p.num_items <= cap.max_items and p.work.num_ws_rows <= cap.max_ws_rows
            assert p.work.gather.shape[0] <= cap.max_gather_rows and p.num_merge_rows <= cap.max_merge_rows


def test_graph_num_tokens_sizes_the_grid_by_the_graph(device, monkeypatch):
    """plan(graph_num_tokens=G): the launch covers the item bound of a G-token step, smaller than the capacity's;
    two batches replayed by one G-row graph launch identically; q must have G rows."""
    (a, b), k_cache, v_cache = _two_batches_on_one_cache(device)
    rows = max(int(a.qo_indptr[-1]), int(b.qo_indptr[-1]))
    rec = RecordingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", rec)
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, use_cuda_graph=True,
                                 sharing="always", **CAPS)
    grid = attn.graph_grid_items(rows)
    assert len(grid) == len(attn.graph_work_classes) == 2  # shared, decode (no chunk binary at max_q_len 1)
    small, cap = attn.graph_grid_items(1), attn.workspace.capacity.max_items
    assert all(s <= g <= cap for s, g in zip(small, grid)) and small < grid and max(grid) < cap
    q_static, out_static = torch.zeros(rows, 4, 64, device=device), torch.zeros(rows, 4, 64, device=device)
    for batch in (a, b):
        q_static.zero_()
        q_static[:batch.q.shape[0]] = batch.q.to(device)
        p = attn.plan(*(t.to(device) for t in batch.metadata), graph_num_tokens=rows)
        attn.run(q_static, k_cache, v_cache, out=out_static)
        _assert_matches_reference(out_static, q_static, k_cache, v_cache, batch, p)
    launches_a, launches_b = rec.launches[:2], rec.launches[2:]
    assert launches_a == launches_b and len(rec.launches) == 4
    assert [g for g, _ in launches_a] == [(n * HEADS["num_kv_heads"],) for n in grid]
    with pytest.raises(ValueError, match=f"q: expected {rows} rows \\(the graph_num_tokens"):
        attn.run(torch.zeros(rows + 1, 4, 64, device=device), k_cache, v_cache)
    with pytest.raises(ValueError, match="graph_num_tokens: expected at least the step's"):
        attn.plan(*(t.to(device) for t in b.metadata), graph_num_tokens=1)


def test_graph_grid_overflow_replans_without_sharing(device, monkeypatch):
    """A shared plan over its graph's grid (a bound made tight here) is re-planned without sharing, which fits."""
    (_, b), k_cache, v_cache = _two_batches_on_one_cache(device)
    metadata = [t.to(device) for t in b.metadata]
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, use_cuda_graph=True,
                                 sharing="always", **CAPS)
    unshared_items = attn.plan(*metadata, sharing="never").num_items
    shared = attn.plan(*metadata).work
    shared_items, decode_items = (end - first for first, end in (shared.class_range(c) for c in (0, 2)))
    assert shared_items > 0 and attn.graph_work_classes == (K.CLASS_SHARED, K.CLASS_DECODE)
    rows = int(b.qo_indptr[-1])
    # Room for the unshared step's decode items, one shared item too few.
    monkeypatch.setattr(attn, "graph_grid_items", lambda num_tokens: (shared_items - 1, unshared_items))
    p = attn.plan(*metadata, graph_num_tokens=rows)
    assert not p.has_shared and "the graph grid for" in p.stats["capacity_fallback"]
    q = b.q.to(device)
    _assert_matches_reference(attn.run(q, k_cache, v_cache), q, k_cache, v_cache, b, p)
    monkeypatch.setattr(attn, "graph_grid_items", lambda num_tokens: (shared_items, decode_items - 1))
    with pytest.raises(ValueError, match="graph_num_tokens: expected a step within the graph's grid"):
        attn.plan(*metadata, graph_num_tokens=rows)


def test_a_wrapper_still_refuses_a_bad_num_blocks_after_a_good_one():
    """The wrapper keeps its checked arguments between steps: a ``num_blocks`` equal to the last one but of another
    type (16.0 after 16) is still refused, and so is one too small for the table."""
    attn = PrefixSharedAttention(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16, q_dtype=torch.float32,
                                 max_tokens=8, max_requests=4, max_blocks_per_request=4, device="cpu")
    args = (torch.tensor([0, 1, 2]), torch.tensor([40, 40]), torch.tensor([[0, 1, 2], [0, 1, 3]]))
    attn.plan(*args, num_blocks=16)
    with pytest.raises(ValueError, match="num_blocks"):
        attn.plan(*args, num_blocks=16.0)
    with pytest.raises(ValueError, match="num_blocks|block_table"):
        attn.plan(*args, num_blocks=3)
    assert attn.plan(*args, num_blocks=16).num_requests == 2


def test_workspace_refuses_read_ids_past_int32_and_stages_the_rest():
    """The workspace stages an int32 table: an id the kernel reads must be below 2**31 (a ValueError naming the
    table), while a cell past a request's own blocks (never read) may hold anything."""
    attn = PrefixSharedAttention(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16, q_dtype=torch.float32,
                                 max_tokens=8, max_requests=4, max_blocks_per_request=4, device="cpu")
    indptr, lens = torch.tensor([0, 1, 2]), torch.tensor([40, 20])
    unread = torch.tensor([[0, 1, 2], [3, 4, 2**40]])  # request 1 reads 2 blocks: its third cell is never read
    p = attn.plan(indptr, lens, unread)
    assert p.max_block_id == 4
    np.testing.assert_array_equal(p.block_table[:2, :2].numpy(), [[0, 1], [3, 4]])
    with pytest.raises(ValueError, match=r"block_table: expected block ids below 2\*\*31 .* got 2147483648"):
        attn.plan(indptr, lens, torch.tensor([[0, 1, 2**31], [3, 4, 5]]))


def test_restated_options_reuse_the_checked_ones(monkeypatch):
    """A step whose overrides restate the constructor's values (vLLM's builder passes its window and soft cap every
    step) reuses the options checked once; a value of another type or another value is checked and applied."""
    calls = []
    checked = prefix_attention.checked_options
    monkeypatch.setattr(prefix_attention, "checked_options", lambda **kw: calls.append(kw) or checked(**kw))
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device="cpu", window_left=-1, logits_soft_cap=0.0,
                                 **CAPS)
    (a, _), _, _ = _two_batches_on_one_cache("cpu")
    attn.plan(*a.metadata)
    attn.plan(*a.metadata, window_left=-1, logits_soft_cap=0.0)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="logits_soft_cap"):
        attn.plan(*a.metadata, logits_soft_cap=-1.0)
    assert attn.plan(*a.metadata, window_left=8).window_left == 8
    assert attn.plan(*a.metadata, logits_soft_cap=0).logits_soft_cap == 0.0  # an int 0 for 0.0: checked again
    assert len(calls) == 4


def test_a_wrapper_keeps_the_tile_config_variable_of_its_checked_options(monkeypatch):
    """PREFIXATTN_TILE_CONFIG is read when the wrapper checks its options (as PREFIXATTN_PLANNER), not every step;
    a step with overrides, a new wrapper and the free plan() read it then. A fixed_config context still applies at
    once (a thread-local, read every step)."""
    import json

    from prefixattn.autotune import lookup
    from prefixattn.autotune.config_space import AttentionConfig, LaunchOptions, Tiles

    monkeypatch.delenv(lookup.FIXED_ENV, raising=False)
    fixed = AttentionConfig(shared=Tiles(32, 32), suffix=Tiles(32, 16), launch=LaunchOptions(num_warps=2))
    (a, _), _, _ = _two_batches_on_one_cache("cpu")
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device="cpu", **CAPS)
    base = attn.plan(*a.metadata).tiles
    assert (base.decode.block_m, base.decode.block_n) != (32, 16)  # else the test shows nothing
    monkeypatch.setenv(lookup.FIXED_ENV, json.dumps(fixed.to_dict()))
    assert attn.plan(*a.metadata).tiles == base
    for p in (attn.plan(*a.metadata, sharing="always"),
              PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device="cpu", **CAPS).plan(*a.metadata),
              prefixattn.plan(*a.metadata, **HEADS, q_dtype=torch.float32)):
        assert (p.tiles.decode.block_m, p.tiles.decode.block_n) == (32, 16)
    monkeypatch.delenv(lookup.FIXED_ENV)
    with lookup.fixed_config(fixed):
        assert (attn.plan(*a.metadata).tiles.decode.block_m, attn.plan(*a.metadata).tiles.decode.block_n) == (32, 16)
    assert attn.plan(*a.metadata).tiles == base


@pytest.fixture
def compiled_planner():
    """Plan with the compiled back-end (it writes into the workspace's host buffer itself; numpy copies in load())."""
    pytest.importorskip("numba", reason="the compiled planner is optional (pip install prefixattn[fast])")
    with using("numba"):
        yield


def _sized_for(device, batches):
    """A wrapper without sharing whose item capacity fits the first batch (and the item counts it checks against)."""
    roomy = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, sharing="never", **CAPS)
    items = [roomy.plan(*(t.to(device) for t in batch.metadata)).num_items for batch in batches]
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device=device, sharing="never",
                                 max_items=items[0], **CAPS)
    return attn, items


def test_a_step_failing_after_writing_its_work_list_leaves_no_current_plan(device, compiled_planner):
    """The compiled work list writes into the workspace's host buffer, which on a CPU device holds the tables the
    current plan reads: a step refused after that (a read id past int32) makes the earlier plan stale, a clear error
    instead of a plan over another batch's tables; a step refused before anything was written (by the checks, or for
    too many items even without sharing: a work list over a capacity is not written, the table is staged only after
    the capacity checks) leaves it current."""
    (a, b), k_cache, v_cache = _two_batches_on_one_cache(device)
    attn, items = _sized_for(device, (a, b))
    assert items[1] > items[0]  # the capacity fits a, not b
    q = a.q.to(device)

    def fresh_plan():
        p = attn.plan(*(t.to(device) for t in a.metadata))
        _assert_matches_reference(attn.run(q, k_cache, v_cache), q, k_cache, v_cache, a, p)
        return p

    p = fresh_plan()
    bad_ids = a.block_table.clone()
    bad_ids[0, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block_table"):
        attn.plan(a.qo_indptr.to(device), a.kv_lens.to(device), bad_ids.to(device), num_blocks=k_cache.shape[0])
    assert p.is_current()
    _assert_matches_reference(attn.run(q, k_cache, v_cache), q, k_cache, v_cache, a, p)
    with pytest.raises(ValueError, match="max_items: expected at most"):
        attn.plan(*(t.to(device) for t in b.metadata))
    assert p.is_current()
    _assert_matches_reference(attn.run(q, k_cache, v_cache), q, k_cache, v_cache, a, p)
    past_int32 = a.block_table.to(torch.int64)
    past_int32[0, 0] = 2**31  # read: refused after the work list was written
    with pytest.raises(ValueError, match=r"block_table: expected block ids below 2\*\*31"):
        attn.plan(a.qo_indptr.to(device), a.kv_lens.to(device), past_int32.to(device))
    assert not p.is_current()


def test_the_compiled_planner_writes_the_work_list_in_place_and_bad_steps_leave_the_plan_current(device,
                                                                                                compiled_planner):
    """With the compiled planner the work list is written straight into the workspace's host buffer (the plan's host
    tables are views of it); a device table too small for another batch and a step over a capacity are refused
    before anything is written there, so the current plan stays current and correct."""
    (a, b), k_cache, v_cache = _two_batches_on_one_cache(device)
    attn, items = _sized_for(device, (a, b))
    assert items[1] > items[0]  # the capacity fits a, not b
    engine_table = torch.zeros(CAPS["max_requests"], 16, dtype=torch.int32, device=device)
    n, w = a.block_table.shape
    engine_table[:n, :w] = a.block_table.to(device)
    p = attn.plan(*(t.to(device) for t in a.metadata), device_block_table=engine_table[:n])
    assert np.shares_memory(p.work.items, attn.workspace.host_buffer())
    # The first requests of a, whose work list (fewer items) differs: a write would change what p reads.
    head = (a.qo_indptr[:n].to(device), a.kv_lens[:n - 1].to(device), a.block_table[:n - 1].to(device))
    with pytest.raises(ValueError, match="device_block_table: expected at least"):
        attn.plan(*head, device_block_table=engine_table[:n - 1, :1])
    engine_table[:b.block_table.shape[0], :b.block_table.shape[1]] = b.block_table.to(device)
    with pytest.raises(ValueError, match="max_items: expected at most"):
        attn.plan(*(t.to(device) for t in b.metadata), device_block_table=engine_table[:b.block_table.shape[0]])
    engine_table[:n, :w] = a.block_table.to(device)
    assert p.is_current()
    q = a.q.to(device)
    _assert_matches_reference(attn.run(q, k_cache, v_cache), q, k_cache, v_cache, a, p)


@pytest.mark.parametrize("device_table", [False, True])
def test_one_wait_for_the_previous_copy_per_step(device_table):
    """Every writer of the host buffer (the compiled checks' table, the compiled work list, load()) first waits for
    the previous step's copy to finish reading it: once per step, not once per writer (a CUDA event wait each)."""

    class CountingEvent:
        def __init__(self):
            self.waits = self.records = 0

        def synchronize(self):
            self.waits += 1

        def record(self):
            self.records += 1

    (a, _), _, _ = _two_batches_on_one_cache("cpu")
    attn = PrefixSharedAttention(**HEADS, q_dtype=torch.float32, device="cpu", **CAPS)
    staging = attn.workspace._staging  # a CPU workspace's one buffer, given an event to stand in for CUDA's
    event = CountingEvent()
    staging._events = [event]
    extra = dict(device_block_table=a.block_table.clone()) if device_table else {}
    for _ in range(3):
        attn.plan(*a.metadata, **extra)
    assert (event.records, event.waits) == (3, 2)


def test_staging_buffers_take_turns_so_a_step_waits_for_the_copy_before_last():
    """Two host buffers used in turn (a CUDA workspace's): writing step N+1's tables waits for the copy of step N-1,
    not of step N, so the host can plan a step while the GPU still has the previous one queued."""
    events = []

    class Event:
        def __init__(self):
            self.waits = self.records = 0
            events.append(self)

        def synchronize(self):
            self.waits += 1

        def record(self):
            self.records += 1

    staging = HostStaging(8, slots=2, pinned=False, event=Event)
    used = []
    for step in range(4):
        staging.wait()
        staging.array[:] = step
        used.append(staging.buffer.data_ptr())
        staging.copied()
    assert used[0] == used[2] != used[1] == used[3]
    assert [(e.records, e.waits) for e in events] == [(2, 1), (2, 1)]  # steps 2 and 3 waited for steps 0 and 1
    assert staging.arrays[0].tolist() == [2] * 8 and staging.arrays[1].tolist() == [3] * 8
    with pytest.raises(ValueError, match="slots: expected at least 1, got 0"):
        HostStaging(8, slots=0, pinned=False)
