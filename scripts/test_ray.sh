#!/usr/bin/env bash
# The Ray Data integration's tests (tests marked `ray`) in their own venv .venv-ray, on a local in-process cluster
# (ray.init(num_cpus=2); no other hosts). Created on first use (~2 min), updated after:
#   - torch==2.13.0 first (pinned: a bare "torch" requirement would pull a multi-GB CUDA build);
#   - ray[data] (the `ray` extra: ray, pandas, pyarrow);
#   - prefixattn editable with the test extra.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-ray

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import ray.data" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q -e ".[test,ray]"
fi
"$VENV/bin/python" -m pip install -q -e ".[test,ray]"
"$VENV/bin/python" -m pytest tests/ -m ray "$@"
