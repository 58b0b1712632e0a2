"""The compiled back-end of the planner (numba, optional) against the numpy one: every Plan field equal, the same
ValueErrors.

Both paths run on the frozen golden cases of test_plan_equivalence.py and on random batches (sharing auto / always /
never, causal or not, prefill chunks, split-k, empty requests, q_len 0, int64 tables, num_blocks given). CI installs
numba through the ``test`` extra; without numba the compiled path cannot run and this module is skipped.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba", reason="the compiled planner is optional (pip install prefixattn[fast])")

from prefixattn import plan  # noqa: E402
from prefixattn.autotune.lookup import fixed_config  # noqa: E402
from prefixattn.lcp_tree import clear_tree_cache, lcp_interval_tree  # noqa: E402
from prefixattn.planner import compiled  # noqa: E402
from prefixattn.planner.backend import planner_name, using  # noqa: E402
from prefixattn.planner.compiled import checks as C, node_choice as N, tree as T, work_list as W  # noqa: E402
from prefixattn.planner.compiled import split_rule as S  # noqa: E402
from tests.test_plan_equivalence import CASES, CONFIGS  # noqa: E402


def _plan_with(planner, *args, cold=True, **opts):
    """``plan(*args, **opts)`` with the back-end ``planner`` (``PREFIXATTN_PLANNER``'s values); ``cold``: with the
    tree cache emptied first."""
    if cold:
        clear_tree_cache()
    with using(planner):
        return plan(*args, **opts)


def _fields(p) -> dict:
    """Every Plan field that the planner computes, as comparable Python / numpy values."""
    w, t, n = p.work, p.tree, p.nodes
    out = dict(num_tokens=p.num_tokens, num_requests=p.num_requests, tiles=p.tiles, has_shared=p.has_shared,
               max_block_id=p.max_block_id, stats=sorted(p.stats.items()), num_ws_rows=w.num_ws_rows,
               num_units=w.num_units, use_fp32_dot=p.use_fp32_dot, sm_scale=p.sm_scale, kv_dtype=p.kv_dtype,
               class_ends=tuple(int(e) for e in w.class_ends))
    arrays = dict(items=w.items, gather=w.gather, mrows=w.mrows, order=t.order, lcp=t.lcp, depth=t.depth, lb=t.lb,
                  rb=t.rb, parent=t.parent, kv_start=n.kv_start, kv_end=n.kv_end, depth_blocks=n.depth_blocks,
                  offsets=n.offsets, members=n.members)
    for name in ("items", "gather", "mrows", "block_table"):
        arrays[f"dev_{name}"] = getattr(p, name).cpu().numpy()
    arrays["dev_ranges"] = np.stack([r.cpu().numpy() for r in p.ranges])
    out.update({k: (v.dtype.str, v.shape, v.tobytes()) for k, v in arrays.items()})
    # Uninitialized in the free plan() (every launch zeroes the counters): compared by shape and dtype.
    out["ws"] = tuple((tuple(t.shape), t.dtype) for t in (p.counters, p.ws_o, p.ws_lse))
    return out


def assert_same_plans(a, b, what: str) -> None:
    fa, fb = _fields(a), _fields(b)
    diff = [k for k in fa if fa[k] != fb[k]]
    assert not diff, f"{what}: fields differ between the numpy and the numba planner: {diff}"


def _both(config_key, args, opts):
    with fixed_config(CONFIGS[config_key]):
        ref = _plan_with("numpy", *args, **opts)
        got = _plan_with("numba", *args, **opts)
        again = _plan_with("numba", *args, cold=False, **opts)  # the tree cache's reuse
    return ref, got, again


@pytest.mark.parametrize("name,config_key,thunk", CASES, ids=[c[0] for c in CASES])
def test_golden_cases_equal(name, config_key, thunk):
    indptr, lens, table, opts = thunk()
    ref, got, again = _both(config_key, (indptr, lens, table), opts)
    assert_same_plans(ref, got, name)
    assert_same_plans(ref, again, f"{name} (replanned)")


def random_metadata(rng, *, num_requests, block_size, max_q_len, levels, table_dtype):
    """Random paged metadata with real sharing: requests under random chains of shared blocks, odd lengths, some
    empty requests (q_len 0) and zero-length KV, junk past the used columns."""
    paths, blocks, next_id = [], {}, 0
    for _ in range(num_requests):
        path = tuple(int(rng.integers(0, 3)) for _ in range(levels))
        ids = []
        for d in range(1, len(path) + 1):
            if path[:d] not in blocks:
                n = int(rng.integers(0, 4))
                blocks[path[:d]] = list(range(next_id, next_id + n))
                next_id += n
            ids += blocks[path[:d]]
        paths.append(ids)
    q_len = np.where(rng.random(num_requests) < 0.5, 1, rng.integers(0, max_q_len + 1, num_requests))
    q_len[rng.random(num_requests) < 0.1] = 0
    kv = np.array([len(p) * block_size for p in paths]) + q_len + rng.integers(0, 2 * block_size, num_requests)
    kv[(q_len == 0) & (rng.random(num_requests) < 0.5)] = 0
    width = int(-(-kv.max() // block_size)) + int(rng.integers(0, 3)) if num_requests else 1
    table = np.zeros((num_requests, width), dtype=np.int64)
    for r, p in enumerate(paths):
        own = -(-kv[r] // block_size) - len(p)
        row = p[:max(-(-kv[r] // block_size), 0)] + list(range(next_id, next_id + max(own, 0)))
        next_id += max(own, 0)
        table[r, :len(row)] = row
        table[r, len(row):] = rng.integers(0, next_id + 1, width - len(row))
    indptr = np.concatenate([[0], np.cumsum(q_len)])
    return (torch.from_numpy(indptr.astype(np.int64)), torch.from_numpy(kv.astype(np.int32)),
            torch.from_numpy(table.astype(table_dtype))), next_id


@pytest.mark.parametrize("seed", range(60))
def test_random_batches_equal(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 3, 16]))
    args, num_ids = random_metadata(rng, num_requests=int(rng.integers(0, 30)), block_size=block_size,
                                    max_q_len=int(rng.choice([1, 5, 70])), levels=int(rng.integers(0, 4)),
                                    table_dtype=(np.int32, np.int64)[seed % 2])
    # qo_indptr / kv_lens: int64 / int32 (mixed: both int64 copies), int32 pairs (vLLM's: passed as they are to the
    # compiled calls' int32 variants) and int64 pairs
    pair = (None, torch.int32, torch.int64)[seed // 2 % 3]
    if pair is not None:
        args = (args[0].to(pair), args[1].to(pair), args[2])
    heads = [dict(num_qo_heads=4, num_kv_heads=2, head_dim=64), dict(num_qo_heads=32, num_kv_heads=4, head_dim=128),
             dict(num_qo_heads=8, num_kv_heads=8, head_dim=64)][seed % 3]
    opts = dict(block_size=block_size, causal=seed % 4 != 3, sharing=("auto", "always", "never")[seed % 3],
                q_dtype=(torch.float16, torch.bfloat16, torch.float32)[seed % 3], **heads)
    if seed % 5 in (1, 2):  # split-k: few SMs, short pieces
        opts.update(num_sms=int(rng.integers(1, 9)), min_split_tokens=int(rng.choice([1, 8, 64])))
    if seed % 2:
        opts.update(num_blocks=num_ids + 5)
    if seed % 6 == 4:  # an fp8 cache: the cost rule prices KV at 1 byte (kv_dtype) in both planners
        opts.update(kv_dtype=(torch.float8_e4m3fn, torch.float8_e5m2)[seed % 4 // 2])
    if opts["causal"] and seed % 7 == 0:  # windows: the compiled node choice, the numpy window stage, compiled again
        opts.update(window_left=int(rng.integers(0, 3 * block_size)))
    ref, got, again = _both(("dec", "pre")[seed % 2], args, opts)
    assert_same_plans(ref, got, f"seed {seed}")
    assert_same_plans(ref, again, f"seed {seed} (replanned)")


def test_random_batches_with_requests_apart_equal(monkeypatch):
    """sharing="auto"'s plan with requests apart (SHARING_APART, priced on an sm90 target): forced to win wherever
    the screen fires, it is the same plan from both planners, cold and replanned; and the screen fires on some of
    these batches (prefill chunks of up to 300 rows under shared chains)."""
    from prefixattn.autotune.lookup import planning_target
    from prefixattn.planner import choose

    monkeypatch.setattr(choose, "modeled_faster", lambda *a: True)
    monkeypatch.setattr(choose, "shared_launch_may_lose", lambda *a, **k: False)
    apart = 0
    for seed in range(40):
        rng = np.random.default_rng(1000 + seed)
        block_size = int(rng.choice([3, 16]))
        args, _ = random_metadata(rng, num_requests=int(rng.integers(2, 30)), block_size=block_size,
                                  max_q_len=300, levels=int(rng.integers(1, 4)), table_dtype=np.int32)
        opts = dict(block_size=block_size, sharing="auto", q_dtype=torch.float16, num_sms=int(rng.integers(2, 132)),
                    **[dict(num_qo_heads=8, num_kv_heads=8, head_dim=64),
                       dict(num_qo_heads=32, num_kv_heads=4, head_dim=128)][seed % 2])
        with planning_target("sm90"):  # the shipped tables: a chunk class apart from the decode class
            ref = _plan_with("numpy", *args, **opts)
            got = _plan_with("numba", *args, **opts)
            again = _plan_with("numba", *args, cold=False, **opts)
        assert_same_plans(ref, got, f"seed {seed}")
        assert_same_plans(ref, again, f"seed {seed} (replanned)")
        apart += ref.stats["requests_apart"]
    assert apart > 5, apart


def _adjacent_lcps(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``prev_lcp[r]``: leading columns rows ``r - 1`` and ``r`` share within both lengths (the compiled check's
    hints), by brute force."""
    out = np.zeros(lengths.shape[0], dtype=np.int64)
    for r in range(1, lengths.shape[0]):
        m = int(min(lengths[r - 1], lengths[r]))
        diff = np.nonzero(rows[r - 1, :m] != rows[r, :m])[0]
        out[r] = diff[0] if diff.size else m
    return out


@pytest.mark.parametrize("seed", range(300))
def test_compiled_tree_equals_numpy_tree(seed):
    """The tree alone on small random rows with heavy ties (identical rows, rows that are prefixes of others, runs of
    neighbours under one prefix), without and with the check's neighbour LCP hints (exact, or lowered: any lower
    bound is a valid hint)."""
    rng = np.random.default_rng(seed)
    n, width = int(rng.integers(2, 40)), int(rng.integers(1, 600 if seed % 5 == 0 else 70))
    rows = rng.integers(0, int(rng.integers(1, 4)), (n, width + int(rng.integers(0, 3))))
    if seed % 6 == 1:  # ids past the packed sort key's range: the compiled merge sort
        rows += 2 ** 50
    rows = rows.astype((np.int32, np.int64)[seed % 2])
    if n > 2:
        rows[rng.integers(0, n, n // 2), :width // 2] = rows[0, :width // 2]
        run = int(rng.integers(0, n - 1))  # a run of neighbours under one long prefix (an engine's group)
        rows[run:run + int(rng.integers(2, n - run + 1)), :width - width // 4] = rows[run, :width - width // 4]
    lengths = rng.integers(0, width + 1, n).astype(np.int64)
    ref = lcp_interval_tree(rows[:, :width], lengths)
    hints = _adjacent_lcps(rows, lengths)
    lowered = np.minimum(hints, rng.integers(0, width + 1, n))
    for what, prev_lcp in (("no hints", np.zeros(n, dtype=np.int64)), ("hints", hints), ("lowered hints", lowered)):
        got = T.lcp_interval_tree(rows, width, lengths, prev_lcp)
        for name, a, b in zip(("order", "lcp", "depth", "lb", "rb", "parent"),
                              (ref.order, ref.lcp, ref.depth, ref.lb, ref.rb, ref.parent), got):
            assert a.dtype == b.dtype and np.array_equal(a, b), f"{what}, {name}: {a} vs {b}"


@pytest.mark.parametrize("seed", range(40))
def test_the_checks_hints_are_the_neighbours_lcps(seed):
    """check_values' ``prev_lcp`` is the exact LCP of neighbouring rows' shareable blocks where both have at least
    ``_HINT_MIN_COLUMNS`` of them, else 0 (and empty for a narrower table: no hints at all)."""
    rng = np.random.default_rng(seed)
    n, block_size, cols = int(rng.integers(1, 30)), 4, C._HINT_MIN_COLUMNS + 40
    table = rng.integers(0, 3, (n, cols)).astype(np.int32)
    group = rng.integers(0, n, n // 2)
    table[group, :C._HINT_MIN_COLUMNS + 20] = table[0, :C._HINT_MIN_COLUMNS + 20]  # long shared prefixes
    table[group[::2], C._HINT_MIN_COLUMNS - 30] += 1  # and some that end before the threshold
    blocks = rng.integers(C._HINT_MIN_COLUMNS - 10, cols, n)  # one more block holds the query: used <= cols
    lens = (blocks * block_size + 1).astype(np.int64)  # one query row each: shareable = the blocks above
    indptr = np.arange(n + 1, dtype=np.int64)
    no_cache = (np.zeros((0, 0), dtype=np.int32), np.zeros(0, dtype=np.int64), -1)
    out = C.check_values(indptr, lens, table, block_size, 2, -1, True, False, *no_cache)
    ok, sh_blocks, same, prev_lcp = out[0], out[4], out[7], out[8]
    assert ok and not same and np.array_equal(sh_blocks, blocks)
    long_enough = np.minimum(sh_blocks, np.roll(sh_blocks, 1)) >= C._HINT_MIN_COLUMNS
    assert np.array_equal(prev_lcp, np.where(long_enough, _adjacent_lcps(table, sh_blocks), 0))
    narrow = C.check_values(indptr, np.minimum(lens, 8), np.ascontiguousarray(table[:, :8]), block_size, 2, -1, True,
                            False, *no_cache)
    assert narrow[0] and narrow[8].shape == (0,)


def test_strided_table_uses_the_compiled_variants():
    """A column slice of a wider table (an engine's persistent table) plans like its contiguous copy, through the
    variants compiled for C-contiguous arrays (a strided one would be compiled anew, mid-serving)."""
    wide = torch.tensor([[1, 2, 3, 9, 7, 7], [1, 2, 3, 8, 7, 7], [1, 2, 4, 7, 7, 7]], dtype=torch.int32)
    args = (torch.tensor([0, 1, 2, 3]), torch.tensor([60, 60, 60]), wide[:, :4])
    opts = dict(block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64, sharing="always")
    ref, got, again = _both("dec", args, opts)
    assert_same_plans(ref, got, "strided table")
    assert_same_plans(ref, again, "strided table (replanned)")
    for fn in (C.check_values, T.block_tree, N.select_nodes, S.split_work, W.build_work_list):
        assert all(a.layout == "C" for sig in fn.signatures for a in sig if hasattr(a, "layout")), fn


BAD_INPUTS = [
    ("qo_indptr", (torch.tensor([1, 2]), torch.tensor([4]), torch.zeros((1, 1), dtype=torch.int32)), {}),
    ("kv_lens", (torch.tensor([0, 2]), torch.tensor([1]), torch.zeros((1, 1), dtype=torch.int32)), {}),
    ("block_table", (torch.tensor([0, 1]), torch.tensor([40]), torch.zeros((1, 2), dtype=torch.int32)), {}),
    ("block_table", (torch.tensor([0, 1]), torch.tensor([4]), torch.full((1, 1), 9, dtype=torch.int64)),
     dict(num_blocks=5)),
    ("block_table", (torch.tensor([0, 1]), torch.tensor([4]), torch.full((1, 1), -1, dtype=torch.int32)), {}),
    ("sharing", (torch.tensor([0, 1]), torch.tensor([4]), torch.zeros((1, 1), dtype=torch.int32)),
     dict(sharing="sometimes")),
    ("num_sms", (torch.tensor([0, 1]), torch.tensor([4]), torch.zeros((1, 1), dtype=torch.int32)), dict(num_sms=0)),
]


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("name,args,extra", BAD_INPUTS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_INPUTS)])
def test_same_errors(name, args, extra, index_dtype):
    """The same message from both planners, with int64 and int32 qo_indptr/kv_lens pairs (the compiled checks take
    int32 pairs as they are)."""
    args = (args[0].to(index_dtype), args[1].to(index_dtype), args[2])
    opts = dict(block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64, **extra)
    messages = []
    for planner in ("numpy", "numba"):
        with using(planner), pytest.raises(ValueError, match=f"^{name}: ") as err:
            plan(*args, **opts)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def test_planner_choice():
    """PREFIXATTN_PLANNER picks the back-end when the process first plans (here: when :func:`using` asks), once."""
    with using("auto"):
        assert planner_name() == "numba"
    with using("numpy"):
        assert planner_name() == "numpy"
    with pytest.raises(ValueError, match="^PREFIXATTN_PLANNER: expected one of"), using("fortran"):
        pass


def test_warmup_compiles_the_planner():
    """prefixattn.warmup_kernels (the `prefixattn warmup` command) also compiles the planner, on a CPU host too."""
    import prefixattn

    with using("auto"):
        report = prefixattn.warmup_kernels(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                                           dtypes=torch.float16)
    assert report.planner["name"] == "numba" and report.planner["seconds"] >= 0
    assert any(line.strip().startswith("planner") and "numba" in line for line in report.lines())
    with using("numpy"):
        assert prefixattn.warmup_kernels(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                                         dtypes=torch.float16).planner["name"] == "numpy"


def test_each_compiled_file_pins_the_file_it_compiles_in():
    """numba's on-disk cache keys a file's functions on that file alone: a file whose compiled functions call another
    file's pins it by its source hash, so that a change to the callee changes the caller's file too (and recompiles
    it). This fails until each pin matches (the node choice's pin of the cost rule: tests/test_cost_rule.py)."""
    assert T.CHECKS_SOURCE_HASH == compiled.source_hash(C)
    assert W.SPLIT_SOURCE_HASH == compiled.source_hash(S)


@pytest.mark.parametrize("seed", range(8))
def test_workspace_plans_equal(seed):
    """Plans written into a PlanWorkspace (the engines' path: the workspace stages the tables; with numba the compiled
    work list and the compiled staging of the block table write them) are equal too, each in a workspace of its own (one
    workspace would keep the first plan's table for a planner that staged none)."""
    from prefixattn.planner.workspace import PlanWorkspace, derive_capacity

    rng = np.random.default_rng(100 + seed)
    args, _ = random_metadata(rng, num_requests=12, block_size=4, max_q_len=9, levels=2,
                              table_dtype=(np.int32, np.int64)[seed % 2])
    opts = dict(block_size=4, num_qo_heads=8, num_kv_heads=2, head_dim=64, sharing=("auto", "always")[seed % 2],
                num_sms=int(rng.integers(2, 40)), min_split_tokens=8)
    cap = derive_capacity(max_tokens=max(int(args[0][-1]), 1), max_requests=12, max_blocks_per_request=64,
                          num_kv_heads=2, num_sms=opts["num_sms"], rows_per_tile=(1, 16), max_shared_levels=3)
    with fixed_config(CONFIGS["dec"]):
        ref, got = (_fields(_plan_with(planner, *args, **opts, workspace=PlanWorkspace(
            cap, num_qo_heads=8, head_dim=64, device=torch.device("cpu")))) for planner in ("numpy", "numba"))
    assert not [k for k in ref if ref[k] != got[k]]


def test_auto_falls_back_to_numpy_when_numba_fails_to_compile(monkeypatch):
    """PREFIXATTN_PLANNER=auto: a numba compile error (an incompatible numba) at any stage warns once and plans in
    numpy from then on, the same plan; PREFIXATTN_PLANNER=numba raises it."""
    from numba.core.errors import TypingError

    def broken(*args):
        raise TypingError("no implementation")

    args = (torch.tensor([0, 1, 2, 3]), torch.tensor([60, 60, 60]),
            torch.tensor([[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 4, 7]], dtype=torch.int32))
    opts = dict(block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64, sharing="always")
    ref = _plan_with("numpy", *args, **opts)
    monkeypatch.setattr(W, "build_work_list", broken)
    with pytest.raises(TypingError):
        _plan_with("numba", *args, **opts)
    clear_tree_cache()
    with using("auto"), pytest.warns(RuntimeWarning, match="the compiled planner failed to compile"):
        got = plan(*args, **opts)
        assert planner_name() == "numpy"
    assert_same_plans(ref, got, "fallback")


@pytest.mark.parametrize("seed", range(6))
def test_long_shared_prefixes_equal(seed):
    """Rows sharing more than ``_HINT_MIN_COLUMNS`` blocks (the checks' LCP hints feed the tree build): interleaved
    groups, nested prefixes and a row that leaves its group's prefix early; cold, then a step where one request's
    shareable blocks change (the cache stops matching at that row)."""
    rng = np.random.default_rng(seed)
    n, long = int(rng.integers(3, 24)), C._HINT_MIN_COLUMNS + int(rng.integers(0, 300))
    groups = rng.integers(0, 3, n)
    if seed % 2:
        groups.sort()  # contiguous groups: every neighbour's hint chains to the leader
    prefixes = 10_000 * (1 + np.arange(3))[:, None] + np.arange(long)[None, :]
    width = long + 40
    table = np.empty((n, width), dtype=np.int64)
    for r in range(n):
        table[r, :long] = prefixes[groups[r]]
        table[r, long:] = 100_000 + r * 100 + np.arange(40)
    nested = rng.integers(0, n, n // 3)
    table[nested, long // 2] = 7  # leaves its group's prefix halfway (a shorter common prefix)
    lens = long + rng.integers(1, 40, n)
    args = (torch.arange(n + 1), torch.from_numpy(lens), torch.from_numpy(table.astype((np.int32, np.int64)[seed % 2])))
    opts = dict(block_size=1, num_qo_heads=8, num_kv_heads=2, head_dim=64, sharing="always")
    ref = _plan_with("numpy", *args, **opts)
    got = _plan_with("numba", *args, **opts)
    assert_same_plans(ref, got, "cold")
    lens2 = lens.copy()
    lens2[n // 2] += 1  # one more shareable block for one request
    args2 = (args[0], torch.from_numpy(lens2), args[2])
    warm = _plan_with("numba", *args2, cold=False, **opts)
    assert_same_plans(_plan_with("numpy", *args2, **opts), warm, "warm, one row changed")


@pytest.mark.parametrize("shared", [True, False])
def test_compiled_trees_are_read_only(shared):
    """Every tree the compiled planner hands out is read-only (it is shared by the plans that reuse it, and numba
    compiles a variant per writability), with nodes (cached) or without."""
    table = torch.tensor([[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 4, 7]] if shared else
                         [[1, 2, 3, 9], [4, 5, 6, 8], [7, 10, 11, 12]], dtype=torch.int32)
    p = _plan_with("numba", torch.tensor([0, 1, 2, 3]), torch.tensor([60, 60, 60]), table,
                   block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64, sharing="always")
    assert (p.tree.num_nodes > 0) == shared
    t = p.tree
    assert not any(a.flags.writeable for a in (t.order, t.lcp, t.depth, t.lb, t.rb, t.parent))


def _read_tables(p, kv_lens, block_size) -> tuple:
    """What the kernel reads of a plan: its metadata tables and the block-table cells of each request's blocks."""
    lens = kv_lens.numpy()
    cells = tuple(p.block_table[r, :-(-int(lens[r]) // block_size)].cpu().numpy().tobytes() for r in range(len(lens)))
    return (*(t.cpu().numpy().tobytes() for t in (*p.ranges, p.items, p.gather, p.mrows)),
            p.work.items.tobytes(), cells)


def test_random_steps_through_tight_workspaces_leave_no_wrong_current_plan():
    """Random steps through wrappers with tight capacities (every other one reading the caller's device table), with
    the compiled back-end, which writes the work list into the workspace before the capacity checks: every accepted
    plan reads what the free plan() gives, and a refused step leaves the previous plan either current with what it
    reads unchanged, or stale."""
    from prefixattn import PrefixSharedAttention

    rng = np.random.default_rng(300)
    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=4)
    with using("numba"):
        outcomes = []
        for trial in range(30):
            opts = dict(sharing=("auto", "always", "never")[trial % 3], num_sms=int(rng.integers(2, 20)),
                        min_split_tokens=8)
            caps = dict(max_tokens=int(rng.integers(8, 40)), max_requests=int(rng.integers(4, 12)),
                        max_blocks_per_request=int(rng.integers(4, 40)))
            if rng.random() < 0.5:
                caps["max_items"] = int(rng.integers(4, 40))
            attn = PrefixSharedAttention(**heads, **opts, **caps, q_dtype=torch.float16, device="cpu")
            prev = None
            for step in range(6):
                args, _ = random_metadata(rng, num_requests=int(rng.integers(0, 12)), block_size=4, max_q_len=6,
                                          levels=2, table_dtype=(np.int32, np.int64)[step % 2])
                extra = dict(device_block_table=args[2].to(torch.int32)) if trial % 2 and args[2].shape[1] else {}
                before = _read_tables(prev, *prev_lens) if prev is not None and prev.is_current() else None
                try:
                    p = attn.plan(*args, **extra)
                except ValueError:
                    if before is not None:
                        outcomes.append("intact" if prev.is_current() else "stale")
                        assert not prev.is_current() or _read_tables(prev, *prev_lens) == before, (trial, step)
                    continue
                sharing = "never" if "capacity_fallback" in p.stats else opts["sharing"]
                ref = plan(*args, **heads, q_dtype=torch.float16, **dict(opts, sharing=sharing))
                assert _read_tables(p, args[1], 4) == _read_tables(ref, args[1], 4), (trial, step)
                outcomes.append("accepted")
                prev, prev_lens = p, (args[1], 4)
    # Accepted steps and refused ones that left the plan intact both happened (a stale plan needs a refusal after the
    # work list was written: an id past int32, tests/test_workspace.py).
    assert {"accepted", "intact"} <= set(outcomes)


def test_longest_first_is_the_stable_sort_by_length():
    """The compiled work list's LPT order (each work class sorted apart, by counts when its lengths span few values or
    by packed keys) is numpy's stable argsort of the negated lengths within each class, whatever the class sizes, spans,
    ties and sizes (0 to 600 items, lengths 0 to 2^31 - 1); with prefix runs of >= 2 requests, numpy's run-major
    order (a run's suffix items together at its longest item; shared items and items in no run alone)."""
    from prefixattn.kernels import layout as K
    from prefixattn.ragged import runs_longest_first

    rng = np.random.default_rng(7)
    runs_seen = 0
    for trial in range(400):
        n = int(rng.integers(0, 600))
        span = int(rng.choice([1, 16, 300, 5000, 2 ** 31 - 1]))
        items = rng.integers(-1, 1000, size=(n, K.ITEM_FIELDS)).astype(np.int32)
        items[:, K.ITEM_KV_START] = rng.integers(0, 2 ** 31 - span, size=n)
        items[:, K.ITEM_KV_END] = items[:, K.ITEM_KV_START] + rng.integers(0, span, size=n)
        num_reqs = int(rng.integers(1, 40))
        items[:, K.ITEM_REQ] = rng.integers(0, num_reqs, size=n)
        runs = np.arange(num_reqs)
        if trial % 3:  # neighbouring requests in runs
            runs[rng.random(num_reqs) < 0.5] = 0
            runs = np.maximum.accumulate(runs)
        ends = np.sort(rng.integers(0, n + 1, size=K.NUM_CLASSES))
        ends[-1] = n
        if trial % 4 == 0:  # a decode step's shape: long shared items first, then short suffix ones
            items[:ends[0], K.ITEM_KV_END] = items[:ends[0], K.ITEM_KV_START] + 2048
        length = items[:, K.ITEM_KV_END].astype(np.int64) - items[:, K.ITEM_KV_START]
        cls = np.searchsorted(ends, np.arange(n), side="right")
        req = items[:, K.ITEM_REQ]
        in_run = (np.bincount(runs, minlength=num_reqs)[runs] > 1)[req] & (cls > 0)
        if in_run.any():
            runs_seen += 1
            want = items[runs_longest_first(length, np.where(in_run, runs[req], num_reqs + np.arange(n)), cls)]
        else:
            want = items[np.lexsort((-length, cls))]
        W._longest_first(items, K.ITEM_KV_START, K.ITEM_KV_END, K.ITEM_REQ, ends.astype(np.int64), runs)
        np.testing.assert_array_equal(items, want, err_msg=f"trial {trial}")
    assert runs_seen > 100, runs_seen


def test_prefix_runs_equal():
    """The compiled prefix runs are numpy's (random tables whose neighbours share prefixes of any length, members
    of shared nodes, empty requests; int32 and int64 tables and lengths)."""
    from prefixattn.planner.work_list import prefix_runs

    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(0, 40))
        width = int(rng.integers(0, 12))
        table = rng.integers(0, 4, size=(n, width))
        if width:
            table[:, 1:] = np.where(rng.random((n, width - 1)) < 0.8, table[:, 1:],
                                    rng.integers(0, 50, (n, width - 1)))
        lens = rng.integers(0, width * 16 + 1, size=n)
        members = np.flatnonzero(rng.random(n) < 0.2)
        dtype = (np.int32, np.int64)[trial % 2]
        want = prefix_runs(table.astype(dtype), lens.astype(dtype), members, 16)
        np.testing.assert_array_equal(W.prefix_runs(table.astype(dtype), lens.astype(dtype), members, 16), want)
