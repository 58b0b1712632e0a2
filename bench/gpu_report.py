"""``python bench/gpu_report.py CSV [--steps ...-model-steps.json]``: the README's performance section from one GPU
check CSV, with the simulator's calibration against its model steps. The renderer: :mod:`render.gpu`."""

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parent)
if BENCH not in sys.path:  # loaded by path, where bench/ is not on sys.path
    sys.path.insert(0, BENCH)

from render.gpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
