"""``prefixattn partition``: assign an offline batch's prefix groups to N engine replicas and print the summary.

Example::

    prefixattn partition --replicas 8 prompts.jsonl
    prefixattn partition --replicas 8 batchllm-case1 --cost tokens --json partition.json

The partition and its comparison with the baselines is :func:`prefixattn.sim.partition_summary.summarize`; this
module parses the command line and prints.
"""
from __future__ import annotations

import json
import sys

from prefixattn.cli.arg_types import non_negative_float, non_negative_int, output_file, positive_int

HELP = "assign prefix groups of an offline batch to N engine replicas (load balance, saving ratio kept vs round-robin)"


def add_arguments(parser) -> None:
    parser.add_argument("prompts", help="a .jsonl file (one request per line, see prefixattn.sim.workloads.load_jsonl) "
                                        "or a seed workload name (prefixattn simulate --list)")
    parser.add_argument("--replicas", type=positive_int, required=True, help="number of engine replicas N")
    parser.add_argument("--levels", type=positive_int, default=1,
                        help="group nesting depth for group_prompts (default 1)")
    parser.add_argument("--cost", choices=["sim", "sim-scalar", "tokens"], default="sim",
                        help="group cost: the simulator's cost model on two resources (compute and memory seconds "
                             "plus the serial floor of long decodes, default), compute + memory as one number, or "
                             "prefill + decode tokens")
    parser.add_argument("--model", default=None, help="model preset for --cost sim (default: the workload's paper "
                                                      "setting, else mistral-7b)")
    parser.add_argument("--gpu", default=None, help="hardware preset for --cost sim (default: a100)")
    parser.add_argument("--decode-weight", type=non_negative_float, default=1.0,
                        help="--cost tokens: cost of a decode token relative to a prefill token")
    parser.add_argument("--num-requests", type=positive_int, default=None, help="size / truncate the workload")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="workload generator seed (and random sharding's)")
    parser.add_argument("--max-tokens", type=positive_int, default=None,
                        help="output length of .jsonl requests that give none (default: estimated per prefix group "
                             "from the lines that give one, else an assumed constant; the summary says which)")
    parser.add_argument("--no-split", action="store_true", help="never split a group, even one above the fair share")
    parser.add_argument("--split", choices=["spread", "fill"], default="spread",
                        help="how a group above the fair share is cut: one equal piece per replica (spread, keeps "
                             "each replica's work mix) or the fewest pieces (fill)")
    parser.add_argument("--json", type=output_file, default=None, metavar="FILE",
                        help="also write the summary and the assignment")


def format_summary(s: dict) -> str:
    lines = [f"prefix-affinity partition of {s['workload']}: {s['num_requests']} requests, {s['num_groups']} groups "
             f"(levels={s['levels']}) over {s['num_replicas']} replicas; group cost: {s['cost']}",
             "",
             f"{'replica':>7} {'groups':>7} {'requests':>9} {'prompt tok':>11} {'computed tok':>13} {'cost':>12} "
             + (f"{'compute':>10} {'memory':>10} " if "compute" in s["replicas"][0] else "") + f"{'pressure':>9}"]
    for r in s["replicas"]:
        lines.append(f"{r['replica']:>7} {r['groups']:>7} {r['requests']:>9} {r['prompt_tokens']:>11} "
                     f"{r['computed_tokens']:>13} {r['cost']:>12.4g} "
                     + (f"{r['compute']:>10.4g} {r['memory']:>10.4g} " if "compute" in r else "")
                     + f"{r['pressure']:>9.4f}")
    lines += ["",
              f"load balance: makespan / (total cost / N) = {s['balance']:.4f}"
              + (" (pressure: modeled replica time, compute + memory + the longest decode's serial floor, over "
                 "the fair time)" if "compute" in s["replicas"][0] else ""),
              f"split groups: {len(s['split_groups'])} (above the fair share), recomputed prompt tokens: "
              f"{s['recomputed_tokens']}",
              f"saving ratio (BatchLLM Eq. 2): single replica {s['saving']['single replica']:.4f}, optimal "
              f"{s['saving']['optimal']:.4f}"]
    for k in ("prefix-affinity", "round-robin", "random"):
        lines.append(f"  {k:16s} {s['saving'][k]:.4f}  kept {100 * s['kept'][k]:6.2f}% of the single replica's")
    if s.get("output_len_assumption"):
        lines.append(f"output lengths: {s['output_len_assumption']}")
    return "\n".join(lines)


def _json_ready(s: dict) -> dict:
    out = {k: v for k, v in s.items() if k != "partition"}
    part = s["partition"]
    out["partition"] = dict(part.summary(), groups=[
        dict(replica=int(r), source=int(src), prefix_len=g.prefix_len, request_ids=[int(x) for x in g.request_ids],
             cost=float(c)) for g, r, src, c in zip(part.groups, part.replicas, part.source, part.costs)])
    return out


def run(args) -> int:
    try:
        from prefixattn.sim.partition_summary import summarize
        from prefixattn.sim.workloads import get_workload

        if args.replicas is None or args.replicas < 1:
            raise ValueError(f"--replicas: expected a positive int, got {args.replicas}")
        workload = get_workload(args.prompts, num_requests=args.num_requests, seed=args.seed,
                                default_output_len=args.max_tokens)
        s = summarize(workload, args.replicas, levels=args.levels, cost=args.cost, model=args.model, gpu=args.gpu,
                      decode_weight=args.decode_weight, allow_split=not args.no_split, split=args.split,
                      seed=args.seed)
    except (ValueError, OSError) as e:
        print(f"prefixattn partition: error: {e}", file=sys.stderr)
        return 2
    print(format_summary(s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_json_ready(s), f, indent=1)
        print(f"wrote {args.json}")
    return 0
