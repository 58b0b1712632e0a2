"""prefixattn.planner.window: a sliding window keeps in a shared node only the members all of whose rows see all of it."""

import numpy as np

from prefixattn.planner.window import window_shared_nodes
from prefixattn.planner.work_list import SharedNodes


def _nodes(spans, members):
    counts = [len(m) for m in members]
    return SharedNodes(kv_start=np.array([s for s, _ in spans]), kv_end=np.array([e for _, e in spans]),
                       depth_blocks=np.array([e // 4 for _, e in spans]), offsets=np.r_[0, np.cumsum(counts)],
                       members=np.array([r for m in members for r in m], dtype=np.int64))


def test_members_outside_inside_and_across_the_window():
    # Node 0 = [0, 16) of requests 0-3, node 1 = [16, 32) (its child) of requests 0-2; decodes, W = 20.
    # Request 0 (kv 34) sees keys 13..: node 0 only partly -> leaves it and node 1; its suffix starts at 13.
    # Request 1 (kv 33) sees 12..: the same, suffix from 12.
    # Request 2 (kv 40) sees 19..: node 0 lies wholly before its window (leaves it, reads nothing there), node 1
    # partly -> leaves it; suffix from 19. Request 3 (kv 18) sees everything: keeps node 0, suffix from 16.
    nodes = _nodes([(0, 16), (16, 32)], [[0, 1, 2, 3], [0, 1, 2]])
    out, suffix = window_shared_nodes(nodes, np.array([32, 32, 32, 16]), kv_len=np.array([34, 33, 40, 18]),
                                      q_len=np.array([1, 1, 1, 1]), window_left=20)
    assert out.kv_start.tolist() == [0] and out.offsets.tolist() == [0, 1] and out.members.tolist() == [3]
    assert suffix.tolist() == [13, 12, 19, 16]


def test_member_whose_window_starts_at_a_node_keeps_it():
    # A window wide enough keeps both; then request 1's window starts exactly at node 1's start: it leaves node 0
    # (wholly before) and keeps node 1.
    nodes = _nodes([(0, 16), (16, 32)], [[0, 1], [0, 1]])
    out, suffix = window_shared_nodes(nodes, np.array([32, 32]), kv_len=np.array([33, 37]), q_len=np.array([1, 1]),
                                      window_left=100)
    assert out.members.tolist() == [0, 1, 0, 1]
    # W = 20: request 0 (kv 33) sees 12.. (node 0 partly: leaves both), request 1 (kv 37) sees 16.. exactly.
    out, suffix = window_shared_nodes(nodes, np.array([32, 32]), kv_len=np.array([33, 37]), q_len=np.array([1, 1]),
                                      window_left=20)
    assert out.kv_start.tolist() == [16] and out.offsets.tolist() == [0, 1] and out.members.tolist() == [1]
    assert suffix.tolist() == [12, 32]


def test_window_that_covers_everything_changes_nothing():
    nodes = _nodes([(0, 16), (16, 32)], [[0, 1, 2], [0, 1]])
    suffix = np.array([32, 32, 16])
    out, new_suffix = window_shared_nodes(nodes, suffix, kv_len=np.array([40, 36, 20]), q_len=np.array([1, 4, 2]),
                                          window_left=100)
    assert out.members.tolist() == nodes.members.tolist() and out.offsets.tolist() == nodes.offsets.tolist()
    assert new_suffix.tolist() == suffix.tolist()


def test_prefill_chunk_longer_than_the_window_shares_nothing():
    # 8 rows, W = 3: no key is seen by all rows, so the request leaves every node that reaches its window.
    nodes = _nodes([(0, 16)], [[0, 1]])
    out, suffix = window_shared_nodes(nodes, np.array([16, 16]), kv_len=np.array([24, 17]), q_len=np.array([8, 1]),
                                      window_left=3)
    assert out.members.tolist() == [] and len(out) == 0
    assert suffix.tolist() == [13, 13]  # request 0 from its first row's window (16 - 3); request 1 from 16 - 3
