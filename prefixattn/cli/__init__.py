"""The ``prefixattn`` command. Each subcommand lives in its own module of this package, imported only when used.

A subcommand module (``prefixattn/cli/<command>.py``) exposes ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``: it parses and prints, and drives library code that lives where it belongs (``prefixattn.warmup``,
``prefixattn.autotune``, ``prefixattn.tuning``, ``prefixattn.sim``); nothing outside this package imports it. One
that sets ``PASSTHROUGH = "<dest>"`` also receives the options it does not know in ``args.<dest>``
(``prefixattn bench -x`` hands ``-x`` to pytest).

Argument types shared by the subcommands are in :mod:`prefixattn.cli.arg_types`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

#: subcommand name -> module implementing it. Modules that are not present (yet) are simply not offered.
SUBCOMMANDS = {
    "bench": "prefixattn.cli.bench",
    "simulate": "prefixattn.cli.simulate",
    "tune": "prefixattn.cli.tune",
    "compile-check": "prefixattn.cli.compile_check",
    "partition": "prefixattn.cli.partition",
    "warmup": "prefixattn.cli.warmup",
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
    """Run ``prefixattn ARGV``; returns the exit code (2 for a bad argument, as argparse exits with)."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            if args._passthrough is None:
                parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            setattr(args, args._passthrough, list(getattr(args, args._passthrough)) + unknown)
    except SystemExit as e:  # argparse already printed the usage and the error (or --help)
        return e.code if isinstance(e.code, int) else 2
    return int(args._run(args) or 0)
