"""The ``prefixattn`` command. Each subcommand lives in its own module and is imported only when used.

A subcommand module exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``. One that sets
``PASSTHROUGH = "<dest>"`` also receives the options it does not know in ``args.<dest>`` (``prefixattn bench -x``
hands ``-x`` to pytest).
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
        cmd.set_defaults(_run=module.run, _passthrough=getattr(module, "PASSTHROUGH", None))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if args._passthrough is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        setattr(args, args._passthrough, list(getattr(args, args._passthrough)) + unknown)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
