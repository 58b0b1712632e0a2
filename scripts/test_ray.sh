#!/usr/bin/env bash
# The Ray Data integration's tests (tests marked `ray`) in their own venv .venv-ray, on a local in-process cluster
# (ray.init(num_cpus=2); no other hosts). Created on first use (~2 min), updated after:
#   - torch==2.13.0 first (pinned: a bare "torch" requirement would pull a multi-GB CUDA build);
#   - ray[data] (the `ray` extra: ray, pandas, pyarrow);
#   - prefixattn editable with the test extra.
# Then the vLLM-on-Ray test (markers `ray` and `vllm`: a tiny vLLM-CPU model per actor) in .venv-vllm, which
# scripts/test_vllm.sh creates: ray[data] is added there (~20 s, no other package changes). Without .venv-vllm that
# test does not run, and this script says so.
# Extra arguments go to pytest (both runs).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-ray
VLLM_VENV=.venv-vllm

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import ray.data" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q -e ".[test,ray]"
fi
"$VENV/bin/python" -m pip install -q -e ".[test,ray]"
status=0
"$VENV/bin/python" -m pytest tests/ -m "ray and not vllm" "$@" || status=$?

if [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
  "$VLLM_VENV/bin/python" -m pip install -q -e ".[test,ray]"
  "$VLLM_VENV/bin/python" -m pytest tests/ray -m "ray and vllm" "$@" || status=$?
else
  echo "test_ray.sh: $VLLM_VENV has no vllm: the vLLM-on-Ray test (tests/ray/test_vllm_ray.py) did NOT run;" \
       "run scripts/test_vllm.sh once to create it" >&2
fi
exit $status
