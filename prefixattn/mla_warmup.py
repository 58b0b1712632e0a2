"""Compile, before the first request, every MLA kernel binary an engine's MLA layers will launch.

The MLA kernel's binaries (:mod:`prefixattn.kernels.mla_attention_kernel`) are one per work class a step can run
(shared nodes, prefill-chunk tiles, decode tiles: ``IS_SHARED`` and the class's tiles and launch options), per q
dtype and latent cache dtype (an fp8 latent loads fp8 and may be dequantized by a scale: ``HAS_KV_SCALE``), with or
without the LSE output, and per block size (``PAGE_SIZE``). Unlike the MHA kernel's, the tiles do not depend on the
query length (:func:`prefixattn.planner.tiles.mla_tiles`), so the longest query chunk only decides whether the chunk
class runs at all.

:func:`warmup_mla_kernels` launches each binary once through the public path (:func:`prefixattn.plan_mla`, then
:func:`prefixattn.mla_attention`) on tiny inputs laid out as the engines lay out theirs (contiguous
``[tokens, heads, kv_lora_rank + rope_dim]`` queries, a ``[blocks, block_size, kv_lora_rank + rope_dim]`` latent
cache), with the model's real head count: a launch specializes on an int argument equal to 1 (one head block) and on
divisibility by 16 (the head block, the strides). Driver and report are :func:`prefixattn.warmup_kernels`'.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from prefixattn.kernels.layout import CLASS_CHUNK, CLASS_DECODE, CLASS_SHARED, WORK_CLASSES, page_size_constexpr
from prefixattn.kernels.mla_attention_kernel import mla_attention_kernel
from prefixattn.mla import mla_attention, plan_mla
from prefixattn.planner.cost_rule import mla_heads_per_program
from prefixattn.planner.tiles import ClassTiles, mla_tiles
from prefixattn.validation import FP8_KV_DTYPES, check_mla_dims, torch_dtype_name
from prefixattn.warmup import (WARMUP_BLOCKS, WarmupReport, checked_dtypes, dtype_pairs, launch_binaries,
                               run_warmup, warmup_step)

MLA_ATTENTION = "mla_attention"


@dataclass(frozen=True)
class MLAKernelVariant:
    """One MLA kernel binary: the compile-time values a launch specializes on (see the module docstring)."""

    dtype: torch.dtype
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    block_size: int
    work_class: int
    tiles: ClassTiles
    has_lse: bool = False
    #: The latent cache's dtype (None: ``dtype``); an fp8 one is a binary of its own.
    kv_dtype: torch.dtype | None = None
    #: ``HAS_KV_SCALE``: the launch dequantizes an fp8 latent by a scale (a tensor, or a float other than 1).
    has_kv_scale: bool = False
    is_hip: bool = False
    kernel: str = MLA_ATTENTION

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype if self.kv_dtype is not None else self.dtype

    def describe(self) -> str:
        dt = torch_dtype_name(self.dtype)
        if self.kv_dtype is not None:
            dt += f" kv {torch_dtype_name(self.kv_dtype)}"
        t, lo = self.tiles, self.tiles.launch
        parts = [MLA_ATTENTION, dt, f"h{self.num_heads} latent {self.kv_lora_rank}+{self.rope_dim}",
                 f"page {page_size_constexpr(self.block_size) or 'any'}", WORK_CLASSES[self.work_class],
                 "+lse" if self.has_lse else "no-lse", *(["+kv_scale"] if self.has_kv_scale else []),
                 f"{t.block_m}x{t.block_n}", f"w{lo.num_warps}/s{lo.num_stages}"]
        return " ".join(parts)


def mla_kernel_variants(*, num_heads: int, block_size: int, dtypes, kv_lora_rank: int = 512, rope_dim: int = 64,
                        max_q_len: int = 1, with_lse: bool = False, kv_dtypes=None, fp8_kv_scales=(True,),
                        is_hip: bool | None = None) -> list[MLAKernelVariant]:
    """The MLA kernel binaries steps of this configuration can launch.

    Parameters
    ----------
    num_heads, block_size : int
        Query heads of the layer on this device and the latent cache's block size.
    dtypes : torch.dtype or sequence of them
        Dtypes of q (the latent cache's too unless ``kv_dtypes``).
    kv_lora_rank, rope_dim : int
        As :func:`prefixattn.plan_mla`.
    max_q_len : int
        Longest query chunk of one request in a step (1: decode only). Longer than a decode tile holds, the chunk
        class runs too.
    with_lse : bool
        Also the variants that return the LSE (``return_lse=True``; engines do not).
    kv_dtypes, fp8_kv_scales
        As :func:`prefixattn.warmup.attention_variants`: the latent caches' dtypes (fp8 adds its binaries), and for
        fp8 whether launches pass a scale (vLLM: the layer's scale tensor, always; SGLang: its float scale, when it
        is not 1).
    is_hip : bool, optional
        AMD's tiles (default: the torch build's).

    Returns
    -------
    list of MLAKernelVariant, in dtype, cache dtype and work-class order, without duplicates. The shared class only
    where the planner can keep a shared node: a shared tile that packs one request's heads reads the prefix as often
    as the requests' own tiles, so ``sharing="auto"`` never shares there (fp8 latents at 16 heads).
    """
    for name, value in (("num_heads", num_heads), ("block_size", block_size), ("max_q_len", max_q_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    check_mla_dims(kv_lora_rank, rope_dim)
    dtypes = checked_dtypes(dtypes)
    group = mla_heads_per_program(num_heads)
    variants = []
    for dtype, kv_dtype in dtype_pairs(dtypes, kv_dtypes):
        fp8 = kv_dtype in FP8_KV_DTYPES
        tiles = mla_tiles(kv_lora_rank=kv_lora_rank, dtype=dtype, kv_fp8=fp8, is_hip=is_hip)
        classes = (CLASS_SHARED,) if tiles.rows_per_shared_tile(group) > 1 else ()
        classes += (CLASS_DECODE,)
        if max_q_len > tiles.rows_per_decode_tile(group) and tiles.chunk != tiles.decode:
            classes += (CLASS_CHUNK,)
        scale_switches = tuple(dict.fromkeys(bool(x) for x in fp8_kv_scales)) if fp8 else (False,)
        lse_switches = (False, True) if with_lse else (False,)
        for has_kv_scale, has_lse, work_class in itertools.product(scale_switches, lse_switches, classes):
            variants.append(MLAKernelVariant(
                dtype=dtype, num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, block_size=block_size,
                work_class=work_class, tiles=tiles.of(work_class), has_lse=has_lse,
                kv_dtype=None if kv_dtype == dtype else kv_dtype, has_kv_scale=has_kv_scale, is_hip=tiles.is_hip))
    return variants


def _launch_mla(v: MLAKernelVariant, device: torch.device) -> None:
    """One step through plan_mla() + mla_attention() that launches ``v``'s class
    (:func:`~prefixattn.warmup.warmup_step`)."""
    bs, width = v.block_size, v.kv_lora_rank + v.rope_dim
    chunk_rows = v.tiles.rows(mla_heads_per_program(v.num_heads)) + 1
    p = plan_mla(*warmup_step(v.work_class, bs, chunk_rows), block_size=bs, num_heads=v.num_heads,
                 sm_scale=width ** -0.5, kv_lora_rank=v.kv_lora_rank, rope_dim=v.rope_dim, q_dtype=v.dtype,
                 kv_dtype=v.cache_dtype, device=device, sharing="always" if v.work_class == CLASS_SHARED else "never")
    if (v.work_class == CLASS_SHARED, v.tiles) not in launch_binaries(p):
        raise RuntimeError(f"the warm-up plan did not reproduce the variant (classes {p.work_classes}, tiles "
                           f"{p.tiles}); nothing launched")
    q = torch.zeros((p.num_tokens, v.num_heads, width), dtype=v.dtype, device=device)
    cache = torch.zeros((WARMUP_BLOCKS, bs, width), dtype=v.cache_dtype, device=device)
    scale = torch.ones(1, dtype=torch.float32, device=device) if v.has_kv_scale else None
    mla_attention(q, cache, p, return_lse=v.has_lse, kv_scale=scale)


def warmup_mla_kernels(*, num_heads: int, block_size: int, dtypes=torch.bfloat16, kv_lora_rank: int = 512,
                       rope_dim: int = 64, max_q_len: int = 1, with_lse: bool = False, kv_dtypes=None,
                       fp8_kv_scales=(True,), device=None, run_in_interpreter: bool = False) -> WarmupReport:
    """Compile every MLA kernel variant this configuration uses (:func:`mla_kernel_variants`) by launching each once.

    Parameters
    ----------
    num_heads, block_size, dtypes, kv_lora_rank, rope_dim, max_q_len, with_lse, kv_dtypes, fp8_kv_scales
        As :func:`mla_kernel_variants`.
    device, run_in_interpreter
        As :func:`prefixattn.warmup_kernels`: without a GPU nothing is compiled (every variant "skipped").

    Returns
    -------
    WarmupReport
        One result per variant; a failed variant carries its error and the others still run.

    Examples
    --------
    >>> report = prefixattn.warmup_mla_kernels(num_heads=16, block_size=64, dtypes=torch.bfloat16)
    >>> print("\\n".join(report.lines()))
    """
    variants = mla_kernel_variants(num_heads=num_heads, block_size=block_size, dtypes=dtypes,
                                   kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, max_q_len=max_q_len,
                                   with_lse=with_lse, kv_dtypes=kv_dtypes, fp8_kv_scales=fp8_kv_scales)
    return run_warmup(variants, launch=_launch_mla, kernel_of=lambda _v: mla_attention_kernel, device=device,
                      run_in_interpreter=run_in_interpreter)

