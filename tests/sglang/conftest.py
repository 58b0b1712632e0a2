"""SGLang suite: runs in the SGLang venv (scripts/test_sglang.sh); not collected where sglang is not installed.

Every test here is marked ``sglang`` and is deselected by the main suite's ``-m "not sglang"``; the main venv has no
sglang, so collection (which imports sglang) is skipped there instead of erroring.
"""

import importlib.util

_HAS_SGLANG = importlib.util.find_spec("sglang") is not None


def pytest_ignore_collect(collection_path, config):
    if not _HAS_SGLANG:
        return True
    return None


if _HAS_SGLANG:
    from tests.sglang import torchvision_stub

    torchvision_stub.install()
