"""SGLang's RadixCache as the online-insertion peer of the scheduler benchmark (CPU).

:func:`compare` times, in one process, SGLang building its keys and inserting a batch into a fresh ``RadixCache``
and our ``group_prompts`` on the same batch (from numpy int32 rows and from Python lists). Run as a script (``python
sglang_radix.py N REPEATS``) it prints that as JSON: ``test_scheduler_speed.py`` runs it in the SGLang venv
(``.venv-sglang`` at the repository root, or ``PREFIXATTN_BENCH_SGLANG_PYTHON``) when sglang is not importable in
the benchmark's own interpreter.

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
        return "sglang is not installed in this environment"
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


def _cache_and_classes():
    rc = _import_radix_cache()
    base = sys.modules["sglang.srt.mem_cache.base_prefix_cache"]
    params_cls = getattr(rc, "CacheInitParams", None) or getattr(base, "CacheInitParams")
    insert_cls = getattr(rc, "InsertParams", None) or getattr(base, "InsertParams")
    cache = rc.RadixCache(params_cls(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                     page_size=1))
    return cache, rc.RadixKey, insert_cls


def keys_and_insert_seconds(lists: list[list[int]]) -> dict[str, float]:
    """Wall and CPU seconds for SGLang to build its keys from token lists (``RadixKey(array("l", ids))``, what a
    request's key is made of) and to insert them one by one into a fresh RadixCache (page size 1, its default).
    The KV-index tensors stand for the KV slots a real insert receives; they are made before the clock starts."""
    import torch

    cache, key_cls, insert_cls = _cache_and_classes()
    values = [torch.arange(len(p), dtype=torch.int64) for p in lists]
    wall, cpu = time.perf_counter(), time.process_time()
    keys = [key_cls(array.array("l", p)) for p in lists]
    keys_wall, keys_cpu = time.perf_counter() - wall, time.process_time() - cpu
    for key, value in zip(keys, values):
        cache.insert(insert_cls(key=key, value=value))
    return dict(keys_wall_s=keys_wall, keys_cpu_s=keys_cpu, keys_insert_wall_s=time.perf_counter() - wall,
                keys_insert_cpu_s=time.process_time() - cpu)


def read_floor_seconds(lists: list[list[int]], repeats: int) -> tuple[float, float]:
    """Wall and CPU seconds (medians) of ``sum`` over every list: one C pass reading each Python int once, the
    least any exact grouping from lists pays (an LCP is exact only if every shared token was read). It bounds the
    speedup any exact method can reach over SGLang's keys + insert from lists."""
    import statistics

    runs = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        sum(map(sum, lists))
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _ours_seconds(prompts, repeats: int) -> tuple[float, float, int]:
    import statistics

    from prefixattn.scheduling import group_prompts

    runs = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        groups = group_prompts(prompts)
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), len(groups)


#: Our runs per form: medians of warm runs, as in the benchmark's own rows (a single cold run pays first-touch page
#: faults on a few hundred MB, up to ~2x at 30k requests); SGLang's slow insertion keeps the caller's ``repeats``.
OUR_REPEATS = 5


def compare(num_requests: int, repeats: int) -> dict:
    """Ours (from int32 arrays and from lists, medians of :data:`OUR_REPEATS` runs after a warm-up) and SGLang's keys
    + insert (median of ``repeats`` runs) on BatchLLM case-1 prompts, all in this process."""
    import statistics

    from batches.prompts import batchllm_case1

    prompts = batchllm_case1(num_requests)
    lists = [p.tolist() for p in prompts]
    out = dict(num_requests=num_requests, mean_tokens=sum(map(len, lists)) / num_requests)
    _ours_seconds(prompts, 1)  # warm-up: imports, first-touch memory
    out["ours_arrays_wall_s"], out["ours_arrays_cpu_s"], out["groups"] = _ours_seconds(prompts, OUR_REPEATS)
    out["ours_lists_wall_s"], out["ours_lists_cpu_s"], _ = _ours_seconds(lists, OUR_REPEATS)
    out["read_floor_wall_s"], out["read_floor_cpu_s"] = read_floor_seconds(lists, OUR_REPEATS)
    peer = [keys_and_insert_seconds(lists) for _ in range(repeats)]
    for k in peer[0]:
        out[f"sglang_{k}"] = statistics.median(r[k] for r in peer)
    return out


if __name__ == "__main__":
    import json

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    print(json.dumps(compare(int(sys.argv[1]), int(sys.argv[2]))))
