#!/usr/bin/env bash
# GPU evidence in one call, from the repository root of the GPU machine (no network needed):
#   bash scripts/gpu_wheels.sh       # first, on a machine with the package index: FlashInfer & co. into .whl/
#   bash scripts/gpu_check.sh        # on the GPU machine: <= 9 minutes; writes bench/results/gpu/<gpu>-<commit>.csv,
#                                    # .md (bench/render/gpu.py's fair tables) and -model-steps.json
#   bash scripts/gpu_check.sh --dry-run [--out DIR]   # any CPU machine: every step at tiny sizes, interpreter
# Needs the image's python3 (torch, triton, numpy, pytest), nvcc + compute-sanitizer on PATH or in /usr/local/cuda/bin,
# and the wheels of .whl/, installed here with --no-index --no-deps into a throwaway folder on PYTHONPATH (nothing is
# installed into the image's site-packages), with FlashInfer's modules built ahead of time if .whl/flashinfer-aot/ has
# them (gpu_wheels.sh --aot). Steps, budgets and outputs: the gpu_check package (bench/gpu_check/).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=${PREFIXATTN_GPU_SITE:-/tmp/prefixattn-gpu-site}
LIMIT_S=540  # 9 minutes for the whole call; the driver plans for ~505 s of it (bench/gpu_check/clock.py)

extra_path=""
if [ "${1:-}" != "--dry-run" ]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl
    if [ -d .whl/flashinfer-aot ]; then  # modules built ahead of time (gpu_wheels.sh --aot): FlashInfer loads these
      mkdir -p "$SITE/flashinfer/data/aot"
      cp -r .whl/flashinfer-aot/. "$SITE/flashinfer/data/aot/"
    fi
    extra_path="$SITE"
    export PATH="$SITE/bin:$PATH"  # FlashInfer's JIT runs the `ninja` of the ninja wheel
  else
    echo "gpu check: no wheels in .whl/ (bash scripts/gpu_wheels.sh on a networked machine); FlashInfer will be skipped"
  fi
  [ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
fi
# bench/ for the gpu_check package (and the driver's children, which run it again), the root for prefixattn and tests.
export PYTHONPATH="$PWD/bench:$PWD${extra_path:+:$extra_path}${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --kill-after=5 $((LIMIT_S - SECONDS)) "$PYTHON" -m gpu_check "$@"
