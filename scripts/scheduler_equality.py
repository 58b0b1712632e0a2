"""Before/after equality harness for scheduler refactors that must not change behaviour.

Records, on a fixed set of inputs, the outputs of the scheduler pieces that a refactor may touch: grouping and
ordering, TokenBatcher step sequences (every StepBatch array, the stats, the prefix levels), partition results (scalar
costs with both split modes, two-resource costs), simulator result rows and the seed workloads. ``record`` writes
them to a JSON file; ``check`` recomputes them and compares exactly (floats by their repr: bit-for-bit; the
simulator's floats to :data:`SIM_REL_TOL`, see there why).

    # the reference, from the commit before the refactor (the script itself copied in: it is newer)
    git archive a508256 | tar -x -C /tmp/base && cp scripts/scheduler_equality.py /tmp/base/scripts/
    (cd /tmp/base && PYTHONPATH=$PWD python scripts/scheduler_equality.py record /tmp/before.json)
    PYTHONPATH=$PWD python scripts/scheduler_equality.py check /tmp/before.json    # here, after; ~1 min

Not a test: the reference file is produced by the code under refactor at its starting commit, so it is a tool, run
before and after, and its verdict quoted in the change's note.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

import numpy as np

#: Simulator runs: (workload, policies, requests) small enough for a few seconds each on a 2-core host.
SIM_CASES = (
    ("batchllm-case1", ("vllm", "batchllm", "sglang", "prefixattn", "prefixattn-overlap"), 120),
    ("blendserve-trace1", ("batchllm", "blendserve", "prefixattn", "nanoflow-dfs"), 200),
    ("blendserve-trace3", ("blendserve", "prefixattn"), 200),
    ("batchllm-micro-1000-1000-sd4", ("batchllm", "prefixattn-2k"), 64),
)

#: The simulator was not bit-reproducible run to run at a508256 (two runs of the same code differed in the last ulp
#: of some per-step times): the engine summed shared-node costs over a set keyed by ``id(group)``, whose iteration
#: order follows memory addresses (fixed since in prefixattn/sim/engine.py: an insertion-ordered dict; two runs now
#: give the same bits). A reference recorded at a508256 is therefore compared to this relative tolerance for the
#: simulator's floats; every integer and string of the simulator rows, and everything else, exactly.
SIM_REL_TOL = 1e-12


def _plain(x):
    """JSON-able, exact: arrays as lists, floats as repr strings (no rounding)."""
    if isinstance(x, np.ndarray):
        return [_plain(v) for v in x.tolist()]
    if isinstance(x, (float, np.floating)):
        return repr(float(x))
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if dataclasses.is_dataclass(x):
        return _plain(dataclasses.asdict(x))
    return x


def _group_tree(g) -> list:
    return [g.prefix_len, list(g.request_ids), list(g.prompt_lens), g.parent_prefix_len, g.dfs_rank,
            [_group_tree(c) for c in g.children]]


def _prompt_sets():
    from tests.scheduling.synthetic import case1_like, nested_random

    rng = np.random.default_rng(7)
    return {
        "case1": case1_like(300, seed=1),
        "nested": nested_random(rng, 120),
        "nested_deep": nested_random(np.random.default_rng(3), 200, alphabet=2, max_len=20),
    }


def grouping_outputs(prompts: dict) -> dict:
    from prefixattn.scheduling import ORDERINGS, group_prompts, order_groups, saving_ratio

    out = {}
    for name, rows in prompts.items():
        rng = np.random.default_rng(5)
        outs = rng.integers(1, 300, len(rows))
        for levels in (1, 2, None):
            groups = group_prompts(rows, levels=levels)
            out[f"{name}/levels={levels}"] = [_group_tree(g) for g in groups]
            out[f"{name}/levels={levels}/saving"] = saving_ratio(rows, groups)
            for o in ORDERINGS:
                try:
                    ordered = order_groups(groups, o, output_lens=outs)
                except TypeError:
                    ordered = order_groups(groups, o)
                out[f"{name}/levels={levels}/{o}"] = [_group_tree(g) for g in ordered]
    return out


def _run_batcher(groups, outs, finish_rule, abort_every=0, max_steps=20000, **kw) -> dict:
    from prefixattn.scheduling import TokenBatcher

    b = TokenBatcher(**kw)
    b.add_groups(groups)
    steps = []
    generated: dict[int, int] = {}
    aborted = set()
    k = 0
    while not b.done and k < max_steps:
        plan = b.step()
        steps.append([plan.step, plan.kinds, plan.request_ids, plan.nodes, plan.starts, plan.num_tokens,
                      plan.preempted, plan.truncated, plan.freed_nodes, plan.kv_blocks_used, plan.total_tokens])
        for r in plan.preempted:
            generated[r] = 0
        for r, kind in zip(plan.request_ids.tolist(), plan.kinds.tolist()):
            if kind != 2:
                generated.setdefault(r, 0)
        for r in set(plan.request_ids.tolist()):
            if b.request_state(r) == "decode":
                generated[r] = generated.get(r, 0) + 1
                if generated[r] >= finish_rule(r, outs):
                    b.finish(r)
        if abort_every and k % abort_every == abort_every - 1:
            waiting = [r for r in sorted(generated) if r not in aborted and
                       b.request_state(r) in ("waiting", "prefill")]
            if waiting:
                b.abort(waiting[-1])
                aborted.add(waiting[-1])
        k += 1
    nodes = []
    i = 0
    while True:
        try:
            nodes.append(list(b.prefix_node(i)))
        except ValueError:
            break
        i += 1
    digest = hashlib.sha256(json.dumps(_plain(steps)).encode()).hexdigest()
    return dict(num_steps=len(steps), digest=digest, steps=_plain(steps[:40]), stats=b.stats, nodes=nodes,
                done=b.done, used=b.kv_blocks_used)


def batching_outputs(prompts: dict) -> dict:
    from prefixattn.scheduling import group_prompts, order_groups

    out = {}
    for name, rows in prompts.items():
        rng = np.random.default_rng(11)
        outs = rng.integers(1, 60, len(rows))
        outs[::17] = 400  # a few long outputs: preemption and truncation paths
        groups = order_groups(group_prompts(rows, levels=None), "batchllm")
        longest = max(len(r) for r in rows)
        roomy = 4 * (longest // 16 + 2) + 64
        tight = longest // 16 + 30
        classes = (np.asarray(outs) > 100).astype(np.int64)
        cases = {
            "plain": dict(token_budget=256, kv_blocks=roomy * 8, block_size=16),
            "tight": dict(token_budget=128, kv_blocks=tight, block_size=16),
            "tight_est": dict(token_budget=128, kv_blocks=tight, block_size=16, output_lens=outs),
            "est_clip": dict(token_budget=200, kv_blocks=roomy, block_size=8, output_lens=outs, reservation_clip=32),
            "const_est": dict(token_budget=64, kv_blocks=roomy, block_size=4, output_lens=20.0),
            "classes": dict(token_budget=256, kv_blocks=roomy, block_size=16, output_lens=outs,
                            memory_classes=classes, class_shares=[0.6, 0.4]),
            "classes_clip": dict(token_budget=96, kv_blocks=tight * 2, block_size=16, output_lens=outs,
                                 reservation_clip=16, memory_classes=classes, class_shares=[0.5, 0.5]),
            "max_out": dict(token_budget=128, kv_blocks=roomy, block_size=16, max_output_len=400),
        }
        for cname, kw in cases.items():
            out[f"{name}/{cname}"] = _run_batcher(groups, outs, lambda r, o: int(o[r]), **kw)
        out[f"{name}/aborts"] = _run_batcher(groups, outs, lambda r, o: int(o[r]), abort_every=7,
                                             token_budget=128, kv_blocks=tight, block_size=16, output_lens=outs)
    return out


def partition_outputs(prompts: dict) -> dict:
    from prefixattn.scheduling import ResourceCost, group_prompts, partition_groups, token_cost
    from prefixattn.scheduling.partition import shard_requests, sharded_saving_ratio

    out = {}
    for name, rows in prompts.items():
        rng = np.random.default_rng(13)
        outs = rng.integers(1, 500, len(rows)).astype(np.float64)
        outs[::11] *= 20
        groups = group_prompts(rows, levels=None)
        lens = {}
        for r, row in enumerate(rows):
            lens[r] = len(row)

        def vec(g, outs=outs):
            ids = np.asarray(g.request_ids, dtype=np.int64)
            o = outs[ids]
            return ResourceCost(compute=float(g.processed_tokens) + 0.2 * float(o.sum()),
                                memory=float((o * np.asarray(g.prompt_lens)).sum()) * 1e-3,
                                critical=float(o.max()) * 0.5)

        costs = {"tokens": token_cost(), "tokens+out": token_cost(outs, decode_weight=3.0), "vector": vec}
        for cname, cost in costs.items():
            for n in (1, 2, 3, 5, 8, 16):
                for split in (("spread", "fill") if cname != "vector" else ("spread",)):
                    for allow, refine in ((True, True), (False, True), (True, False)):
                        p = partition_groups(groups, n, cost, allow_split=allow, split=split, refine=refine)
                        out[f"{name}/{cname}/n={n}/{split}/allow={allow}/refine={refine}"] = dict(
                            summary=p.summary(), replicas=p.replicas, source=p.source, costs=p.costs,
                            groups=[_group_tree(g) for g in p.groups], request_replicas=p.request_replicas(),
                            resources=p.resources, critical=p.critical, fair=p.fair)
        for how in ("round-robin", "random"):
            rep = shard_requests(len(rows), 4, how, seed=2)
            out[f"{name}/shard/{how}"] = dict(rep=rep, saving=sharded_saving_ratio(rows, rep, levels=None))
    # the simulator's own cost model (scalar and two-resource) on a seed workload
    from prefixattn.sim.step_cost import CostModel
    from prefixattn.sim.group_cost import GroupCostModel
    from prefixattn.sim.workloads import PAPER_SETTINGS, get_workload

    for wname, nreq in (("blendserve-trace1", 300), ("batchllm-case1", 200)):
        w = get_workload(wname, num_requests=nreq, seed=0)
        model, gpu = PAPER_SETTINGS[wname]
        gcm = GroupCostModel(CostModel(gpu, model), output_lens=np.array([r.output_len for r in w.requests]))
        groups = group_prompts([r.prompt for r in w.requests])
        for n in (2, 4, 8):
            for cname, cost in (("model", gcm), ("model-resources", gcm.resources)):
                p = partition_groups(groups, n, cost)
                out[f"sim/{wname}/{cname}/n={n}"] = dict(summary=p.summary(), replicas=p.replicas,
                                                         source=p.source, costs=p.costs)
    return out


def sim_outputs() -> dict:
    from prefixattn.sim.simulate import simulate

    out = {}
    for workload, policies, n in SIM_CASES:
        for r in simulate(workload, list(policies), num_requests=n):
            out[f"{workload}/{n}/{r.policy}"] = dataclasses.asdict(r)
    return out


def workload_outputs() -> dict:
    from prefixattn.sim.workloads import WORKLOADS, blendserve_density, get_workload

    out = {}
    for name in WORKLOADS:
        w = get_workload(name, num_requests=300, seed=0)
        out[name] = dict(info=getattr(w, "info", None), density=blendserve_density(w),
                         requests=[[len(r.prompt), int(r.output_len)] for r in w.requests])
    return out


ALL = ("grouping", "batching", "partition", "sim", "workloads")


def collect(which=ALL) -> dict:
    prompts = _prompt_sets()
    fns = dict(grouping=lambda: grouping_outputs(prompts), batching=lambda: batching_outputs(prompts),
               partition=lambda: partition_outputs(prompts), sim=sim_outputs, workloads=workload_outputs)
    return {k: _plain(fns[k]()) for k in which}


def _close(a, b, rel: float) -> bool:
    """Float reprs equal to ``rel`` (only used for the simulator, see :data:`SIM_REL_TOL`)."""
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError):
        return False
    return abs(x - y) <= rel * max(abs(x), abs(y))


def _diff(a, b, path="", out=None, limit=20, rel=0.0):
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'after' if k not in a else 'before'}")
            else:
                _diff(a[k], b[k], f"{path}/{k}", out, limit, rel)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out, limit, rel)
    elif a != b and not (rel and isinstance(a, str) and isinstance(b, str) and _close(a, b, rel)):
        out.append(f"{path}: before {str(a)[:120]} after {str(b)[:120]}")
    return out


def main(argv) -> int:
    if len(argv) < 3 or argv[1] not in ("record", "check"):
        print(__doc__)
        return 2
    which = tuple(argv[3].split(",")) if len(argv) > 3 else ALL
    if argv[1] == "check":
        with open(argv[2]) as f:
            before = json.load(f)
        missing = [k for k in which if k not in before]
        if missing:
            print(f"not in {argv[2]} (not compared): {', '.join(missing)}")
        which = tuple(k for k in which if k in before)
    now = collect(which)
    if argv[1] == "record":
        with open(argv[2], "w") as f:
            json.dump(now, f)
        print(f"recorded {', '.join(f'{k}: {len(v)} cases' for k, v in now.items())} -> {argv[2]}")
        return 0
    bad = 0
    for k in which:
        d = _diff(before[k], now[k], rel=SIM_REL_TOL if k == "sim" else 0.0)
        print(f"{k}: {len(now[k])} cases, {'IDENTICAL' if not d else 'DIFFERENT'}")
        for line in d:
            print("   ", line)
        bad += bool(d)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
