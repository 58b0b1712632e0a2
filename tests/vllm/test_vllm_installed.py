"""Guard: the vllm-marked suite must run against an importable, supported vLLM (never pass vacuously).

Selected explicitly (``-m vllm``, as scripts/test_vllm.sh does), a missing vLLM is a failure. In a plain ``pytest
tests/`` of a venv without vLLM (the main venv) the suite is not collected and this guard says so as a skip.
"""

import importlib.util

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_is_importable_and_supported(request):
    markexpr = request.config.getoption("markexpr") or ""
    explicitly_selected = "vllm" in markexpr and "not vllm" not in markexpr
    if importlib.util.find_spec("vllm") is None and not explicitly_selected:
        pytest.skip("vllm is not installed here; the vLLM suite runs in .venv-vllm via scripts/test_vllm.sh")
    from prefixattn.integrations.vllm.version import check_vllm_version

    from vllm.version import __version__

    assert check_vllm_version() == __version__  # else UnsupportedVLLMVersion (an ImportError) naming what was found
