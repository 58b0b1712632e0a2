"""The backend plans SGLang's batches without reading a device tensor on the host, and stays exact as requests are
added, finished, preempted and reordered between steps.

The scheduler's side is driven as SGLang 0.5.23 drives it: a request admitted with a radix-cache match gets
``row[:prefix_len]`` from the matched path, ``cache_protected_len`` and ``last_node``; a checkpoint inserts the
computed tokens, rewrites ``row[cache_protected_len:len(path)]`` from the new path and moves both; a retracted request
loses its row, ``last_node`` and ``cache_protected_len``. Batches come through the ``ForwardBatch.init_new`` tap
(:func:`~prefixattn.integrations.sglang.host_pages.tapped_init_new`); device tensors are
:class:`~tests.vllm.device_standin.DeviceStandIn` views recording any host read. Each step's shared prefixes must be
the ones a plan of the device rows (what the kernel reads) finds.
"""

from __future__ import annotations

import array
import types

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

import prefixattn
from prefixattn.integrations.sglang import host_pages
from prefixattn.integrations.sglang.backend import PrefixAttnBackend
from tests.sglang.engine import MiniEngine
from tests.vllm.device_standin import DeviceStandIn

pytestmark = pytest.mark.sglang

SYSTEM = list(range(100, 112))
DOC_A = list(range(200, 208))
DOC_B = list(range(300, 308))


def _question(i: int, n: int = 4) -> list[int]:
    return [400 + 10 * i + j for j in range(n)]


class Scheduler:
    """The request state SGLang's scheduler keeps on the host (``req.kv``, ``req.last_node``) over a MiniEngine."""

    def __init__(self, eng: MiniEngine):
        self.eng = eng
        self.state: dict[int, types.SimpleNamespace] = {}

    def admit(self, tokens, row=None) -> int:
        eng = self.eng
        i = eng.add_request(tokens)
        req = eng.requests[i]
        if row is not None:  # a row a finished or retracted request gave back
            eng.req_to_token_pool.req_to_token[row, :req.cached_len] = eng.req_to_token_pool.req_to_token[
                req.row, :req.cached_len]
            req.row = row
        match = eng.radix.match_prefix(MatchPrefixParams(key=RadixKey(array.array("l", tokens[:req.cached_len]))))
        self.state[i] = types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=req.row,
                                                                       cache_protected_len=req.cached_len),
                                              last_node=match.last_device_node)
        return i

    def checkpoint(self, i: int) -> None:
        """``RadixCache.checkpoint``: insert, re-match, adopt the tree's slots for the row, move the lock."""
        eng, st, req = self.eng, self.state[i], self.eng.requests[i]
        n = len(req.slots) // eng.page_size * eng.page_size
        key = RadixKey(array.array("l", req.tokens[:n]))
        eng.radix.insert(InsertParams(key=key, value=torch.tensor(req.slots[:n], dtype=torch.int64)))
        node = eng.radix.match_prefix(MatchPrefixParams(key=key)).last_device_node
        path = eng.radix.path_device_indices(node)
        cpl = st.kv.cache_protected_len
        eng.req_to_token_pool.req_to_token[req.row, cpl:len(path)] = path[cpl:].to(torch.int32)
        req.slots[:len(path)] = path.tolist()
        st.kv.cache_protected_len, st.last_node = len(path), node

    def retract(self, i: int) -> None:
        st = self.state.pop(i)
        st.last_node, st.kv.cache_protected_len = None, 0

    def batch(self, extend: dict[int, int], mode: ForwardMode, log: list):
        """A ForwardBatch built through the tap, its device tensors recording host reads."""
        fb = self.eng.batch(extend, mode)
        for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions", "extend_seq_lens",
                     "extend_prefix_lens", "extend_start_loc"):
            if getattr(fb, name) is not None:
                setattr(fb, name, DeviceStandIn.wrap(getattr(fb, name), name, log))
        schedule_batch = types.SimpleNamespace(reqs=[self.state[i] for i in extend], tree_cache=self.eng.radix)
        init_new = host_pages.tapped_init_new(lambda cls, batch, runner: fb)
        return init_new.__get__(None, ForwardBatch)(schedule_batch, None)


def _physical_nodes(meta, req_to_token, req_pool_indices, page_size):
    """Shared nodes of a plan made from the device rows (the page ids the kernel reads)."""
    bs = meta.kv_lens.shape[0]
    width = meta.block_table.shape[1]
    rows = req_to_token[req_pool_indices[:bs].as_subclass(torch.Tensor), :width * page_size].as_subclass(
        torch.Tensor)[:, ::page_size] // page_size
    return _nodes(meta.qo_indptr, meta.kv_lens, rows, page_size)


def _nodes(qo_indptr, kv_lens, table, page_size):
    p = prefixattn.plan(qo_indptr, kv_lens, table, block_size=page_size, num_qo_heads=4, num_kv_heads=2,
                        head_dim=64, q_dtype=torch.float32, sharing="always")
    return {(n.kv_start, n.kv_end, tuple(n.requests.tolist())) for n in p.shared_nodes}


@pytest.mark.parametrize("page_size", [1, 4])
def test_plans_from_the_radix_cache_without_reading_the_device(page_size):
    eng = MiniEngine(page_size=page_size)
    log: list[str] = []
    backend = PrefixAttnBackend(eng.runner(eng.make_pool()), sharing="always")
    real_table = eng.req_to_token_pool.req_to_token
    eng.req_to_token_pool.req_to_token = DeviceStandIn.wrap(real_table, "req_to_token", log)
    sched = Scheduler(eng)

    def step(extend, mode, expected=None, *, graph_padding=0):
        fb = built = sched.batch(extend, mode, log)  # SGLang's runner holds the batch while it replays it
        if graph_padding:
            fb = _replay_view(built, graph_padding)
            backend.init_forward_metadata_out_graph(fb)
        else:
            backend.init_forward_metadata(fb)
        assert log == [], f"init_forward_metadata read device tensors on the host: {log}"
        meta = backend.forward_metadata
        assert meta.route == "radix_cache" and backend.host_table_copies == 0
        ours = _nodes(meta.qo_indptr, meta.kv_lens, meta.block_table, page_size)
        assert ours == _physical_nodes(meta, real_table, fb.req_pool_indices, page_size)
        if expected is not None:
            assert ours == expected
        return meta

    # 1. r0 computed from scratch, then cached.
    r0 = sched.admit(SYSTEM + DOC_A + _question(0))
    step({r0: 24}, ForwardMode.EXTEND, set())
    sched.checkpoint(r0)
    # 2. r1, r2 get system + document A from the cache, r3 the system prompt only (its document B is new).
    r1, r2, r3 = (sched.admit(SYSTEM + doc + _question(i)) for i, doc in ((1, DOC_A), (2, DOC_A), (3, DOC_B)))
    step({r1: 4, r2: 4, r3: 12}, ForwardMode.EXTEND, {(0, 12, (0, 1, 2)), (12, 20, (0, 1))})
    for r in (r1, r2, r3):
        sched.checkpoint(r)
    # 3. Everyone decodes: all four share the system prompt, r0-r2 document A too.
    for r in range(4):
        eng.append_token(r, 500 + r)
    step({r: 1 for r in range(4)}, ForwardMode.DECODE, {(0, 12, (0, 1, 2, 3)), (12, 20, (0, 1, 2))})
    # 4. r1 is preempted; r4 takes its row with system + document B from r3's entry; the batch is reordered and
    #    mixed. Row r1 held document A: a stale view of it would share document A with r0 and r2.
    row = eng.requests[r1].row
    sched.retract(r1)
    r4 = sched.admit(SYSTEM + DOC_B + _question(4), row=row)
    for r in (r3, r0, r2):
        eng.append_token(r, 600 + r)
    step({r3: 1, r4: 4, r0: 1, r2: 1}, ForwardMode.MIXED, {(0, 12, (0, 1, 2, 3)), (12, 20, (0, 1)),
                                                         (12, 20, (2, 3))})
    sched.checkpoint(r4)
    # 5. r0 finished; a replayed decode graph of r2, r3, r4 padded to 4 requests.
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    for r in (r2, r3, r4):
        eng.append_token(r, 700 + r)
    meta = step({r2: 1, r3: 1, r4: 1}, ForwardMode.DECODE, {(0, 12, (0, 1, 2)), (12, 20, (1, 2))}, graph_padding=1)
    assert meta.graph and meta.device_block_table is None  # the graph refills its own table


def _replay_view(fb, num_padding):
    """SGLang's ``build_replay_fb_view``: the padded buffers, the batch's own out_cache_loc."""
    bs = fb.batch_size + num_padding
    pad = lambda t, v: torch.cat([t.as_subclass(torch.Tensor), torch.full((num_padding,), v, dtype=t.dtype)])  # noqa
    log = fb.req_pool_indices._standin[1]
    return types.SimpleNamespace(
        batch_size=bs, forward_mode=ForwardMode.DECODE, actual_forward_mode=fb.forward_mode,
        req_pool_indices=DeviceStandIn.wrap(pad(fb.req_pool_indices, 0), "req_pool_indices", log),
        seq_lens=DeviceStandIn.wrap(pad(fb.seq_lens, 1), "seq_lens", log), seq_lens_cpu=pad(fb.seq_lens_cpu, 1),
        num_padding=num_padding, out_cache_loc=fb.out_cache_loc, spec_info=None, encoder_lens=None)


def test_a_batch_without_a_record_is_copied_from_the_device():
    # A ForwardBatch SGLang's init_new did not build: the rows are copied (the stand-in sees it) and counted.
    eng = MiniEngine()
    log: list[str] = []
    backend = PrefixAttnBackend(eng.runner(eng.make_pool()))
    eng.req_to_token_pool.req_to_token = DeviceStandIn.wrap(eng.req_to_token_pool.req_to_token, "req_to_token", log)
    r0 = eng.add_request(SYSTEM)
    host_pages._LATEST[0] = None
    backend.init_forward_metadata(eng.batch({r0: 12}, ForwardMode.EXTEND))
    assert backend.forward_metadata.route == "device_copy" and backend.host_table_copies == 1
    assert "req_to_token.to" in log


def test_the_tap_wraps_sglangs_init_new_once():
    host_pages.install_tap()
    host_pages.install_tap()
    func = ForwardBatch.__dict__["init_new"].__func__
    assert func._prefixattn_tap and not getattr(func.__wrapped__, "_prefixattn_tap", False)


def test_page_labels_trust_only_the_tree_owned_prefix():
    # Two requests through node "a" (pages 0-1) and "b" (page 2): the second's protected prefix ends inside "b".
    paths = [[("a", 0, 8), ("b", 8, 12)], [("a", 0, 8), ("b", 8, 12)]]
    import numpy as np

    labels = host_pages.page_labels(paths, [12, 9], np.array([4, 4, 1]), page_size=4, width=4, rows=3)
    assert labels[0, :2].tolist() == labels[1, :2].tolist()  # node "a": shared
    assert labels[1, 2] != labels[0, 2]  # page 2 of the second lies past its protected prefix (9 < 12)
    used = [labels[0, :4], labels[1, :4], labels[2, :1]]
    flat = np.concatenate(used).tolist()
    assert len(set(flat)) == len(flat) - 2  # only the two shared pages repeat


def test_native_tree_paths_stop_at_a_node_without_its_device_value():
    # UnifiedRadixCache (SGLang's default) answers collect_path_info with TreePathNodeInfo rows, root first.
    from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import TreePathNodeInfo

    paths = {7: (TreePathNodeInfo(5, 0, 0, 8, 8, 1), TreePathNodeInfo(7, 5, 8, 12, 4, 0)),
             9: (TreePathNodeInfo(5, 0, 0, 8, 8, 1), TreePathNodeInfo(9, 5, 8, 16, None, 0))}

    class Core:
        def collect_path_info(self, ids):
            if any(i not in paths for i in ids):
                raise KeyError(ids)
            return tuple(paths[i] for i in ids)

    cache = types.SimpleNamespace(tree_core=Core())
    got = host_pages.tree_paths(cache, [7, 9, None, 42])  # None: a request without a node; 42: one the tree lost
    assert got == [[(("n", 5), 0, 8), (("n", 7), 8, 12)], [(("n", 5), 0, 8)], [], []]
