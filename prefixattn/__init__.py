"""prefixattn: horizontally-fused prefix-shared paged attention (Triton) and a global prefix scheduler.

Set ``TRITON_INTERPRET=1`` *before* importing this package to run the kernels on CPU tensors.
"""

from prefixattn.kv_write import write_kv
from prefixattn.merge import merge_states, merge_states_n
from prefixattn.planner.device_tables import CapacityError
from prefixattn.planner.plans import Plan, plan
from prefixattn.prefix_attention import PrefixSharedAttention, attention
from prefixattn.reference import reference_attention
from prefixattn.validation import (FP8_E4M3_MIN_CAPABILITY, FP8_KV_DTYPES, SINK_DTYPES, SUPPORTED_DTYPES,
                                   SUPPORTED_HEAD_DIMS)
from prefixattn.warmup import kernel_variants, warmup_kernels

__version__ = "0.1.0"

__all__ = ["CapacityError", "FP8_E4M3_MIN_CAPABILITY", "FP8_KV_DTYPES", "Plan", "PrefixSharedAttention",
           "SINK_DTYPES", "SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS", "attention", "kernel_variants", "merge_states",
           "merge_states_n", "plan", "reference_attention", "warmup_kernels", "write_kv", "__version__"]
