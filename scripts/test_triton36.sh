#!/usr/bin/env bash
# The oldest supported Triton (3.6.0: the GPU image's) in its own venv .venv-triton36 (~60 s to create, ~2 min to run):
#   - the fused kernel (decode programs with several KV heads, values of their own head size), merge kernel, K/V
#     write and warm-up tests in Triton 3.6's interpreter (tests/test_attention.py, tests/test_kv_heads.py,
#     tests/test_v_head_dim.py, tests/test_merge_states.py, tests/test_runtime.py, tests/test_kv_write.py,
#     tests/test_warmup.py), the prepared launch against this Triton's own JIT and compiled launcher
#     (tests/test_launcher.py, test_launcher_compile.py) and, under 3.6 only, the GPU check's dry run
#     (tests/test_gpu_check_dry_run.py);
#   - `prefixattn compile-check` for sm90 (bf16, head_dim 64 and 128: decode, chunked prefill, suffix-only, merges,
#     the matrix classes' Hopper build),
#     i.e. Triton 3.6's own compiler and ptxas on the kernels the GPU machine will run, and for gfx942 (head_dim 128);
#     under 3.6 the MLA kernel's sm90 binaries too; another Triton only sm90 at head_dim 128.
# numpy<2.4: Triton 3.6's interpreter calls int() on 1-element arrays, a TypeError from NumPy 2.4 on (see
# prefixattn/runtime.py; Triton >= 3.7 is fine with any NumPy). The main suite (scripts/test.sh) runs the newest Triton.
# TRITON_PIN=triton==3.8.0 runs the same suite on another Triton (in .venv-triton38; scripts/test.sh runs 3.8.0, vLLM
# 0.33's, this way). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
TRITON_PIN=${TRITON_PIN:-triton==3.6.0}
if [[ ! "$TRITON_PIN" =~ ^triton==[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "TRITON_PIN: expected triton==X.Y.Z (one exact version, its own venv), got '$TRITON_PIN'" >&2
  exit 2
fi
version=${TRITON_PIN#*==}
VENV=.venv-triton$(echo "${version%.*}" | tr -d .)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
installed=$("$VENV/bin/python" -m pip show triton 2>/dev/null | sed -n 's/^Version: //p' || true)  # fails when absent
if [ "$installed" != "${TRITON_PIN#*==}" ]; then
  pip_install "$VENV" --upgrade pip >/dev/null
  pip_install "$VENV" torch==2.13.0  # first and pinned: a bare "torch" pulls a multi-GB CUDA build
fi
install_editable "$VENV" test torch==2.13.0 "$TRITON_PIN" "numpy<2.4"

failed=()
# The GPU check's dry run (~1.5 minutes) only under 3.6, the GPU image's Triton (scripts/test.sh's main suite leaves
# it to this one); the tile sweep's dry run (~1.5 minutes, the same kernels over more configs) and the
# thousand-request batch (a planner-scale case, no kernel path of its own) only in the main suite.
dry_run=()
[ "$version" = "3.6.0" ] && dry_run=(tests/test_gpu_check_dry_run.py
  --deselect tests/test_gpu_check_dry_run.py::test_tile_sweep_dry_run_times_every_candidate_on_every_shape)
# Triton 3.6's interpreter warns (NumPy DeprecationWarning) at every scalar loop bound: thousands of lines, no news.
"$VENV/bin/python" -m pytest tests/test_attention.py tests/test_kv_heads.py tests/test_v_head_dim.py \
  tests/test_merge_states.py tests/test_runtime.py tests/test_kv_write.py tests/test_warmup.py tests/test_launcher.py \
  tests/test_launcher_compile.py \
  tests/test_launch_specialization.py tests/test_attention_compile.py::test_merge_reports_are_ordered_on_amd \
  "${dry_run[@]}" -q \
  --deselect tests/test_attention.py::test_thousand_tiny_requests -m "not slow" -W "ignore:Conversion of an array with ndim:DeprecationWarning" "$@" || failed+=(kernel-tests)
# gfx942 at one head size: Triton 3.6 lowered an atomic exchange to a buffer atomic LLVM lacks there (every binary).
# Another Triton (3.8: vLLM 0.33's) compiles sm90 at head_dim 128 only: CI's time (25 minutes) has no room for more.
if [ "$version" = "3.6.0" ]; then
  selection=(--targets sm90,gfx942 --head-dims 64,128 --head-dim-per-target gfx942=128)
else
  selection=(--targets sm90 --head-dims 128)
fi
# hopper: the Gluon build of the shared and chunk classes (sm90 only), whose Gluon API differs between Triton versions.
"$VENV/bin/prefixattn" compile-check --kernels prefix_attention,merge,hopper --dtypes bf16 "${selection[@]}" \
  --jobs 2 --quiet || failed+=(compile-check)
# The MLA kernel's sm90 binaries (bf16, over each fp8 latent) under the GPU image's Triton only: 3.6 spilled where 3.9
# did not (an e4m3 latent's shared tile).
if [ "$version" = "3.6.0" ]; then
  "$VENV/bin/prefixattn" compile-check --kernels mla_attention --targets sm90 --dtypes bf16 --jobs 2 --quiet \
    || failed+=(compile-check-mla)
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "triton $version suite: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "triton $version suite: passed"
