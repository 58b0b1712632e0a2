import os

# Must be set before any kernel module is imported: Triton decides at import/decoration time whether a kernel runs
# compiled or in the interpreter. Tests run on CPU tensors, so the interpreter is the only option here.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _has_gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU (none here, or TRITON_INTERPRET=1)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if _has_gpu() else "cpu"


@pytest.fixture
def node_rule_only(monkeypatch):
    """``sharing="auto"`` with the per-node cost rule alone under a planning target, for tests that pin the node or
    split rule on full-size plans: the step-level check (:mod:`prefixattn.planner.choose`, tested in
    tests/test_choose.py) may plan them unshared on the modeled GPU."""
    from prefixattn.planner import choose

    monkeypatch.setattr(choose, "shared_launch_may_lose", lambda *args, **kwargs: False)


@pytest.fixture(autouse=True)
def _interpreter_memcheck():
    """Every interpreted launch of every test is bounds-checked (tests/memcheck.py): a stray access fails the test
    that made it instead of corrupting the process's heap."""
    from tests.memcheck import checked

    with checked():
        yield
