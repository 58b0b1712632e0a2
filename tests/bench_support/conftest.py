import sys
from pathlib import Path

# The benchmark helpers (bench/traffic, bench/peers, bench/batches, bench/gpu_check, bench/render) are imported as
# top-level packages, as `pytest bench/` imports them (bench/ has no __init__.py: pytest puts bench/ on sys.path).
BENCH_DIR = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)
