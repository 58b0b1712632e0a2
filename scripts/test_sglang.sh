#!/usr/bin/env bash
# The SGLang integration's tests against the real engine (tests marked `sglang`), in their own venv .venv-sglang.
# Created on first use (~70 s), updated after:
#   - torch==2.13.0 first (pinned: a bare "torch" requirement would pull a multi-GB CUDA build);
#   - sglang==0.5.23 with --no-deps: its full requirement set (sgl-kernel, flashinfer, CUDA torch...) does not install
#     on a CPU machine, but the parts we test (attention base class and registry, torch_native backend, memory
#     pools, RadixCache, ForwardBatch, SchedulePolicy, plugin hooks) import with these small pure-Python packages;
#   - torchvision is NOT installed (PyPI wheels need libtorch_cuda): tests/sglang/torchvision_stub.py stands in;
#   - prefixattn editable with the test extra (registers the sglang.srt.plugins entry point).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
VENV=.venv-sglang
SGLANG_PIN=sglang==0.5.23
SGLANG_DEPS=(orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm IPython aiohttp
             transformers==5.19.0 dill sentencepiece==0.2.1 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 gguf
             openai==2.8.0 partial_json_parser einops triton==3.9.0 numpy)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
installed=$("$VENV/bin/python" -m pip show sglang 2>/dev/null | sed -n 's/^Version: //p' || true)  # pip show fails when absent
if [ "$installed" != "${SGLANG_PIN#*==}" ]; then
  pip_install "$VENV" --upgrade pip >/dev/null
  pip_install "$VENV" torch==2.13.0
  pip_install "$VENV" --no-deps "$SGLANG_PIN"
  pip_install "$VENV" torch==2.13.0 "${SGLANG_DEPS[@]}"
fi
install_editable "$VENV" test
"$VENV/bin/python" -m pytest tests/ -m sglang "$@"
