"""The ``prefixattn`` command. Each subcommand lives in its own module and is imported only when used.

A subcommand module exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``. One that sets
``PASSTHROUGH = "<dest>"`` also receives the options it does not know in ``args.<dest>`` (``prefixattn bench -x``
hands ``-x`` to pytest).

Argument types shared by the subcommands (:func:`positive_int`, :func:`non_negative_int`, :func:`int_list`,
:func:`non_negative_float`, :func:`output_file`) refuse bad values while the command line is parsed: argparse then
exits with code 2 and ``argument --NAME: expected X, got Y``, before any work starts.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import sys

#: subcommand name -> module implementing it. Modules that are not present (yet) are simply not offered.
SUBCOMMANDS = {
    "bench": "prefixattn.bench_runner",
    "simulate": "prefixattn.sim.cli",
    "tune": "prefixattn.autotune.tune_cli",
    "compile-check": "prefixattn.autotune.compile_check",
    "partition": "prefixattn.sim.partition_cli",
    "warmup": "prefixattn.warmup_cli",
}


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (``--num-requests -2`` must not slice, ``0`` must not mean "all")."""
    return _int_at_least(text, 1, "a positive int")


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int_at_least(text, 0, "a non-negative int")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def int_list(allowed=None, *, positive: bool = False):
    """argparse type factory: comma-separated ints, each in ``allowed`` (when given) or >= 1 (``positive``)."""
    def parse(text: str) -> list[int]:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        what = "comma-separated positive ints" if positive else "comma-separated ints"
        try:
            values = [int(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}") from None
        if not values or (positive and min(values) < 1):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        if allowed is not None and not set(values) <= set(allowed):
            bad = [v for v in values if v not in allowed]
            raise argparse.ArgumentTypeError(f"expected values in {tuple(allowed)}, got {bad[0]}")
        return values
    parse.__name__ = "int_list"
    return parse


def output_file(text: str) -> str:
    """argparse type: a file path whose folder exists (checked before the run, not after it)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"expected a file in an existing folder, got {text!r} (no folder {folder})")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file in an existing folder, got {text!r} (a folder)")
    return text


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


if __name__ == "__main__":
    sys.exit(main())
