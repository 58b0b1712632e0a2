"""prefixattn.runtime: the Triton-interpreter / NumPy compatibility check (Triton 3.6 .. 3.9 are supported)."""

from __future__ import annotations

import numpy
import pytest
import torch
import triton

from prefixattn import runtime
from prefixattn.validation import check_kernel_device


@pytest.mark.parametrize("triton_version, numpy_version, broken", [
    ("3.6.0", "2.4.6", True),  # the combination that fails at the first launch (int() of a 1-element array)
    ("3.6.0", "2.3.5", False),  # NumPy only warns (DeprecationWarning) before 2.4
    ("3.7.0", "2.4.6", False),  # Triton squeezes the array from 3.7.0 on
    ("3.9.0+git1234", "2.5.0.dev0", False),
    ("3.5.1", "2.4.0", True),
])
def test_interpreter_incompatibility(triton_version, numpy_version, broken):
    reason = runtime.interpreter_incompatibility(triton_version, numpy_version)
    assert (reason is not None) == broken
    if broken:
        assert "numpy<2.4" in reason and triton_version in reason and numpy_version in reason


def test_bad_version_string_names_the_argument():
    with pytest.raises(ValueError, match="version: expected a 'MAJOR.MINOR...' string, got 'dev'"):
        runtime.interpreter_incompatibility("dev", "2.4.0")


def test_kernel_entry_points_raise_a_clear_error_on_a_broken_combination(monkeypatch):
    assert runtime.interpreter_enabled(), "tests/conftest.py runs the kernels in the interpreter"
    runtime.check_interpreter_runtime.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.0")
    try:
        with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1: the Triton 3\.6\.0 interpreter .* 'numpy<2\.4'"):
            check_kernel_device("q", torch.zeros(1))
    finally:
        runtime.check_interpreter_runtime.cache_clear()


def test_installed_combination_passes():
    # The versions this test run uses (the main venv, or the Triton 3.6 venv of scripts/test_triton36.sh).
    runtime.check_interpreter_runtime.cache_clear()
    runtime.check_interpreter_runtime()
    check_kernel_device("q", torch.zeros(1))
