#!/usr/bin/env bash
# Download, on a machine with the package index, the wheels the GPU check (scripts/gpu_check.sh) needs that the GPU
# image lacks, into .whl/ (git-ignored), for CPython 3.12 on x86_64 Linux; fails if they pass 50 MiB in all.
#   bash scripts/gpu_wheels.sh            # download into .whl/
#   bash scripts/gpu_wheels.sh --verify   # also import the FlashInfer APIs the peers use, same pins, for THIS python
#   PYTHON=.venv/bin/python bash scripts/gpu_wheels.sh --aot   # also build FlashInfer's modules for sm90a here (CPU,
#                                         # a pip-installed CUDA 13.0 nvcc; slow on few cores) into .whl/flashinfer-aot/
# The GPU image has Python 3.12, torch 2.11.0+cu130, triton 3.6.0, numpy, pytest, matplotlib, nvcc 13, ncu,
# compute-sanitizer, and no network. On it:
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl   (scripts/gpu_check.sh does this)
#
# The set: FlashInfer 0.6.0 (7.5 MB; its newest, 0.7.2.post1, is 62 MB before dependencies) ships its CUDA sources for
# JIT and every API bench/peers/flashinfer.py calls (written against its sources: cascade, batch decode and prefill
# wrappers, BatchAttention, BatchPODWithPagedKVCacheWrapper). Of its declared dependencies only these are
# needed, found by importing `flashinfer` in a venv of the image's packages (torch 2.13 CPU, triton 3.6.0, numpy,
# pytest, matplotlib) and adding one wheel per ModuleNotFoundError until `flashinfer.MultiLevelCascadeAttentionWrapper`
# imported: apache-tvm-ffi (the JIT modules' FFI: headers, libtvm_ffi), nvidia-ml-py (pynvml), requests with urllib3,
# idna, certifi. ninja is not imported but FlashInfer's JIT runs the `ninja` binary (jinja2 and filelock, which its JIT
# imports, are in the GPU image). The rest (nvidia-cutlass-dsl, nvidia-cudnn-frontend, einops, click, tabulate, tqdm)
# is imported only by other FlashInfer features (CuTe DSL kernels, cuDNN backends, the CLI), not by the peers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=.whl
LIMIT_MIB=50  # the GPU machine takes 64 MiB of files per command; the rest is the tree
#: The CUDA 13.0 toolchain for --aot (the GPU image's nvcc 13.0 and driver 580): compiler, C runtime headers, runtime,
#: CCCL, NVVM, and curand for its headers (CUTLASS's utilities include them). Not carried: only the modules are.
CUDA_WHEELS=("nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-cuda-runtime==13.0.*"
             "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-curand<10.5")
WHEELS=(flashinfer-python==0.6.0 apache-tvm-ffi==0.1.15.post2 nvidia-ml-py==13.615.71 requests==2.34.2
        urllib3==2.8.0 idna==3.20 certifi==2026.10.18 ninja==1.13.2)
# Every tag a cp312 x86_64 manylinux wheel may carry (pure-Python wheels match "any").
TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)

rm -rf "$DEST"
mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps "${TAGS[@]}" -d "$DEST" "${WHEELS[@]}"
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
ls -l "$DEST"
echo "gpu wheels: ${#WHEELS[@]} wheels, $((total / 1024)) KiB in $DEST (limit ${LIMIT_MIB} MiB)"
if [ "$total" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "gpu wheels: FAILED: $((total / 1024 / 1024)) MiB is over the ${LIMIT_MIB} MiB limit" >&2
  exit 1
fi

if [ "${1:-}" = "--aot" ]; then
  # FlashInfer's JIT modules of the peers (bench/gpu_check/flashinfer_jit.py:specs) built for sm90a on this machine,
  # with this python (it needs torch) and the same FlashInfer and tvm-ffi pins; scripts/gpu_check.sh installs them as
  # AOT modules.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$tmp/whl" "${WHEELS[@]}" "${CUDA_WHEELS[@]}"
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$tmp/site" "$tmp"/whl/*.whl
  cu="$tmp/site/nvidia/cu13"  # a CUDA_HOME as FlashInfer's JIT reads it: bin, include, lib64, lib64/stubs, nvvm
  ln -s lib "$cu/lib64"
  ln -s libcudart.so.13 "$cu/lib/libcudart.so"
  mkdir -p "$cu/lib/stubs"  # -lcuda at link time only; the driver's libcuda.so.1 is loaded on the GPU machine
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cu/lib/stubs/libcuda.so" -x c /dev/null
  rm -rf "$DEST/flashinfer-aot"
  start=$SECONDS
  CUDA_HOME="$cu" FLASHINFER_CUDA_ARCH_LIST="9.0a" FLASHINFER_WORKSPACE_BASE="$tmp/ws" PATH="$tmp/site/bin:$PATH" \
    MAX_JOBS="${MAX_JOBS:-$(nproc)}" PYTHONPATH="$tmp/site:$PWD/bench" "$PYTHON" -m gpu_check.flashinfer_jit \
    --aot-build "$DEST/flashinfer-aot"
  total=$(du -cb "$DEST"/*.whl "$DEST/flashinfer-aot" | tail -1 | cut -f1)
  echo "gpu wheels: FlashInfer AOT modules built in $((SECONDS - start)) s; .whl/ now $((total / 1024)) KiB"
  if [ "$total" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "gpu wheels: FAILED: wheels + AOT modules are $((total / 1024 / 1024)) MiB, over the ${LIMIT_MIB} MiB limit" >&2
    exit 1
  fi
fi

if [ "${1:-}" = "--verify" ]; then
  # Same pins for this machine's python (apache-tvm-ffi is the only binary wheel), into a throwaway target.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$tmp/whl" "${WHEELS[@]}"
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$tmp/site" "$tmp"/whl/*.whl
  PYTHONPATH="$tmp/site" "$PYTHON" -c "import flashinfer
names = [c.__name__ for c in (flashinfer.MultiLevelCascadeAttentionWrapper, flashinfer.BatchDecodeWithPagedKVCacheWrapper,
         flashinfer.BatchPrefillWithPagedKVCacheWrapper, flashinfer.BatchAttention,
         flashinfer.BatchPODWithPagedKVCacheWrapper)]
print('gpu wheels: flashinfer', flashinfer.__version__, 'imports', ', '.join(names))"
fi
