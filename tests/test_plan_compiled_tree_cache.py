"""The compiled planner's tree cache (:mod:`prefixattn.lcp_tree.blocks`, kept by
:func:`prefixattn.planner.compiled.tree.block_tree`): reused only where a fresh build gives the same tree (equal rows,
or rows grown past their LCPs), its rows its own, its entry whole whatever fails; every plan equal to the numpy
planner's. Helpers from ``tests/test_plan_compiled.py``; skipped without numba, as that module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba", reason="the compiled planner is optional (pip install prefixattn[fast])")

from prefixattn import plan  # noqa: E402
from prefixattn.lcp_tree import clear_tree_cache  # noqa: E402
from prefixattn.planner import compiled  # noqa: E402
from prefixattn.planner.backend import NUMPY, using  # noqa: E402
from prefixattn.planner.compiled import tree as compiled_tree  # noqa: E402
from tests.test_plan_compiled import _plan_with, assert_same_plans  # noqa: E402


@pytest.mark.parametrize("change", ["shared block", "last shared column", "unchanged", "fewer columns",
                                    "one fewer shared block"])
def test_a_warm_tree_cache_follows_the_table(change):
    """The compiled checks compare the cached tree's rows while they read the table: a changed id anywhere in the
    shared columns (or a different width) must build a new tree, an unchanged step reuses it; both equal a cold plan."""
    import prefixattn.lcp_tree as lcp

    rng = np.random.default_rng(7)
    n, block_size, shared = 12, 4, 6
    table = np.concatenate([np.tile(np.arange(shared), (n, 1)), 100 + rng.permutation(n * 5).reshape(n, 5)], axis=1)
    lens = np.full(n, (shared + 3) * block_size)
    args = (torch.arange(n + 1), torch.from_numpy(lens), torch.from_numpy(table.astype(np.int32)))
    opts = dict(block_size=block_size, num_qo_heads=8, num_kv_heads=2, head_dim=64, sharing="always")
    _plan_with("numba", *args, **opts)  # fills the cache
    cached = lcp.cached_entry()[2]
    table2, lens2 = table.copy(), lens.copy()
    if change == "shared block":
        table2[n // 2, 2] = 999
    elif change == "last shared column":
        table2[n - 1, shared - 1] = 998
    elif change == "fewer columns":
        table2 = table2[:, :shared + 3].copy()
    elif change == "one fewer shared block":
        lens2[:] = (shared + 2) * block_size - 3  # the last shareable block is now the row's last, partly queried
    args2 = (args[0], torch.from_numpy(lens2), torch.from_numpy(table2.astype(np.int32)))
    warm = _plan_with("numba", *args2, cold=False, **opts)
    assert (warm.tree is cached) == (change in ("unchanged", "fewer columns"))
    assert_same_plans(_plan_with("numpy", *args2, **opts), warm, change)


@pytest.mark.parametrize("case", ["every row matches", "a late row differs", "num_blocks at a cached id",
                                  "after the numpy planner's entry", "a grown block holds the largest id"])
def test_cached_ids_count_in_max_block_id_and_are_checked_again_below_num_blocks(case):
    """While every row equals its cached row, the compiled checks range-check only the ids past the cached ones and
    count the entry's largest id (here in row 0's cached blocks only) in max_block_id. A row off the cache makes the
    rows before it count their cached ids; a num_blocks at or below the entry's largest id, or an entry of the numpy
    planner (its largest id not known), checks them all again; a block that grew into the cached rows in place
    (status 3) raises the entry's largest id."""
    import prefixattn.lcp_tree as lcp

    n, block_size, shared = 12, 4, 6
    rng = np.random.default_rng(5)
    table = np.concatenate([np.tile(np.arange(shared), (n, 1)), 100 + rng.permutation(n * 5).reshape(n, 5)], axis=1)
    table[0, shared + 1] = 500  # the largest id: a shareable block of row 0 alone
    lens = np.full(n, (shared + 3) * block_size)  # 9 shareable blocks (one query row), 9 used
    args = (torch.arange(n + 1), torch.from_numpy(lens), torch.from_numpy(table.astype(np.int32)))
    opts = dict(block_size=block_size, num_qo_heads=8, num_kv_heads=2, head_dim=64, sharing="always")
    _plan_with("numpy" if case == "after the numpy planner's entry" else "numba", *args, **opts)
    assert lcp.cached_entry()[3] == (lcp.UNKNOWN_MAX_ID if case == "after the numpy planner's entry" else 500)
    if case in ("num_blocks at a cached id", "after the numpy planner's entry"):
        with pytest.raises(ValueError, match="block_table"):
            _plan_with("numba", *args, cold=False, **opts, num_blocks=500)
        return
    largest = 500
    if case == "a late row differs":
        table[n - 1, shared + 2] = 99
        args = (args[0], args[1], torch.from_numpy(table.astype(np.int32)))
    if case == "a grown block holds the largest id":  # row 0 grows by one shareable block, past its LCPs
        table[0, shared + 3] = largest = 900
        lens[0] += block_size
        args = (args[0], torch.from_numpy(lens), torch.from_numpy(table.astype(np.int32)))
        tree = lcp.cached_entry()[2]
        assert _plan_with("numba", *args, cold=False, **opts).tree is tree  # kept: grown in place
        assert lcp.cached_entry()[3] == 900
        with pytest.raises(ValueError, match="block_table"):
            _plan_with("numba", *args, cold=False, **opts, num_blocks=900)
    warm = _plan_with("numba", *args, cold=False, **opts, num_blocks=largest + 1)
    assert warm.max_block_id == largest
    assert_same_plans(_plan_with("numpy", *args, **opts, num_blocks=largest + 1), warm, case)


def test_the_tree_cache_keeps_its_own_rows_and_no_tree_of_other_rows(monkeypatch):
    """The compiled checks copy a new tree's rows into the cache's spare buffer themselves. The cache holds a copy
    (an engine rewrites its table in place); a refused step, a batch too large to keep and a failure after the copy
    leave the last entry whole (never the last tree with other rows)."""
    import prefixattn.lcp_tree as lcp

    n, block_size, shared = 12, 4, 6
    rng = np.random.default_rng(11)
    table = torch.from_numpy(np.concatenate([np.tile(np.arange(shared), (n, 1)),
                                             100 + rng.permutation(n * 5).reshape(n, 5)], axis=1).astype(np.int32))
    args = (torch.arange(n + 1), torch.full((n,), (shared + 3) * block_size), table)
    opts = dict(block_size=block_size, num_qo_heads=8, num_kv_heads=2, head_dim=64, sharing="always")
    first = _plan_with("numba", *args, **opts)
    rows, _, tree, _ = lcp.cached_entry()
    assert tree is first.tree and rows.shape == (n, shared + 3) and np.array_equal(rows, table.numpy()[:, :shared + 3])
    # In place, as an engine reuses its table: the cache's rows are its own, so the tree is rebuilt.
    table[n // 2, 2] = 77
    moved = _plan_with("numba", *args, cold=False, **opts)
    assert moved.tree is not tree
    assert_same_plans(_plan_with("numpy", *args, **opts), moved, "table changed in place")
    entry = _plan_with("numba", *args, **opts) and lcp.cached_entry()
    # A refused step (an id past num_blocks) and a batch past the buffer (not kept) leave the entry as it was.
    with pytest.raises(ValueError, match="block_table"):
        plan(*args, **opts, num_blocks=10)
    big_n = lcp.COMPILED_CACHE_MAX_ENTRIES // 8 + 1
    big = plan(torch.arange(big_n + 1), torch.full((big_n,), 8 * block_size),
               torch.zeros((big_n, 8), dtype=torch.int32), **opts)
    assert big.tree.num_nodes and lcp.cached_entry() is entry
    assert _plan_with("numba", *args, cold=False, **opts).tree is entry[2]
    # A failure after the call copied the rows of another batch: the entry and its rows are as they were, and the
    # next steps (the entry's batch, then the other one) plan right from there.
    other = (args[0], args[1], table.flip(0).contiguous())
    refs = [_plan_with("numpy", *a, **opts) for a in (args, other)]  # cold: before the entry below
    _plan_with("numba", *args, **opts)
    entry = lcp.cached_entry()
    rows_before = entry[0].copy()
    monkeypatch.setattr(compiled_tree, "_unpack_tree", lambda *a: 1 / 0)
    with using("numba"), pytest.raises(ZeroDivisionError):
        plan(*other, **opts)
    assert lcp.cached_entry() is entry and np.array_equal(entry[0], rows_before)
    monkeypatch.undo()
    again = _plan_with("numba", *args, cold=False, **opts)
    assert again.tree is entry[2]
    assert_same_plans(refs[0], again, "the entry's batch after a failed step")
    assert_same_plans(refs[1], _plan_with("numba", *other, cold=False, **opts), "after a failed step")


def test_tree_cache_buffers_across_table_dtypes():
    """Steps switching between int32 and int64 tables (the spare buffer is replaced by one of the new dtype; the
    cache compares only a table of its entry's dtype) and between batches: a step reuses the last tree exactly when
    its table has the last step's dtype and rows, and every plan equals the numpy planner's (computed first, cold)."""
    rng = np.random.default_rng(12)
    opts = dict(block_size=4, num_qo_heads=8, num_kv_heads=2, head_dim=64, sharing="always")
    n = 10
    batches = [np.concatenate([np.tile(np.arange(shared), (n, 1)), 50 + rng.permutation(n * 4).reshape(n, 4)],
                              axis=1) for shared in (3, 5)]
    steps = [(0, np.int32), (0, np.int32), (0, np.int64), (1, np.int64), (1, np.int64), (0, np.int32), (1, np.int32),
             (1, np.int32), (1, np.int64), (0, np.int64)]

    def args(step):
        t = batches[step[0]]
        return torch.arange(n + 1), torch.full((n,), t.shape[1] * 4), torch.from_numpy(t.astype(step[1]))

    refs = [_plan_with("numpy", *args(step), **opts) for step in steps]
    clear_tree_cache()
    last = None
    for k, step in enumerate(steps):
        warm = _plan_with("numba", *args(step), cold=False, **opts)
        assert (last is not None and warm.tree is last.tree) == (k > 0 and steps[k - 1] == step), f"step {k}"
        assert_same_plans(refs[k], warm, f"step {k}")
        last = warm


@pytest.mark.parametrize("seed", range(3))
def test_decode_steps_with_staggered_lengths_keep_the_tree_while_rows_grow_past_their_lcps(seed):
    """Decode steps as an engine runs them: requests one token longer per step, each at its own offset in its
    block, a fresh block id written into a row when it crosses a block boundary (cells past a row's blocks 0).
    Groups under nested prefixes, some requests ending exactly at their prefix's end (growing there can change the
    tree). The compiled planner keeps the tree while the rows that grow do so past their LCPs and rebuilds it
    otherwise (both happen); every step's plan equals the numpy planner's, computed cold beforehand."""
    import prefixattn.lcp_tree as lcp

    rng = np.random.default_rng(40 + seed)
    bs, n, steps = 4, 18, 14
    prefix_a, prefix_b = list(range(1, 6)), list(range(10, 13))
    rows, lens = [], []
    for r in range(n):
        prefix = prefix_a + [20, 21] if r % 3 == 0 else prefix_a if r % 3 == 1 else prefix_b
        # A sixth of the requests start with their prefix's blocks only: growing past its end can change the tree.
        own = 0 if r % 6 == 1 else int(rng.integers(1, 3))
        rows.append(prefix + [100 + 10 * r + k for k in range(own)])
        lens.append(len(rows[-1]) * bs - int(rng.integers(0, bs)))
    width = max(len(x) for x in rows) + steps // bs + 2
    table = np.zeros((n, width), dtype=np.int32)
    for r, row in enumerate(rows):
        table[r, :len(row)] = row
    lens = np.array(lens)
    fresh = 1000
    inputs = []
    for step in range(steps):
        lens = lens + 1
        for r in range(n):
            used = -(-int(lens[r]) // bs)
            if table[r, used - 1] == 0:
                table[r, used - 1] = fresh
                fresh += 1
        inputs.append((torch.arange(n + 1), torch.from_numpy(lens.copy()), torch.from_numpy(table.copy())))
    opts = dict(block_size=bs, num_qo_heads=8, num_kv_heads=2, head_dim=64, sharing="always")
    refs = [_plan_with("numpy", *a, **opts) for a in inputs]
    clear_tree_cache()
    kept_while_growing = rebuilt = 0
    last = None
    for k, a in enumerate(inputs):
        got = _plan_with("numba", *a, cold=False, **opts)
        assert_same_plans(refs[k], got, f"step {k}")
        shareable_blocks = -(-(a[1].numpy() - 1) // bs)  # causal decode: kv_len - 1 shareable tokens
        # The entry always holds this step's block counts (the kept tree's rows grew with them).
        assert np.array_equal(lcp.cached_entry()[1], shareable_blocks), f"step {k}"
        if last is not None:
            grew = (shareable_blocks != -(-(inputs[k - 1][1].numpy() - 1) // bs)).any()
            kept_while_growing += bool(grew) and got.tree is last.tree
            rebuilt += got.tree is not last.tree
        last = got
    assert kept_while_growing and rebuilt, (kept_while_growing, rebuilt)


def _random_decode_run(seed: int, compiled, pool, long_prefix: bool = False) -> tuple:
    """One random engine-like decode run (nested prefixes, int32 or int64 table, requests without queries, causal or
    not, most requests one token longer per step, fresh block ids written at crossings) planned warm by the compiled
    planner; each step checked against the numpy planner run cold on another thread (its own tree cache). Returns
    ``(steps, trees kept, trees rebuilt)``."""
    from prefixattn.planner.options import checked_options
    from prefixattn.planner.plans import OPTION_DEFAULTS, plan_with_options

    rng = np.random.default_rng(seed)
    bs, n = int(rng.choice([2, 4, 16])), int(rng.integers(2, 40))
    o = checked_options(**{**OPTION_DEFAULTS, "block_size": bs, "num_qo_heads": 8, "num_kv_heads": 2, "head_dim": 64,
                           "sharing": "always", "causal": bool(rng.random() < 0.8)})
    first = int(rng.integers(1030, 1100)) if long_prefix else int(rng.integers(1, 8))  # >= 1,024: the checks' hints
    prefixes = [list(rng.integers(1, 50, first))]
    for _ in range(int(rng.integers(0, 4))):
        base = prefixes[int(rng.integers(0, len(prefixes)))]
        cut = int(rng.integers(0, len(base) + 1))
        prefixes.append(base[:cut] + list(rng.integers(50, 90, int(rng.integers(0, 4)))))
    rows = [list(prefixes[int(rng.integers(0, len(prefixes)))]) + [1000 + 10 * r + k for k in range(rng.integers(0, 3))]
            for r in range(n)]
    steps = int(rng.integers(5, 25))
    table = np.zeros((n, max(len(x) for x in rows) + steps // bs + 3), dtype=rng.choice([np.int32, np.int64]))
    for r, row in enumerate(rows):
        table[r, :len(row)] = row
    lens = np.array([max(1, len(row) * bs - int(rng.integers(0, bs))) for row in rows])
    has_queries = rng.random(n) >= 0.1
    fresh, last, kept, rebuilt = 5000, None, 0, 0

    def reference(args):
        clear_tree_cache()
        return plan_with_options(o, *args, planner=NUMPY)

    clear_tree_cache()
    for step in range(steps):
        lens = lens + (rng.random(n) < 0.8)
        for r in range(n):
            used = -(-int(lens[r]) // bs)
            if table[r, used - 1] == 0:
                table[r, used - 1], fresh = fresh, fresh + 1
        indptr = np.concatenate([[0], np.cumsum(has_queries)])
        args = (torch.from_numpy(indptr), torch.from_numpy(lens.copy()), torch.from_numpy(table.copy()))
        got = plan_with_options(o, *args, planner=compiled)
        assert_same_plans(pool.submit(reference, args).result(), got, f"seed {seed} step {step}")
        if last is not None and got.tree.num_nodes:
            kept += got.tree is last.tree
            rebuilt += got.tree is not last.tree
        last = got
    return steps, kept, rebuilt


def test_random_decode_runs_plan_as_the_numpy_planner_with_the_tree_kept_or_rebuilt():
    """150 random engine-like decode runs, and 6 under prefixes of >= 1,024 blocks (the checks' LCP hints): every
    step's compiled plan, tree included, equals the numpy planner's; trees are both kept and rebuilt (by hand, 3,000
    runs and 60 long ones passed the same check: ~39,800 steps)."""
    from concurrent.futures import ThreadPoolExecutor

    compiled_backend = compiled.backend(strict=True)
    with ThreadPoolExecutor(max_workers=1) as pool:
        totals = np.array([_random_decode_run(seed, compiled_backend, pool) for seed in range(150)]
                          + [_random_decode_run(seed, compiled_backend, pool, long_prefix=True)
                             for seed in range(6)]).sum(0)
    assert totals[1] > totals[0] // 4 and totals[2] > totals[0] // 20, totals
