"""Tests against the real vLLM (marker ``vllm``); they run in ``.venv-vllm`` via ``scripts/test_vllm.sh``.

Without vLLM installed (the main venv), the modules that import it are not collected at all (the main suite also
deselects ``-m "not vllm"``); ``test_vllm_installed.py`` is always collected, so ``pytest -m vllm`` in a venv without
vLLM fails instead of passing with nothing run.
"""

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_[!v]*.py"]

# The engine runs in this process (no engine-core subprocess), so the tests see its plans and scheduler.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A random 2-layer Llama (head_dim 64, GQA 4:2, vocab 512) saved locally: no hub access."""
    from tests.vllm.tiny_model import save_tiny_llama

    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory) -> str:
    """A random 2-layer DeepSeek-V3 (MLA: 4 heads, a 512 + 64 latent, vocab 512) saved locally: no hub access."""
    from tests.vllm.tiny_model import save_tiny_deepseek_v3

    return save_tiny_deepseek_v3(str(tmp_path_factory.mktemp("tiny_deepseek_v3")))
