#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine (CPU only is fine: kernels run in the Triton interpreter).
#   main suite:   .venv        torch 2.13.0 (CPU wheel), triton, prefixattn[test]   -> pytest tests/
# Engine-marked suites get venvs of their own as their integrations land (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

setup_venv() {  # $1 = venv dir, $2 = extras
  [ -x "$1/bin/python" ] || "$PYTHON" -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip >/dev/null
  # torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
  "$1/bin/python" -m pip install -q torch==2.13.0
  "$1/bin/python" -m pip install -q -e ".[$2]"
}

setup_venv .venv test
.venv/bin/python -m pytest tests/ "$@"
