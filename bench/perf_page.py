"""``python bench/perf_page.py [--write | --check]``: docs/performance.md and the README's headline table from the
committed GPU-check results (``--check`` exits 1 while either differs). The renderer, and the run it heads with
(``HEADLINE_RUN``): :mod:`render.performance`."""

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parent)
if BENCH not in sys.path:  # loaded by path (tests/test_docs.py), where bench/ is not on sys.path
    sys.path.insert(0, BENCH)

from render.performance import HEADLINE_RUN, load_runs, main, stale  # noqa: E402,F401 - tests/test_docs.py's names

if __name__ == "__main__":
    sys.exit(main())
