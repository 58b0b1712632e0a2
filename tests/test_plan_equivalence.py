"""plan() output is frozen: every Plan array and field, over a broad set of batches, against digests of the planner's
output as last intended (the commit that regenerated them says why).

The digests live in ``tests/plan_golden.json`` (one entry per case, one digest per group of fields: ``meta``,
``work``, ``tree``, ``nodes``, ``device``), so a failure names the case and the part of the plan that changed.
They are generated with::

    PYTHONPATH=$PWD python tests/test_plan_equivalence.py --write

Regenerate them only for an intended change of the plan's output (a new cost rule, new tiles, a new device layout),
and say so in the commit. Tiles are pinned with ``fixed_config`` (the shipped tables can be retuned without
touching the planner), so what is frozen here is the planner: tree, cost rule, split rule, work list, conversions.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # use_fp32_dot depends on it: generate and check under the same value

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from batches.shapes import build_batch, fig8_shapes  # noqa: E402
from prefixattn import plan  # noqa: E402
from prefixattn.autotune.lookup import fixed_config  # noqa: E402
from prefixattn.lcp_tree import clear_tree_cache  # noqa: E402
from tests.prefix_batches import random_batch  # noqa: E402

GOLDEN = Path(__file__).with_name("plan_golden.json")
#: Two tile sets: decode-shaped (the sm90 table's kind: 16-lane suffix tiles) and prefill-shaped (64-lane).
CONFIGS = {
    "dec": {"shared": {"block_m": 64, "block_n": 64}, "suffix": {"block_m": 16, "block_n": 64},
            "launch": {"num_warps": 8, "num_stages": 3}, "suffix_launch": {"num_warps": 4, "num_stages": 3}},
    "pre": {"shared": {"block_m": 128, "block_n": 32}, "suffix": {"block_m": 64, "block_n": 64},
            "launch": {"num_warps": 8, "num_stages": 2}},
}


def _t(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def _odd_cases():
    """Hand-made edge cases: (name, qo_indptr, kv_lens, block_table, options)."""
    h = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64)
    cases = [
        ("empty", _t([0]), _t([]), torch.zeros((0, 3), dtype=torch.int32), dict(block_size=16, **h)),
        ("one_request_len1", _t([0, 1]), _t([1]), _t([[5]]), dict(block_size=16, **h)),
        ("all_q_zero", _t([0, 0, 0]), _t([17, 33]), _t([[1, 2, 0], [1, 2, 3]]), dict(block_size=16, **h)),
        ("kv_zero", _t([0, 0, 1]), _t([0, 16]), _t([[0], [3]]), dict(block_size=16, **h)),
        # Page boundaries: shared prefix exactly one block, one block +- 1 token.
        ("page_exact", _t([0, 1, 2, 3]), _t([17, 17, 16]), _t([[4, 7], [4, 8], [4, 0]]), dict(block_size=16, **h)),
        ("page_minus1", _t([0, 1, 2]), _t([16, 16]), _t([[4, 1], [4, 2]]), dict(block_size=16, **h)),
        ("page_plus1", _t([0, 1, 2]), _t([18, 18]), _t([[4, 1], [4, 2]]), dict(block_size=16, **h)),
        # Identical rows (duplicates), rows that are prefixes of each other, junk past the used columns.
        ("duplicates", _t([0, 1, 2, 3, 4]), _t([40, 40, 40, 9]), _t([[1, 2, 3, 99], [1, 2, 3, 98], [1, 2, 3, 97],
                                                                        [1, 5, 6, 7]]), dict(block_size=16, **h)),
        ("prefix_rows", _t([0, 1, 2, 3]), _t([20, 40, 60]), _t([[1, 2, 0, 0], [1, 2, 3, 0], [1, 2, 3, 4]]),
         dict(block_size=16, **h)),
        ("int64_inputs", _t([0, 3, 4, 9], torch.int64), _t([40, 41, 45], torch.int64),
         _t([[9, 8, 7], [9, 8, 6], [9, 5, 4]], torch.int64), dict(block_size=16, **h)),
        ("block_size1", _t([0, 2, 3, 5]), _t([5, 5, 6]), _t([[1, 2, 3, 4, 5, 0], [1, 2, 3, 6, 7, 0],
                                                            [1, 2, 9, 10, 11, 12]]), dict(block_size=1, **h)),
        ("noncausal", _t([0, 3, 5]), _t([40, 40]), _t([[1, 2, 3], [1, 2, 4]]),
         dict(block_size=16, causal=False, **h)),
        ("mha", _t([0, 1, 2, 3]), _t([300, 300, 300]), _t([[i for i in range(19)], list(range(18)) + [40],
                                                           list(range(18)) + [41]]),
         dict(block_size=16, num_qo_heads=2, num_kv_heads=2, head_dim=128)),
        ("gqa16_bf16", _t([0, 1, 2]), _t([700, 700]), _t([list(range(44)), list(range(43)) + [50]]),
         dict(block_size=16, num_qo_heads=32, num_kv_heads=2, head_dim=128, q_dtype=torch.bfloat16)),
        ("sm_scale_sms", _t([0, 1, 2]), _t([2000, 1000]), _t([list(range(125)), list(range(60)) + [0] * 65]),
         dict(block_size=16, sm_scale=0.3, num_sms=7, min_split_tokens=16, **h)),
        ("wide_ids", _t([0, 1, 2], torch.int64), _t([20, 20], torch.int64),
         _t([[2 ** 33, 5], [2 ** 33, 6]], torch.int64), dict(block_size=16, **h)),
    ]
    return cases


def _cases():
    """Every case: (name, config key, thunk returning (qo_indptr, kv_lens, block_table, options))."""
    out = []
    for gqa in (False, True):
        for s in fig8_shapes(scaled=False, gqa=gqa):
            def thunk(s=s):
                b = build_batch(s, metadata_only=True)
                return b.qo_indptr, b.kv_lens, b.block_table, dict(
                    block_size=s.block_size, num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads,
                    head_dim=s.head_dim, q_dtype=b.dtype, num_blocks=b.num_blocks)
            out.append((f"fig8/{s.name}", "dec", thunk))
            if s.num_prefill:
                out.append((f"fig8-pre/{s.name}", "pre", thunk))
            if s.name.startswith("decode/256d/2048"):
                out.append((f"fig8-never/{s.name}", "dec", lambda thunk=thunk: _with(thunk, sharing="never")))
                out.append((f"fig8-always/{s.name}", "dec", lambda thunk=thunk: _with(thunk, sharing="always")))
    for seed in range(24):
        levels, block_size = seed % 4, (16, 3, 1, 4)[seed // 6 % 4]
        heads = (dict(num_qo_heads=4, num_kv_heads=2, head_dim=64), dict(num_qo_heads=8, num_kv_heads=8, head_dim=64),
                 dict(num_qo_heads=16, num_kv_heads=2, head_dim=128))[seed % 3]

        def thunk(seed=seed, levels=levels, block_size=block_size, heads=heads):
            b = random_batch(seed, num_requests=3 + seed * 2, levels=levels, block_size=block_size,
                             dtype=torch.float16, decode_fraction=(0.5, 1.0, 0.0)[seed % 3], **heads)
            opts = dict(block_size=block_size, q_dtype=torch.float16, causal=seed % 5 != 4, **heads)
            if seed % 4 == 1:
                opts.update(num_sms=3, min_split_tokens=8)
            if seed % 3 == 2:
                opts.update(sharing="always")
            return (*b.metadata, opts)
        out.append((f"random/{seed}", ("dec", "pre")[seed % 2], thunk))
    for name, indptr, lens, table, opts in _odd_cases():
        out.append((f"odd/{name}", "dec", lambda a=(indptr, lens, table, opts): a))
        out.append((f"odd-pre/{name}", "pre", lambda a=(indptr, lens, table, opts): a))
    return out


def _with(thunk, **extra):
    indptr, lens, table, opts = thunk()
    return indptr, lens, table, {**opts, **extra}


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            p = p.detach().cpu().numpy()
        if isinstance(p, np.ndarray):
            h.update(f"{p.dtype.str}{p.shape}".encode())
            h.update(np.ascontiguousarray(p).tobytes())
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


def plan_digests(p) -> dict:
    """One digest per group of the plan's fields (device tensors by content; the workspace by shape and dtype)."""
    w, t, n = p.work, p.tree, p.nodes
    return {
        "meta": _digest(p.num_tokens, p.num_requests, p.num_qo_heads, p.num_kv_heads, p.head_dim, p.block_size,
                        p.causal, p.sm_scale, p.q_dtype, p.device, p.tiles, p.use_fp32_dot, p.has_shared,
                        p.max_block_id, sorted(p.stats.items())),
        "work": _digest(w.items, w.gather, w.mrows, w.num_ws_rows, w.num_units, tuple(w.class_ends)),
        "tree": _digest(t.order, t.lcp, t.depth, t.lb, t.rb, t.parent),
        "nodes": _digest(n.kv_start, n.kv_end, n.depth_blocks, n.offsets, n.members),
        # The merge counters by shape and dtype: the free plan() leaves them uninitialized for the launch to zero
        # (zeros when the digests were made; digested as zeros, the digests still hold).
        "device": _digest(*p.ranges, p.items, p.gather, p.mrows, p.block_table, torch.zeros_like(p.counters),
                          (tuple(p.ws_o.shape), p.ws_o.dtype, tuple(p.ws_lse.shape), p.ws_lse.dtype)),
    }


def run_case(config_key, thunk) -> dict:
    indptr, lens, table, opts = thunk()
    clear_tree_cache()  # cold: the tree is built
    with fixed_config(CONFIGS[config_key]):
        return plan_digests(plan(indptr, lens, table, **opts))


def run_case_twice(config_key, thunk) -> tuple[dict, dict]:
    """Digests of a cold plan and of the same batch planned again (the planner may reuse its last tree)."""
    cold = run_case(config_key, thunk)
    indptr, lens, table, opts = thunk()
    with fixed_config(CONFIGS[config_key]):
        return cold, plan_digests(plan(indptr, lens, table, **opts))


CASES = _cases()


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def test_golden_covers_every_case(golden):
    assert sorted(golden) == sorted(name for name, _, _ in CASES)


@pytest.mark.parametrize("name,config_key,thunk", CASES, ids=[c[0] for c in CASES])
def test_plan_output_unchanged(golden, name, config_key, thunk):
    for when, got in zip(("cold", "replanned"), run_case_twice(config_key, thunk)):
        changed = {k: (golden[name][k], v) for k, v in got.items() if golden[name][k] != v}
        assert not changed, f"{name} ({when}): plan fields changed (group: (golden, now)): {changed}"


@pytest.mark.parametrize("per_group", [0, 3])
def test_decode_loop_matches_cold_plans(per_group):
    """A decode loop (each step every request one token longer, a new block on a boundary) planned step after step
    (the planner may reuse its last tree) gives the plans of cold plans of the same steps."""
    from batches.shapes import Shape

    shape = Shape(scenario="decode", num_decode=12, num_prefill=0, shared=64, distinct=13, per_group=per_group,
                  num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=4)
    b = build_batch(shape, metadata_only=True)
    lens = b.kv_lens.numpy().astype(np.int64)
    fresh = b.num_blocks + np.arange(lens.shape[0] * 8).reshape(lens.shape[0], 8)
    table = torch.from_numpy(np.concatenate([b.block_table.numpy(), fresh.astype(np.int32)], axis=1))
    opts = dict(block_size=4, num_qo_heads=8, num_kv_heads=2, head_dim=64, sharing="always")
    clear_tree_cache()
    with fixed_config(CONFIGS["dec"]):
        for step in range(1, 30):
            step_lens = torch.from_numpy((lens + step).astype(np.int32))
            warm = plan_digests(plan(b.qo_indptr, step_lens, table, **opts))
            clear_tree_cache()
            cold = plan_digests(plan(b.qo_indptr, step_lens, table, **opts))
            assert warm == cold, f"step {step}"
            plan(b.qo_indptr, b.kv_lens + step - 1, table, **opts)  # the previous step again: the tree to reuse


def test_a_table_changed_in_place_is_replanned():
    """Engines reuse their block-table buffer: a plan after an in-place change sees the new ids, never the last tree."""
    table = torch.tensor([[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 4, 7]], dtype=torch.int32)
    args = (torch.tensor([0, 1, 2, 3]), torch.tensor([60, 60, 60]), table)
    opts = dict(block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64, sharing="always")
    with fixed_config(CONFIGS["dec"]):
        before = plan(*args, **opts)
        table[2, 1] = 5  # request 2 no longer shares block 2
        after = plan(*args, **opts)
        clear_tree_cache()
        cold = plan(*args, **opts)
    assert plan_digests(after) == plan_digests(cold) != plan_digests(before)
    assert [n.requests.tolist() for n in after.shared_nodes] == [[0, 1, 2], [0, 1]]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=$PWD python tests/test_plan_equivalence.py --write  (regenerates the golden file)")
    table = {name: run_case(key, thunk) for name, key, thunk in CASES}
    GOLDEN.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(table)} cases to {GOLDEN}")
