"""SGLang's RadixCache as the online-insertion peer of the scheduler benchmark (CPU, in process).

Importing ``sglang.srt.mem_cache.radix_cache`` pulls ``sglang.srt.configs``, whose multimodal configs import
``torchvision.transforms`` at load time; the PyPI torchvision wheels matching torch 2.13 need CUDA. ``transformers``
must first decide (once, cached) that torchvision is absent, then a placeholder module satisfies the sglang imports.
Nothing here runs torchvision code.
"""

from __future__ import annotations

import array
import importlib.machinery
import importlib.util
import sys
import time
import types


def unavailable_reason() -> str | None:
    """Why the SGLang peer cannot run here, or None."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed in this environment (run the bench with /work/main/.venv-sglang/bin/python)"
    try:
        _import_radix_cache()
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is unavailable; say why
        return f"sglang.srt.mem_cache.radix_cache failed to import: {type(e).__name__}: {e}"
    return None


def _placeholder(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    mod.__path__ = []

    def __getattr__(attr):  # any name the configs import exists; none is ever used
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(f"{name}.{attr}", (), {})

    mod.__getattr__ = __getattr__
    return mod


def _import_radix_cache():
    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        import transformers.image_utils  # noqa: F401 - decides "no torchvision" before the placeholder exists

        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
            sys.modules[name] = _placeholder(name)
    from sglang.srt.mem_cache import radix_cache

    return radix_cache


def insertion_seconds(prompts) -> tuple[float, float]:
    """``(wall, cpu)`` seconds to insert ``prompts`` one by one into a fresh RadixCache (page size 1, SGLang's
    default).

    Keys and KV-index values are built before the clock starts, so only ``insert`` (the tree work) is timed.
    """
    import torch

    rc = _import_radix_cache()
    base = sys.modules["sglang.srt.mem_cache.base_prefix_cache"]
    params_cls = getattr(rc, "CacheInitParams", None) or getattr(base, "CacheInitParams")
    insert_cls = getattr(rc, "InsertParams", None) or getattr(base, "InsertParams")
    key_cls = getattr(rc, "RadixKey")
    cache = rc.RadixCache(params_cls(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                     page_size=1))
    items = [insert_cls(key=key_cls(array.array("l", p.tolist() if hasattr(p, "tolist") else p)),
                        value=torch.arange(len(p), dtype=torch.int64)) for p in prompts]
    wall, cpu = time.perf_counter(), time.process_time()
    for item in items:
        cache.insert(item)
    return time.perf_counter() - wall, time.process_time() - cpu
