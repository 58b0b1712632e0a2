"""``prefixattn simulate``: modeled end-to-end throughput of serving policies on a calibrated GPU cost model.

Example::

    prefixattn simulate --workload batchllm-case1 --model mistral-7b --gpu a100 \\
        --policies vllm,batchllm,prefixattn --plot steps.png --json results.json
"""

from __future__ import annotations

import sys

from prefixattn.cli.arg_types import non_negative_int, output_file, positive_int

HELP = "simulate offline batch inference throughput of vLLM/SGLang/BatchLLM/BlendServe/prefixattn policies (modeled)"

DEFAULT_POLICIES = "vllm,sglang,batchllm,blendserve,prefixattn"


def add_arguments(parser) -> None:
    from prefixattn.scheduling.admission import PROJECTIONS

    parser.add_argument("--workload", default="batchllm-case1",
                        help="a seed workload name (see --list) or a .jsonl file (jsonl:PATH also works)")
    parser.add_argument("--num-requests", type=positive_int, default=None, help="size / truncate the workload")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="workload generator seed")
    parser.add_argument("--max-tokens", type=positive_int, default=None,
                        help="output length of .jsonl requests that give none (default: estimated per prefix group "
                             "from the lines that give one, else an assumed constant; the report says which)")
    parser.add_argument("--model", default=None, help="model preset (default: the paper's for the workload)")
    parser.add_argument("--gpu", default=None, help="hardware preset (default: the paper's for the workload)")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policy names (see --list)")
    parser.add_argument("--backend", choices=["sequential", "overlap"], default=None,
                        help="force one engine backend for every policy (default: each system's own)")
    parser.add_argument("--projection", choices=PROJECTIONS, default=None,
                        help="memory-centric admission projection of the policies built on prefixattn's scheduler "
                             "(the vLLM scheduler's rule; default: ends; peak appends -peak to their names)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a calibration constant for a what-if run (applies to every policy)")
    parser.add_argument("--plot", type=output_file, default=None, metavar="PNG",
                        help="write the tokens-per-step plot (matplotlib)")
    parser.add_argument("--json", type=output_file, default=None, metavar="FILE",
                        help="write the table as a JSON list of objects")
    parser.add_argument("--progress", dest="progress", action="store_true", default=None,
                        help="show a progress bar (tqdm; default: on when stderr is a terminal)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--list", action="store_true", help="list workloads, policies, GPUs and models, then exit")
    parser.add_argument("--calibration", action="store_true", help="print the calibration table, then exit")


def _overrides(items) -> dict:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set: expected NAME=VALUE, got {item!r}")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--set {name}: expected a number, got {value!r}") from None
    return out


def _progress_factory(enabled):
    if enabled is False:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        if enabled:
            raise ValueError("--progress: tqdm is not installed; install the bench extra: "
                             "pip install 'prefixattn[bench]' (or: pip install tqdm)") from None
        return None
    if enabled is None and not sys.stderr.isatty():
        return None
    bars = []

    def factory(name, total):
        if bars:
            bars[-1].close()
        bar = tqdm(total=total, desc=f"simulating {name}", unit="req", leave=False)
        bars.append(bar)
        return bar.update

    return factory


def _list() -> str:
    from prefixattn.sim.policies import policy_help
    from prefixattn.sim.presets import HARDWARE, HARDWARE_ALIASES, MODELS
    from prefixattn.sim.workloads import PAPER_SETTINGS, WORKLOADS

    lines = ["workloads (paper setting):"]
    lines += [f"  {w:32s} {PAPER_SETTINGS.get(w, ('', ''))[0]} / {PAPER_SETTINGS.get(w, ('', ''))[1]}"
              for w in WORKLOADS]
    lines += ["  *.jsonl                          one request per line (see prefixattn.sim.workloads.load_jsonl)",
              "policies:"]
    lines += [f"  {name:14s} {text}" for name, text in policy_help().items()]
    lines += ["gpus: " + ", ".join(HARDWARE) + "  (aliases: " +
              ", ".join(f"{a}={b}" for a, b in HARDWARE_ALIASES.items()) + ")",
              "models: " + ", ".join(MODELS)]
    return "\n".join(lines)


def run(args) -> int:
    from prefixattn.sim.calibration import Calibration, table_markdown
    from prefixattn.sim.report import format_table, plot_steps, write_json
    from prefixattn.sim.simulate import simulate
    from prefixattn.sim.workloads import PAPER_SETTINGS, get_workload

    try:
        if args.list:
            print(_list())
            return 0
        if args.calibration:
            print(table_markdown())
            return 0
        if args.plot:
            from prefixattn.sim.report import _pyplot
            _pyplot()  # fail before simulating when matplotlib is missing
        model, gpu = PAPER_SETTINGS.get(args.workload, ("mistral-7b", "a100"))
        calibration = Calibration(_overrides(args.set))
        from prefixattn.sim.policies import make_policy
        for name in (p for p in args.policies.split(",") if p):
            make_policy(name)  # a bad policy name fails before the workload is built
        workload = get_workload(args.workload, num_requests=args.num_requests, seed=args.seed,
                                default_output_len=args.max_tokens)
        results = simulate(workload, args.policies, model=args.model or model, gpu=args.gpu or gpu,
                           calibration=calibration, backend=args.backend, projection=args.projection,
                           progress=_progress_factory(args.progress))
    except ValueError as e:
        print(f"prefixattn simulate: error: {e}", file=sys.stderr)
        return 2
    print(format_table(results))
    if workload.info.get("output_len_assumption"):
        print(f"output lengths: {workload.info['output_len_assumption']}")
    if calibration.overrides:
        print(f"calibration overrides (what-if): {calibration.overrides}")
    if args.json:
        write_json(results, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot_steps(results, args.plot)
        print(f"wrote {args.plot}")
    return 0
