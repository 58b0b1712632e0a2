"""``python bench/report.py [CSV]``: the pytest suite's ``summary.md`` and plots from ``bench/results/latest.csv`` (or
CSV); ``prefixattn bench`` loads this file and calls :func:`write`. The renderer: :mod:`render.suite`."""

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parent)
if BENCH not in sys.path:  # loaded by path (prefixattn bench), where bench/ is not on sys.path
    sys.path.insert(0, BENCH)

from render.suite import main, summary, write  # noqa: E402,F401 - write: prefixattn bench's entry point

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], Path(__file__).parent / "results" / "latest.csv"))
