"""The version gate: supported range, parsing, and the message on anything else."""

import pytest

from prefixattn.integrations.vllm.version import (
    MAX_VLLM,
    MIN_VLLM,
    UnsupportedVLLMVersion,
    check_vllm_version,
    is_supported,
    parse_version,
)

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("version, expected", [
    ("0.32.0", (0, 32)), ("0.33.1.dev4+gabc123", (0, 33)), ("1.0", (1, 0)), (" 0.32.1rc1", (0, 32)),
])
def test_parse_version(version, expected):
    assert parse_version(version) == expected


def test_parse_version_rejects_garbage():
    with pytest.raises(ValueError, match="version: expected a 'major.minor"):
        parse_version("dev")


@pytest.mark.parametrize("version, ok", [
    ("0.31.2", False), ("0.32.0", True), ("0.32.5", True), ("0.33.0", True), ("0.33.9.dev1", True),
    ("0.34.0", False), ("1.0.0", False), ("dev", False),
])
def test_supported_range(version, ok):
    assert is_supported(version) is ok
    assert MIN_VLLM == (0, 32) and MAX_VLLM == (0, 33)


@pytest.mark.parametrize("version", ["0.31.0", "0.34.0"])
def test_unsupported_version_message_names_range_and_found(version):
    with pytest.raises(UnsupportedVLLMVersion) as info:
        check_vllm_version(version)
    assert "0.32.x - 0.33.x" in str(info.value) and f"found vLLM {version}" in str(info.value)
    assert isinstance(info.value, ImportError)  # vLLM reports an unimportable backend as invalid, not a crash



@pytest.mark.parametrize("module", ["prefixattn.integrations.vllm.backend", "prefixattn.integrations.vllm.scheduler"])
def test_entry_modules_refuse_an_unsupported_vllm(module):
    # What a user of vLLM 0.34 would see when selecting PREFIXATTN or the scheduler: a clear ImportError, which
    # vLLM's selector reports as "Selected backend PREFIXATTN is not valid ... Reason: [...]".
    import subprocess
    import sys

    from tests.vllm.engine import REPO

    code = ("import prefixattn.integrations.vllm.version as v\n"
            "v.installed_vllm_version = lambda: '0.34.0'\n"
            "try:\n"
            f"    import {module}\n"
            "except v.UnsupportedVLLMVersion as e:\n"
            "    print('REFUSED', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED prefixattn's vLLM integration supports vLLM 0.32.x - 0.33.x, found vLLM 0.34.0" in proc.stdout
