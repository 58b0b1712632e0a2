"""Guard: the vllm-marked suite must run against an importable, supported vLLM (never pass vacuously)."""

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_is_importable_and_supported():
    from integrations.vllm.version import check_vllm_version

    check_vllm_version()  # raises UnsupportedVLLMVersion (an ImportError) naming what was found
