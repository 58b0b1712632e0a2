"""TokenBatcher's small state types on hand-built cases (the batcher's own tests cover them in use)."""

import numpy as np

from prefixattn.scheduling.batch_state import PrefixLevels, RequestStore
from prefixattn.scheduling.kv_ledger import KVLedger
from prefixattn.scheduling.work_queues import WorkQueues


def test_kv_ledger_counts_blocks_of_levels_and_requests():
    lv = PrefixLevels()
    v = lv.new(start=0, size=9, parent=-1, rank=0, rep=0)
    kv = KVLedger(kv_blocks=10, block_size=4)
    kv.activate(lv, v)
    assert lv.active[v] and kv.active_full_blocks == 3 and kv.used == 0  # reserved at full size, nothing held yet
    kv.extend(0, 5)  # the level's first chunk: 5 tokens, 2 blocks
    lv.done[v] = 5
    assert kv.used == 2
    assert kv.room(5) == 3 + 8 * 4  # the rest of its second block and the 8 free blocks
    kv.extend(0, 6)  # a request's 6 own tokens: 2 more blocks
    assert kv.used == 4 and kv.fits(6) and not kv.fits(7)
    kv.release(6)
    kv.free_level(lv, v, report=True)
    assert kv.used == 0 and kv.active_full_blocks == 0 and not lv.active[v] and lv.done[v] == 0
    assert kv.take_freed() == [v] and kv.take_freed() == []
    kv.free_level(lv, v, report=True)  # not started: nothing held, nothing reported
    assert kv.take_freed() == []


def test_work_queues_next_class_is_the_earliest_rank_not_held():
    q = WorkQueues(num_classes=3)
    q.push_ready(0, 7, 70)
    q.push_ready(1, 3, 30)
    q.push_ready(1, 9, 90)
    assert q.next_class(set()) == 1
    assert q.next_class({1}) == 0
    assert q.next_class({0, 1}) == -1
    q.decoding[5] = None
    q.prefilling[2] = None
    assert q.anything_started() and q.started_slots().tolist() == [5, 2]
    q.stop(5)
    q.stop(2)
    assert not q.anything_started() and q.started_slots().dtype == np.int64


def test_prefix_levels_unref_frees_the_chain_innermost_first():
    lv = PrefixLevels()
    top = lv.new(start=0, size=4, parent=-1, rank=0, rep=0)
    mid = lv.new(start=4, size=4, parent=top, rank=0, rep=0)
    for v in (top, top, mid):  # two requests below the top level, one of them below the middle one too
        lv.refs[v] += 1
    lv.mark_started(mid, 1)
    assert lv.started_members == [1, 1]
    assert lv.unref(mid) == [mid]
    assert lv.unref(top) == [top]
    assert lv.unref(-1) == []


def test_request_store_add_and_decode():
    req = RequestStore()
    s = req.add(r=4, prompt_len=10, node=-1, base=3, rank=2, step=5)
    assert req.slot_of(4) == s and req.own[s] == req.target[s] == 7 and req.state_name(s) == "waiting"
    req.decoded(np.array([s]), step=6)
    req.decoded(s, step=7)
    assert (req.computed[s], req.generated[s], req.last[s]) == (2, 2, 7)
