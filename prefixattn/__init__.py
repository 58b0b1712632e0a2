"""prefixattn: horizontally-fused prefix-shared paged attention (Triton) and a global prefix scheduler.

Set ``TRITON_INTERPRET=1`` *before* using this package's kernels to run them on CPU tensors.

The public names below are imported on first use (PEP 562 ``__getattr__``): importing a subpackage imports only what
it needs. vLLM loads ``prefixattn.integrations.vllm.plugin`` in every process it starts, and ``prefixattn.scheduling``
is numpy-only; neither may pull in triton and the kernels through this file.
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

#: Public name -> the module that defines it (``__all__`` below lists the same names; tests/test_package.py checks).
_EXPORTS = {
    "CapacityError": "prefixattn.planner.device_tables",
    "FP8_E4M3_MIN_CAPABILITY": "prefixattn.validation",
    "FP8_KV_DTYPES": "prefixattn.validation",
    "MLAPrefixSharedAttention": "prefixattn.mla",
    "NaiveMLAPlan": "prefixattn.mla_naive",
    "NaivePrefixCache": "prefixattn.mla_naive_cache",
    "Plan": "prefixattn.planner.plans",
    "PrefixSharedAttention": "prefixattn.prefix_attention",
    "SINK_DTYPES": "prefixattn.validation",
    "SUPPORTED_DTYPES": "prefixattn.validation",
    "SUPPORTED_HEAD_DIMS": "prefixattn.validation",
    "attention": "prefixattn.prefix_attention",
    "check_mla_dims": "prefixattn.validation",
    "kernel_variants": "prefixattn.warmup",
    "merge_states": "prefixattn.merge",
    "merge_states_n": "prefixattn.merge",
    "mla_attention": "prefixattn.mla",
    "mla_kernel_variants": "prefixattn.mla_warmup",
    "mla_naive_attention": "prefixattn.mla_naive",
    "plan": "prefixattn.planner.plans",
    "plan_mla": "prefixattn.mla",
    "plan_mla_naive": "prefixattn.mla_naive",
    "reference_attention": "prefixattn.reference",
    "reference_mla_attention": "prefixattn.reference",
    "warmup_kernels": "prefixattn.warmup",
    "warmup_mla_kernels": "prefixattn.mla_warmup",
    "write_kv": "prefixattn.kv_write",
}

__all__ = ["CapacityError", "FP8_E4M3_MIN_CAPABILITY", "FP8_KV_DTYPES", "MLAPrefixSharedAttention", "NaiveMLAPlan",
           "NaivePrefixCache", "Plan", "PrefixSharedAttention", "SINK_DTYPES", "SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS", "attention",
           "check_mla_dims", "kernel_variants", "merge_states", "merge_states_n", "mla_attention",
           "mla_kernel_variants", "mla_naive_attention", "plan", "plan_mla", "plan_mla_naive", "reference_attention",
           "reference_mla_attention", "warmup_kernels", "warmup_mla_kernels", "write_kv", "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None and name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module is None:
        # A submodule not imported yet (``import prefixattn; prefixattn.planner``), as an eager import offered it.
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
