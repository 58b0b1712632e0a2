"""bench/batches/shapes.py: the unique-KV lower bound every traffic ratio divides by, the batch layout, and the
default (not slow) part of the traffic grid."""

import numpy as np
import pytest
import torch

from batches.shapes import (FIG8_SETTINGS, NO_SHARING_SETTINGS, TRAFFIC_SHAPES, Shape, build_batch,
                            in_default_traffic_grid)

ODD = Shape(scenario="mixed", num_decode=5, num_prefill=2, shared=32, distinct=9, per_group=3, num_qo_heads=4,
            num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("shape", TRAFFIC_SHAPES + [ODD], ids=lambda s: s.name)
def test_unique_kv_bytes_counts_each_distinct_position_once(shape):
    b = build_batch(shape, metadata_only=True)
    slots = np.unique(np.concatenate([b.kv_slots(r) for r in range(shape.num_requests)]))
    per_token = shape.num_kv_heads * shape.head_dim * 2 * b.dtype.itemsize  # K and V
    assert b.unique_kv_bytes() == slots.size * per_token
    # Sharing layout: a group shares exactly its prefix, nothing else is shared.
    expected = sum((1 if shared else len(members)) * shape.shared for members, shared in b.groups)
    expected += shape.num_requests * shape.distinct
    assert slots.size == expected


def test_batches_are_deterministic_and_the_prefix_is_shared_in_the_cache():
    a, b = build_batch(ODD), build_batch(ODD)
    assert all(torch.equal(x, y) for x, y in ((a.q, b.q), (a.k_cache, b.k_cache), (a.block_table, b.block_table)))
    members, shared = a.groups[0]
    assert shared == ODD.shared and len(members) == 3
    prefix_blocks = ODD.shared // ODD.block_size
    assert all(torch.equal(a.block_table[m, :prefix_blocks], a.block_table[members[0], :prefix_blocks])
               for m in members)


def test_default_grid_keeps_every_family():
    default = [s for s in TRAFFIC_SHAPES if in_default_traffic_grid(s)]
    assert 0 < len(default) < len(TRAFFIC_SHAPES)
    papers = {(s.paper.split(":")[0], s.num_qo_heads != s.num_kv_heads) for s in default}
    assert papers == {("decode32", False), ("decode256", False), ("mixed256", False), ("decode256", True),
                      ("mixed256", True)}
    settings = {s.paper.split(":")[1] for s in default}
    assert {f"{a}/{b}/{c}" for a, b, c in FIG8_SETTINGS} <= settings
    assert {f"0/{d}/1" for d, _ in NO_SHARING_SETTINGS} <= settings
