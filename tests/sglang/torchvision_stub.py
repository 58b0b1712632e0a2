"""Test-only stand-in for ``torchvision``, so SGLang 0.5.23 imports on a CPU-only machine.

Why: ``sglang.srt.configs`` (imported by ForwardBatch, hence by every attention backend) imports
``torchvision.transforms`` at load time in several multimodal config modules, but the PyPI torchvision wheels that
match torch 2.13 need libtorch_cuda and break on a CPU machine. Nothing our tests touch runs torchvision code: the
stub only has to make those imports succeed. Any use of it raises.

Order matters: ``import transformers`` decides once (``lru_cache``) whether torchvision is installed, and must
decide "no" (a stub it believed in would make it import ``torchvision.io``). So :func:`install` imports sglang, which
imports transformers, *before* putting the stub into ``sys.modules``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

_STUB_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.io")


class _Placeholder(type):
    """Any attribute of the stub: a class whose attributes are placeholders too and which raises when used."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__}: torchvision is a test-only import stub here (tests/sglang)")


def _stub_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    mod.__path__ = []

    def __getattr__(attr):  # PEP 562 module attribute fallback
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{name}.{attr}", (), {})

    mod.__getattr__ = __getattr__
    return mod


def install() -> None:
    """Put the stub into ``sys.modules`` unless an importable torchvision is already there (idempotent)."""
    if "torchvision" in sys.modules:
        return
    try:
        import torchvision  # noqa: F401  a working torchvision (a CUDA machine) needs no stub
        return
    except Exception:  # noqa: BLE001  the CUDA-only wheel fails with OSError/ImportError/RuntimeError
        sys.modules.pop("torchvision", None)
    import sglang  # noqa: F401  transformers must cache "torchvision absent" before the stub exists (see above)

    for name in _STUB_MODULES:
        sys.modules.setdefault(name, _stub_module(name))
