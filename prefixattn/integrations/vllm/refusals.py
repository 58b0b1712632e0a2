"""What prefixattn's vLLM backend refuses, in vLLM's own validation wording, before any forward runs.

Two callers: vLLM's CUDA/ROCm selector (``PrefixAttnBackend.validate_configuration``: ``supports_*`` declarations,
``supports_compute_capability`` and ``supports_combination``, which gets the device capability), and the impl's
constructor on platforms whose selector does not validate (CPU), which uses :func:`refusal_reasons` with the same
wording.
"""

from __future__ import annotations

from prefixattn.integrations.vllm.version import check_vllm_version

check_vllm_version()  # before touching vLLM's classes: a clear ImportError instead of an AttributeError

import torch  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402

import prefixattn  # noqa: E402
from prefixattn.integrations.vllm.plugin import BACKEND_NAME  # noqa: E402

#: Head sizes prefixattn runs: every multiple of 8 from 32 to 256 (prefixattn's validation accepts exactly these).
SUPPORTED_HEAD_SIZES = prefixattn.SUPPORTED_HEAD_DIMS
#: The KV cache dtypes the backend declares ("auto" is the model's dtype; fp8 flavours are per-tensor scaled).
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
#: The explicit cache dtypes as torch dtypes (an explicit 16-bit cache must be the model's: K/V are read as q).
_KV_CACHE_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def refusal(reasons: list[str], backend: str = BACKEND_NAME) -> ValueError:
    """vLLM's own wording: its selector raises exactly this for a selected backend that fails validation."""
    return ValueError(f"Selected backend {backend} is not valid for this configuration. Reason: {reasons}")


def kv_cache_dtype_mismatch(kv_cache_dtype: str | None, model_dtype: torch.dtype | None) -> str | None:
    """The refusal reason for an explicit KV cache dtype that is not the model's (the kernel reads K/V in q's
    dtype), or None."""
    cache_dtype = _KV_CACHE_TORCH_DTYPES.get(kv_cache_dtype or "auto")
    if cache_dtype is None or model_dtype is None or cache_dtype == model_dtype:
        return None
    return (f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype {str(model_dtype).replace('torch.', '')} "
            "(prefixattn reads K/V in the dtype of q; use --kv-cache-dtype auto)")


def fp8_cache_dtype(kv_cache_dtype: str | None) -> torch.dtype | None:
    """The torch fp8 dtype vLLM stores a ``kv_cache_dtype`` cache in (its tensors are uint8), or None (not fp8)."""
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        from vllm.platforms import current_platform

        return current_platform.fp8_dtype()
    return None


def fp8_unsupported(kv_cache_dtype: str | None) -> str | None:
    """The refusal reason for an fp8 flavour the kernel does not read (ROCm's e4m3fnuz), or None."""
    fp8 = fp8_cache_dtype(kv_cache_dtype)
    if fp8 is None or fp8 in prefixattn.FP8_KV_DTYPES:
        return None
    return (f"kv_cache_dtype {kv_cache_dtype} is {str(fp8).replace('torch.', '')} on this platform (prefixattn reads "
            "float8_e4m3fn and float8_e5m2 caches)")


def _as_pair(device_capability) -> tuple[int, int] | None:
    """vLLM's ``DeviceCapability`` (or a ``(major, minor)`` pair) as a tuple; None when the platform has none."""
    if device_capability is None:
        return None
    if isinstance(device_capability, tuple):
        return int(device_capability[0]), int(device_capability[1])
    return int(device_capability.major), int(device_capability.minor)


def capability_unsupported(kv_cache_dtype: str | None, device_capability, *, is_rocm: bool = False) -> str | None:
    """The refusal reason for a cache the kernel cannot compile for this GPU, or None.

    Triton compiles float8_e4m3fn loads and stores for NVIDIA GPUs from compute capability 8.9 on
    (``prefixattn.FP8_E4M3_MIN_CAPABILITY``): an A100 (8.0) runs ``fp8_e5m2`` caches, not ``fp8``/``fp8_e4m3``.
    Nothing else is capability-bound: the kernel compiles in fp16/bf16/fp32 for sm_70, sm_75, sm_80 and sm_90
    (checked ahead of time with Triton's compiler). ``is_rocm``: the capability is AMD's numbering, not bound
    here (as in ``prefixattn``'s own check; ROCm's e4m3fnuz flavour is refused by :func:`fp8_unsupported`).
    """
    cap = _as_pair(device_capability)
    if cap is None or is_rocm or fp8_cache_dtype(kv_cache_dtype) != torch.float8_e4m3fn:
        return None
    need = tuple(prefixattn.FP8_E4M3_MIN_CAPABILITY)
    if cap >= need:
        return None
    return (f"kv_cache_dtype {kv_cache_dtype} (float8_e4m3fn) needs compute capability {need[0]}.{need[1]} or newer "
            f"(Triton compiles e4m3 loads from {need[0]}.{need[1]} on), this GPU has {cap[0]}.{cap[1]}; use "
            "--kv-cache-dtype fp8_e5m2 or auto")


def refusal_reasons(*, head_size: int, kv_cache_dtype: str, model_dtype: torch.dtype | None = None,
                    alibi_slopes=None, sliding_window=None, logits_soft_cap=None,
                    attn_type: str = AttentionType.DECODER, extra_impl_args: dict | None = None,
                    device_capability=None, is_rocm: bool = False) -> list[str]:
    """Why a layer configuration cannot run on prefixattn (empty list: it can), in vLLM's validation wording."""
    reasons = []
    if head_size not in SUPPORTED_HEAD_SIZES:
        reasons.append("head_size not supported")
    if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        reasons.append("kv_cache_dtype not supported")
    elif (mismatch := kv_cache_dtype_mismatch(kv_cache_dtype, model_dtype) or fp8_unsupported(kv_cache_dtype)
          or capability_unsupported(kv_cache_dtype, device_capability, is_rocm=is_rocm)):
        reasons.append(mismatch)
    if attn_type != AttentionType.DECODER:
        reasons.append(f"attention type {attn_type} not supported")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        reasons.append(f"sliding window {sliding_window!r} not supported (expected a positive int)")
    if alibi_slopes is not None:
        reasons.append("ALiBi not supported")
    if logits_soft_cap is not None and not (isinstance(logits_soft_cap, (int, float)) and logits_soft_cap >= 0):
        reasons.append(f"logits soft-cap {logits_soft_cap!r} not supported")
    extra = extra_impl_args or {}
    sinks = extra.get("sinks")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1
                              or sinks.dtype not in prefixattn.SINK_DTYPES):
        reasons.append("attention sinks not supported (expected a 1-D fp32/bf16/fp16 tensor, one per head)")
    for name, value in extra.items():
        if name != "sinks" and value not in (None, False, -1):
            reasons.append(f"{name}={value!r} not supported")
    return reasons


def configured_model_dtype(vllm_config) -> torch.dtype | None:
    """The model dtype of a vLLM config, as vLLM's own CPU backend reads it (``model_config.dtype``).

    Parameters
    ----------
    vllm_config : vllm.config.VllmConfig or None
        The config current while vLLM builds the model (``get_current_vllm_config_or_none()``).

    Returns
    -------
    torch.dtype or None
        None without a config or model config (an impl built outside vLLM's model construction): torch's default
        dtype is no stand-in, since only vLLM's model loader sets it to the model's. The cache-dtype refusal is then
        skipped, and the first forward's dtype check still rejects a cache that is not in the dtype of q.
    """
    dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def current_device_capability() -> tuple[tuple[int, int] | None, bool]:
    """``(capability, is_rocm)`` of this process's platform (None: no GPU): the impl's constructor checks the GPU
    it runs on."""
    from vllm.platforms import current_platform

    if not (current_platform.is_cuda() or current_platform.is_rocm()):
        return None, False
    return _as_pair(current_platform.get_device_capability()), bool(current_platform.is_rocm())
