"""plan()'s option checks: :class:`PlanOptions`, what every step of an engine shares, checked once
(:func:`checked_options`, memoized), and the option defaults that depend on the device."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from prefixattn.memo import typed_memo
from prefixattn.planner.cost_rule import mla_cost_head_dim
from prefixattn.validation import (CPU_DEVICE, SUPPORTED_DTYPES, check_head_dim, check_heads, check_kv_dtype,
                                   check_mla_dims, check_soft_cap, check_window_left)

#: SMs assumed when no GPU is visible (plan() on a CPU host, or the interpreter): an H100 SXM, the tuning target.
DEFAULT_NUM_SMS = 132
#: Shortest split-k chunk (KV tokens). A chunk costs a program start (~a few us) and a partial-state write + read;
#: below ~256 tokens per chunk that overhead is comparable to the chunk's own KV read at head_dim 128.
MIN_SPLIT_TOKENS = 256
_SHARING_MODES = ("auto", "always", "never")
#: Not a user's mode: ``"auto"`` with the requests that gain from no node kept out of every node
#: (:func:`prefixattn.planner.cost_rule.request_sharing_pays_off`). ``sharing="auto"`` plans it beside the plain rule
#: where that rule put such requests in a node, and keeps the faster plan (modeled; :mod:`.choose`).
SHARING_APART = "auto-apart"


def _check_options(*, causal, sm_scale, logits_soft_cap, window_left, alibi_slopes, sharing, q_dtype,
                   nan_guard) -> tuple[float, int]:
    """The feature options' checks; returns ``(logits_soft_cap, window_left)`` normalized (0.0 / -1: off)."""
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not supported yet (expected None), got a value")
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected a bool, got {type(causal).__name__}")
    soft_cap = check_soft_cap(logits_soft_cap)
    window_left = check_window_left(window_left, causal)
    if not isinstance(nan_guard, bool):
        raise ValueError(f"nan_guard: expected a bool, got {type(nan_guard).__name__}")
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating))
                                 or not math.isfinite(sm_scale) or sm_scale < 0):
        # The kernel scales each row's raw maximum score, which is the maximum of the scaled ones only for a scale
        # >= 0 (prefixattn.kernels.prefix_attention_kernel._attend_range).
        raise ValueError(f"sm_scale: expected a finite float >= 0 or None, got {sm_scale!r}")
    if sharing not in _SHARING_MODES:
        raise ValueError(f"sharing: expected one of {_SHARING_MODES}, got {sharing!r}")
    if q_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q_dtype: expected one of {[str(d) for d in SUPPORTED_DTYPES]}, got {q_dtype}")
    return soft_cap, window_left


class PlanOptions(NamedTuple):
    """plan()'s options, checked and normalized (:func:`checked_options`): what every step of an engine shares."""

    causal: bool
    sm_scale: float  # the scale used: 1 / sqrt(head_dim) when not given
    q_dtype: torch.dtype
    kv_dtype: torch.dtype  # q_dtype when not given
    logits_soft_cap: float  # 0.0: off
    window_left: int  # -1: off
    sharing: str
    nan_guard: bool
    block_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int  # V's and the output's head size (head_dim unless plan(v_head_dim=...); an MLA plan's: head_dim)
    min_split_tokens: int
    num_sms: int | None  # None: from the plan's device
    #: > 0: an MLA plan (:func:`prefixattn.plan_mla`): ``head_dim`` is the latent width (``kv_lora_rank``), this the
    #: rotary key width, ``num_kv_heads`` the head blocks (programs per item) of ``group`` query heads each.
    rope_dim: int = 0
    #: Run the decode launch beside the compute launches (shared, chunk) where that pays, modeled
    #: (:mod:`prefixattn.planner.overlap`).
    overlap: bool = False

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def cost_head_dim(self) -> int:
        """The head size the cost models price a KV position at (a K and a V row of this size: the program costs and
        the sharing rule's saved bytes): the mean of K's and V's, rounded up; an MLA plan's:
        :func:`~prefixattn.planner.cost_rule.mla_cost_head_dim`."""
        if self.rope_dim:
            return mla_cost_head_dim(self.head_dim, self.rope_dim)
        return -(-(self.head_dim + self.v_head_dim) // 2)


@typed_memo(maxsize=256)  # an engine plans with the same options every step (~5 us of checks on the 2-core host)
def checked_options(*, causal, sm_scale, logits_soft_cap, window_left, alibi_slopes, sharing, q_dtype, kv_dtype,
                    nan_guard, block_size, num_qo_heads, num_kv_heads, head_dim, min_split_tokens,
                    num_sms, rope_dim=0, overlap=False, v_head_dim=None) -> PlanOptions:
    """plan()'s option checks (its parameters of the same names): the options normalized, or the ``ValueError`` of
    the first bad one. :data:`OPTION_DEFAULTS` holds plan()'s defaults. ``rope_dim > 0``: an MLA plan's
    (:func:`prefixattn.plan_mla`), whose ``head_dim`` is the latent width and whose ``sm_scale`` must be given;
    ``v_head_dim`` None: ``head_dim``."""
    soft_cap, window_left = _check_options(
        causal=causal, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left,
        alibi_slopes=alibi_slopes, sharing=sharing, q_dtype=q_dtype, nan_guard=nan_guard)
    kv_dtype, block_size = check_kv_dtype(kv_dtype, q_dtype), _positive_int("block_size", block_size)
    num_qo_heads, num_kv_heads = _positive_int("num_qo_heads", num_qo_heads), _positive_int("num_kv_heads",
                                                                                            num_kv_heads)
    check_heads(num_qo_heads, num_kv_heads)
    if rope_dim:
        check_mla_dims(head_dim, rope_dim)
        if sm_scale is None:
            # 1 / sqrt of the model's query-key head size (DeepSeek-V3: 128 + 64), which the latent does not carry.
            raise ValueError("sm_scale: expected the MLA model's softmax scale (a float), got None")
        for name, on, value in (("logits_soft_cap", soft_cap > 0, logits_soft_cap),
                                ("window_left", window_left >= 0, window_left), ("nan_guard", nan_guard, nan_guard)):
            if on:
                raise ValueError(f"{name}: expected it off for an MLA plan (the MLA kernel has no soft cap, window "
                                 f"or NaN guard), got {value!r}")
        if v_head_dim is not None and v_head_dim != head_dim:
            raise ValueError(f"v_head_dim: expected None for an MLA plan (the latent is the value), got "
                             f"{v_head_dim!r}")
    else:
        check_head_dim("head_dim", head_dim)
        if v_head_dim is not None:
            check_head_dim("v_head_dim", v_head_dim)
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap: expected a bool, got {type(overlap).__name__}")
    if overlap and rope_dim:
        raise ValueError("overlap: expected False for an MLA plan (the MLA kernel runs its classes in series), "
                         "got True")
    return PlanOptions(
        causal=causal, sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale), q_dtype=q_dtype,
        kv_dtype=kv_dtype, logits_soft_cap=soft_cap, window_left=window_left, sharing=sharing, nan_guard=nan_guard,
        block_size=block_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, v_head_dim=head_dim if v_head_dim is None else int(v_head_dim),
        min_split_tokens=_positive_int("min_split_tokens", min_split_tokens),
        num_sms=None if num_sms is None else _positive_int("num_sms", num_sms), rope_dim=int(rope_dim),
        overlap=overlap)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def _default_num_sms(device: torch.device) -> int:
    if device is CPU_DEVICE:  # canonical_device's CPU object: no torch attribute read (~0.5 us) per step
        return DEFAULT_NUM_SMS
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS
