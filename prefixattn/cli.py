"""The ``prefixattn`` command. Each subcommand lives in its own module and is imported only when used.

A subcommand module exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

#: subcommand name -> module implementing it. Modules that are not present (yet) are simply not offered.
SUBCOMMANDS = {
    "bench": "prefixattn.bench_runner",
    "simulate": "prefixattn.sim.cli",
    "tune": "prefixattn.autotune.tune_cli",
    "compile-check": "prefixattn.autotune.compile_check",
    "partition": "prefixattn.sim.partition_cli",
}


def _available() -> dict[str, str]:
    found = {}
    for name, module in SUBCOMMANDS.items():
        try:
            if importlib.util.find_spec(module) is not None:
                found[name] = module
        except ModuleNotFoundError:
            continue
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixattn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in _available().items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
