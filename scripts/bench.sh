#!/usr/bin/env bash
# Set up and run the main job: the benchmark suite (CPU interpreter without a GPU; pass --gpu on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q torch==2.13.0   # pinned first: a bare "torch" pulls a multi-GB CUDA build
.venv/bin/python -m pip install -q -e ".[bench]"
exec .venv/bin/prefixattn bench "$@"
