"""Compile, before the first request, every kernel binary an engine configuration will launch.

Triton compiles a kernel the first time it is launched with a new set of compile-time values, 12-26 s per variant
for the fused attention kernel (one request would wait that long). For one model on one engine those values are
few and known at start-up:

* the fused attention kernel: one binary per work class (shared nodes, prefill-chunk tiles, decode tiles:
  ``IS_SHARED`` and the class's tiles and launch options), from the tile configs :func:`prefixattn.plan` picks (they
  depend on the dtype, head size, GQA group and the step's longest query chunk, bucketed by powers of two:
  :func:`attention_variants` walks every bucket up to the engine's longest chunk and keeps the distinct binaries),
  with or without the LSE output, and the block size (``PAGE_SIZE``), and the KV cache's dtype: an fp8 cache
  (``kv_dtypes``) loads fp8 and dequantizes with the per-tensor scales (``HAS_KV_SCALE``, and more warps for suffix
  launches), other binaries again;
* the K/V write kernel (:func:`prefixattn.write_kv`), one binary per dtype, cache dtype (fp8 quantizes: ``IS_FP8``)
  and head geometry, when the engine uses it.

:func:`warmup_kernels` launches each variant once through the public path (:func:`prefixattn.plan` with the config
pinned, then :func:`prefixattn.attention`) on tiny inputs (2 requests, 3 KV blocks), so the binaries it compiles are
the ones real steps look up. Under the Triton interpreter nothing is compiled: it reports the variants and returns at once
(``run_in_interpreter=True`` launches them in the interpreter anyway, to test the path). Engines call it from their
start-up (vLLM: the metadata builder; SGLang: the backend's constructor); ``PREFIXATTN_WARMUP=0`` turns that off.

What a launch specializes on beyond these constexprs (an int argument equal to 1, divisibility of an int or a
pointer by 16) comes from the engine's real head counts and head size, and from its tensor layout
(:class:`WarmupLayout`: q/k/v slices of a fused projection, K and V halves of one cache): the warm-up tensors are
laid out the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass, field

import torch

from prefixattn.autotune.buckets import MAX_Q_LEN_RANGE
from prefixattn.autotune.config_space import AttentionConfig, block_d, fp8_block_n
from prefixattn.autotune.lookup import fixed_config, planning_target, select_config
from prefixattn.kernels.layout import CLASS_CHUNK, CLASS_DECODE, CLASS_SHARED, WORK_CLASSES, page_size_constexpr
from prefixattn.planner.backend import planner_name
from prefixattn.planner.plans import compile_planner, plan
from prefixattn.planner.tiles import ClassTiles, choose_tiles, fit_kv_heads, tile_head_dim
from prefixattn.prefix_attention import attention
from prefixattn.runtime import interpreter_enabled
from prefixattn.validation import FP8_KV_DTYPES, SUPPORTED_DTYPES, check_head_dim, check_heads, torch_dtype_name

#: Environment variable: "0" (or "false", "off", "no") skips the engines' start-up warm-up.
WARMUP_ENV = "PREFIXATTN_WARMUP"
#: Longest query chunk the tile lookup distinguishes: every longer chunk selects the same config.
MAX_DISTINCT_Q_LEN = MAX_Q_LEN_RANGE[1]
#: KV blocks of the warm-up caches: block 0 shared by both requests, one own block each.
WARMUP_BLOCKS = 3

ATTENTION = "prefix_attention"
KV_WRITE = "kv_write"


@dataclass(frozen=True)
class KernelVariant:
    """One kernel binary: the compile-time values a launch specializes on.

    ``work_class`` (a ``layout.CLASS_*`` index) and ``tiles`` are the attention binary's work class and its tiles
    and launch options; ``config`` pins the tiles for the warm-up launch; ``max_q_lens`` are the query-chunk buckets
    whose steps select this binary (for the report).
    """

    kernel: str
    dtype: torch.dtype
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    work_class: int = CLASS_DECODE
    has_lse: bool = False
    tiles: ClassTiles | None = None
    config: AttentionConfig | None = None
    max_q_lens: tuple[int, ...] = ()
    slot_dtype: torch.dtype = torch.int64
    #: The K/V cache's dtype (None: ``dtype``); an fp8 one is a binary of its own (fp8 loads / stores).
    kv_dtype: torch.dtype | None = None
    #: ``HAS_KV_SCALE`` of an attention launch (per-tensor dequantization scales: fp8 caches).
    has_kv_scale: bool = False
    #: An AMD binary (its launch takes the HIP knobs; the fp8 warps rule is NVIDIA's).
    is_hip: bool = False
    #: V's head size where it differs from ``head_dim`` (``plan(v_head_dim=...)``: a binary of its own); None: the same.
    v_head_dim: int | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype if self.kv_dtype is not None else self.dtype

    @property
    def kv_fp8(self) -> bool:
        return self.cache_dtype in FP8_KV_DTYPES

    def describe(self) -> str:
        dt = torch_dtype_name(self.dtype)
        if self.cache_dtype != self.dtype:
            dt += f" kv {torch_dtype_name(self.cache_dtype)}"
        geometry = f"{dt} h{self.num_qo_heads}/{self.num_kv_heads} d{self.head_dim}" + (
            f" v{self.v_head_dim}" if self.v_head_dim else "")
        if self.kernel == KV_WRITE:
            return f"{KV_WRITE} {geometry} slots {torch_dtype_name(self.slot_dtype)}"
        t = self.tiles
        shared = self.work_class == CLASS_SHARED
        bd = block_d(tile_head_dim(self.head_dim, self.v_head_dim or self.head_dim))  # the plan's tiles.block_d
        lo = t.launch.for_kv(has_shared=shared, kv_fp8=self.kv_fp8, is_hip=self.is_hip, block_d=bd,
                             block_m=t.block_m, block_n=t.block_n)
        block_n = fp8_block_n(t.block_m, t.block_n, kv_fp8=self.kv_fp8, block_d=bd, has_shared=shared,
                              is_hip=self.is_hip, nan_guard=False)
        parts = [ATTENTION, geometry, f"page {page_size_constexpr(self.block_size) or 'any'}",
                 WORK_CLASSES[self.work_class], "+lse" if self.has_lse else "no-lse",
                 *(["+kv_scale"] if self.has_kv_scale else []), f"{t.block_m}x{block_n}",
                 f"w{lo.num_warps}/s{lo.num_stages}", f"q_len {_ranges(self.max_q_lens)}"]
        return " ".join(parts)


@dataclass
class VariantResult:
    variant: KernelVariant
    #: "compiled" (a new binary), "cached" (already compiled in this process), "launched" (ran; under the
    #: interpreter, or a Triton whose binary cache cannot be inspected), "skipped", "listed" (dry run), "failed"
    status: str
    seconds: float = 0.0
    error: str | None = None


@dataclass
class WarmupReport:
    """What :func:`warmup_kernels` did, variant by variant."""

    results: list[VariantResult] = field(default_factory=list)
    #: "gpu", "interpreter" (launched there), "skipped" (interpreter or no GPU: nothing to compile), "listed"
    mode: str = "gpu"
    #: The host planner plan() runs ("numba" or "numpy") and the seconds its compile, or its load from numba's
    #: cache, took (:func:`prefixattn.planner.plans.compile_planner`); empty when it was not warmed.
    planner: dict = field(default_factory=dict)

    @property
    def failed(self) -> list[VariantResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.results)

    def summary(self) -> str:
        counts = {}
        for r in self.results:
            counts[r.status] = counts.get(r.status, 0) + 1
        shown = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "nothing"
        return f"prefixattn warm-up ({self.mode}): {len(self.results)} kernel variants: {shown} in {self.seconds:.1f} s"

    def lines(self) -> list[str]:
        out = [self.summary()]
        if self.planner:
            out.append(f"  planner   {self.planner['seconds']:7.2f} s  {self.planner['name']} (plan() on the host)")
        for r in self.results:
            extra = f" ({r.error})" if r.error else ""
            out.append(f"  {r.status:9s} {r.seconds:7.2f} s  {r.variant.describe()}{extra}")
        return out


def warmup_enabled() -> bool:
    """False when ``$PREFIXATTN_WARMUP`` says off (engines then compile lazily, at the first launch)."""
    return os.environ.get(WARMUP_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _ranges(values: tuple[int, ...]) -> str:
    if not values:
        return "-"
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"


def query_len_buckets(max_q_len: int) -> list[int]:
    """The query-chunk lengths that can select different tiles: powers of two up to ``max_q_len`` (the lookup
    buckets by powers of two; its decode/prefill switch is monotone in the length), plus ``max_q_len`` itself."""
    if not isinstance(max_q_len, int) or max_q_len < 1:
        raise ValueError(f"max_q_len: expected a positive int (the longest query chunk of a step), got {max_q_len!r}")
    top = min(max_q_len, MAX_DISTINCT_Q_LEN)
    lens = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return sorted(set(lens) | {top})


def _check_config(num_qo_heads, num_kv_heads, head_dim, block_size, dtypes,
                  v_head_dim=None) -> tuple[torch.dtype, ...]:
    for name, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("block_size", block_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    check_heads(num_qo_heads, num_kv_heads)
    check_head_dim("head_dim", head_dim)
    if v_head_dim is not None:
        check_head_dim("v_head_dim", v_head_dim)
    return checked_dtypes(dtypes)


def checked_dtypes(dtypes) -> tuple[torch.dtype, ...]:
    """``dtypes`` (one q dtype or a sequence of them) as a tuple of supported q dtypes, else ValueError."""
    dtypes = tuple(dtypes) if isinstance(dtypes, (list, tuple)) else (dtypes,)
    bad = [d for d in dtypes if d not in SUPPORTED_DTYPES]
    if not dtypes or bad:
        raise ValueError(f"dtypes: expected torch.float16/bfloat16/float32, got {bad or 'nothing'}")
    return dtypes


def dtype_pairs(dtypes: tuple[torch.dtype, ...], kv_dtypes) -> list[tuple[torch.dtype, torch.dtype]]:
    """``(q dtype, cache dtype)`` pairs a launch can have: every q dtype with itself when ``kv_dtypes`` is None;
    else every fp8 cache dtype with every q dtype, and a 16/32-bit cache dtype with the same q dtype only (the
    kernel reads such a cache in the dtype of q)."""
    if kv_dtypes is None:
        return [(d, d) for d in dtypes]
    kv_dtypes = tuple(kv_dtypes) if isinstance(kv_dtypes, (list, tuple)) else (kv_dtypes,)
    bad = [d for d in kv_dtypes if d not in SUPPORTED_DTYPES + FP8_KV_DTYPES]
    if not kv_dtypes or bad:
        raise ValueError(f"kv_dtypes: expected torch.float16/bfloat16/float32/float8_e4m3fn/float8_e5m2, got "
                         f"{bad or 'nothing'}")
    pairs = [(d, kv) for d in dtypes for kv in dict.fromkeys(kv_dtypes) if kv == d or kv in FP8_KV_DTYPES]
    if not pairs:
        raise ValueError(f"kv_dtypes: expected fp8 or one of the q dtypes {[torch_dtype_name(d) for d in dtypes]} "
                         f"(a 16/32-bit cache is read in the dtype of q), got "
                         f"{[torch_dtype_name(d) for d in kv_dtypes]}")
    return pairs


def attention_variants(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtypes,
                       max_q_len: int = 1, with_lse: bool = False, target="auto", kv_dtypes=None,
                       fp8_kv_scales=(True,), v_head_dim: int | None = None) -> list[KernelVariant]:
    """The fused-kernel binaries steps of this configuration can launch (see the module docstring).

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim, block_size : int
        Per-rank heads of the model and the cache's block size.
    v_head_dim : int, optional
        V's head size, where the plans set one of its own (``plan(v_head_dim=...)``).
    dtypes : torch.dtype or sequence of them
        Model dtypes (q's; the caches' too unless ``kv_dtypes``).
    max_q_len : int
        Longest query chunk of one request in a step (the engine's chunked-prefill size; 1 = decode only).
    with_lse : bool
        Also the variants that return the LSE (library users of ``return_lse=True``; engines do not).
    target : ``"auto"`` (this device), a target name (``"sm90"``: what that GPU's tables select) or None.
    kv_dtypes : torch.dtype or sequence of them, optional
        The KV caches' dtypes (default: each q dtype, a cache in the model's dtype); fp8
        (``float8_e4m3fn``/``float8_e5m2``) adds the fp8-loading binaries (:func:`dtype_pairs`).
    fp8_kv_scales : sequence of bool
        The ``HAS_KV_SCALE`` values fp8 launches have: True when the engine passes per-tensor scales (vLLM's layer
        scale tensors always; SGLang's float scales when ``v_scale != 1``), False when it passes none (a float
        ``k_scale`` folds into the softmax scale). 16/32-bit caches launch without scales.

    Returns
    -------
    list of KernelVariant, in dtype, cache dtype, query-length and work-class order, without duplicates.
    """
    dtypes = _check_config(num_qo_heads, num_kv_heads, head_dim, block_size, dtypes, v_head_dim)
    pairs = dtype_pairs(dtypes, kv_dtypes)
    group = num_qo_heads // num_kv_heads
    own_v = v_head_dim if v_head_dim not in (None, head_dim) else None
    tiles_d = tile_head_dim(head_dim, own_v or head_dim)
    found: dict = {}
    with planning_target(target):
        for dtype, kv_dtype in pairs:
            fp8 = kv_dtype in FP8_KV_DTYPES
            scale_switches = tuple(dict.fromkeys(bool(x) for x in fp8_kv_scales)) if fp8 else (False,)
            for q_len in query_len_buckets(max_q_len):
                # The same calls plan() makes (choose_tiles memoizes select_config's answers per bucket).
                tiles = fit_kv_heads(choose_tiles(head_dim=tiles_d, group=group, max_q_len=q_len, dtype=dtype),
                                     num_kv_heads=num_kv_heads, group=group, nan_guard=False)
                decode = select_config(head_dim=tiles_d, dtype=dtype, group=group, max_q_len=1).config
                chunk = select_config(head_dim=tiles_d, dtype=dtype, group=group, max_q_len=q_len).config
                # A step of this bucket runs chunk tiles only when its chunks pass a decode tile's rows (and they
                # have a binary of their own).
                chunks = q_len > tiles.rows_per_decode_tile(group) and tiles.chunk != tiles.decode
                classes = (CLASS_SHARED, CLASS_DECODE) + ((CLASS_CHUNK,) if chunks else ())
                for has_kv_scale, has_lse, work_class in itertools.product(
                        scale_switches, (False, True) if with_lse else (False,), classes):
                    key = (dtype, kv_dtype, has_kv_scale, work_class, tiles.of(work_class), has_lse)
                    if key in found:
                        v = found[key]
                        found[key] = dataclasses.replace(v, max_q_lens=v.max_q_lens + (q_len,))
                        continue
                    found[key] = KernelVariant(
                        kernel=ATTENTION, dtype=dtype, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, block_size=block_size, work_class=work_class, has_lse=has_lse,
                        tiles=tiles.of(work_class), config=chunk if work_class == CLASS_CHUNK else decode,
                        max_q_lens=(q_len,), kv_dtype=None if kv_dtype == dtype else kv_dtype,
                        has_kv_scale=has_kv_scale, is_hip=tiles.is_hip, v_head_dim=own_v)
    return list(found.values())


def kv_write_variants(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtypes,
                      slot_dtype: torch.dtype = torch.int64, kv_dtypes=None) -> list[KernelVariant]:
    """The :func:`prefixattn.write_kv` binaries: new K/V in each of ``dtypes`` into caches of ``kv_dtypes``
    (:func:`dtype_pairs`; fp8 quantizes), ``slot_dtype``: vLLM's int64."""
    dtypes = _check_config(num_qo_heads, num_kv_heads, head_dim, block_size, dtypes)
    if slot_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_dtype: expected torch.int32 or torch.int64, got {slot_dtype!r}")
    return [KernelVariant(kernel=KV_WRITE, dtype=d, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, block_size=block_size, slot_dtype=slot_dtype,
                          kv_dtype=None if kv == d else kv) for d, kv in dtype_pairs(dtypes, kv_dtypes)]


def kernel_variants(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtypes,
                    max_q_len: int = 1, with_lse: bool = False, kv_write: bool = False,
                    slot_dtype: torch.dtype = torch.int64, target="auto", kv_dtypes=None,
                    fp8_kv_scales=(True,), v_head_dim: int | None = None) -> list[KernelVariant]:
    """Every binary :func:`warmup_kernels` would compile: :func:`attention_variants`, plus
    :func:`kv_write_variants` when the engine writes K/V with :func:`prefixattn.write_kv` (``kv_write``; K and V of
    one head size)."""
    geometry = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                    dtypes=dtypes, kv_dtypes=kv_dtypes)
    if kv_write and v_head_dim not in (None, head_dim):
        raise ValueError(f"kv_write: expected False with a v_head_dim of its own (write_kv writes K and V of one "
                         f"head size), got True with v_head_dim={v_head_dim}")
    variants = attention_variants(**geometry, max_q_len=max_q_len, with_lse=with_lse, target=target,
                                  fp8_kv_scales=fp8_kv_scales, v_head_dim=v_head_dim)
    if kv_write:
        variants += kv_write_variants(**geometry, slot_dtype=slot_dtype)
    return variants


@dataclass(frozen=True)
class WarmupLayout:
    """How the engine lays out the tensors it launches with, as far as Triton specializes on it (an int argument
    equal to 1, or divisible by 16): the warm-up launches with the same layout, so it compiles the same binaries.

    ``fused_qkv``: q, k and v are column slices of one ``[tokens, (H + 2 Hkv) * D]`` projection (vLLM, SGLang), not
    contiguous tensors. ``kv_interleaved``: K and V are the two halves of one cache's ``[..., 2 * D]`` last dim (vLLM),
    not separate caches (SGLang's pool).
    """

    fused_qkv: bool = False
    kv_interleaved: bool = False


#: The engines' layouts.
VLLM_LAYOUT = WarmupLayout(fused_qkv=True, kv_interleaved=True)
SGLANG_LAYOUT = WarmupLayout(fused_qkv=True, kv_interleaved=False)


def _rows(v: KernelVariant, num_tokens: int, layout: WarmupLayout, device) -> tuple[torch.Tensor, ...]:
    """Zero q ``[T, H, D]``, k and v ``[T, Hkv, D]`` in ``layout``."""
    h, hkv, d = v.num_qo_heads, v.num_kv_heads, v.head_dim
    if not layout.fused_qkv:
        return tuple(torch.zeros((num_tokens, n, d), dtype=v.dtype, device=device) for n in (h, hkv, hkv))
    qkv = torch.zeros((num_tokens, (h + 2 * hkv) * d), dtype=v.dtype, device=device)
    return (qkv[:, :h * d].view(num_tokens, h, d), qkv[:, h * d:(h + hkv) * d].view(num_tokens, hkv, d),
            qkv[:, (h + hkv) * d:].view(num_tokens, hkv, d))


def _caches(v: KernelVariant, layout: WarmupLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero K and V caches ``[blocks, block_size, Hkv, D]`` (V: ``v_head_dim``) in ``layout`` and the variant's cache
    dtype."""
    blocks, d, dv = (WARMUP_BLOCKS, v.block_size, v.num_kv_heads), v.head_dim, v.v_head_dim or v.head_dim
    dt = v.cache_dtype
    if layout.kv_interleaved:
        kv = torch.zeros(blocks + (d + dv,), dtype=dt, device=device)
        return kv[..., :d], kv[..., d:]
    return torch.zeros(blocks + (d,), dtype=dt, device=device), torch.zeros(blocks + (dv,), dtype=dt, device=device)


def _scales(v: KernelVariant, device) -> dict:
    """Per-tensor scales as vLLM passes them (1-element fp32 tensors, read by pointer) for a launch with scales."""
    if not (v.has_kv_scale or (v.kernel == KV_WRITE and v.kv_fp8)):
        return {}
    return {name: torch.ones(1, dtype=torch.float32, device=device) for name in ("k_scale", "v_scale")}


def _launch_attention(v: KernelVariant, layout: WarmupLayout, device: torch.device) -> None:
    """One step through plan() + attention() that launches ``v``'s class (:func:`warmup_step`)."""
    bs = v.block_size
    with fixed_config(v.config):
        p = plan(*warmup_step(v.work_class, bs, v.tiles.rows(v.num_qo_heads // v.num_kv_heads) + 1), block_size=bs,
                 num_qo_heads=v.num_qo_heads, num_kv_heads=v.num_kv_heads, head_dim=v.head_dim,
                 v_head_dim=v.v_head_dim, q_dtype=v.dtype, kv_dtype=v.cache_dtype, device=device,
                 sharing="always" if v.work_class == CLASS_SHARED else "never")
    # A binary is its kind of item and its tiles: under the pinned config the chunk tiles run in the decode class
    # (one binary serves both), which compiles the same binary.
    if (v.work_class == CLASS_SHARED, v.tiles) not in launch_binaries(p):
        raise RuntimeError(f"the warm-up plan did not reproduce the variant (classes {p.work_classes}, tiles "
                           f"{p.tiles}); nothing launched")
    q, _, _ = _rows(v, p.num_tokens, layout, device)
    k_cache, v_cache = _caches(v, layout, device)
    attention(q, k_cache, v_cache, p, return_lse=v.has_lse, **_scales(v, device))


def warmup_step(work_class: int, block_size: int, chunk_rows: int) -> tuple[torch.Tensor, ...]:
    """``(qo_indptr, kv_lens, block_table)`` of a warm-up step that runs ``work_class``: 2 decode requests sharing
    block 0 (the shared class; their decode tiles run too), one request of one row (decode) or of ``chunk_rows``
    (chunk: one row more than a decode tile holds). Block ids below :data:`WARMUP_BLOCKS`, reused in turn (the values
    are never checked: only the binary matters)."""
    bs = block_size
    if work_class == CLASS_SHARED:
        return torch.tensor([0, 1, 2]), torch.tensor([bs + 1, bs + 1]), torch.tensor([[0, 1], [0, 2]])
    rows = chunk_rows if work_class == CLASS_CHUNK else 1
    blocks = -(-(bs + rows) // bs)
    return (torch.tensor([0, rows]), torch.tensor([bs + rows]),
            torch.tensor([[i % WARMUP_BLOCKS for i in range(blocks)]]))


def launch_binaries(p) -> set:
    """The attention binaries a plan's launches use: ``(shared item kind, ClassTiles)`` per work class with items."""
    return {(c == CLASS_SHARED, p.tiles.of(c)) for c in p.work_classes}


def _launch_kv_write(v: KernelVariant, layout: WarmupLayout, device: torch.device) -> None:
    from prefixattn.kv_write import write_kv

    _, key, value = _rows(v, 2, layout, device)
    k_cache, v_cache = _caches(v, layout, device)
    write_kv(key, value, k_cache, v_cache, torch.tensor([0, -1], dtype=v.slot_dtype, device=device),
             **_scales(v, device))


def _binaries_in_process(kernel) -> int | None:
    """Binaries ``kernel`` holds in this process (Triton's per-device cache), or None where this Triton has no such
    cache (the interpreter)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return None
    try:
        return sum(len(entry[0]) for entry in caches.values())
    except (TypeError, IndexError):  # another Triton's layout of the cache: report times only
        return None


def _kernel_of(v: KernelVariant):
    if v.kernel == KV_WRITE:
        from prefixattn.kernels.kv_write_kernel import kv_write_kernel

        return kv_write_kernel
    from prefixattn.kernels.prefix_attention_kernel import prefix_attention_kernel

    return prefix_attention_kernel


def _run_one(v, launch, kernel, device: torch.device, interpreted: bool) -> VariantResult:
    """Launch ``v`` once with ``launch(v, device)`` and report whether ``kernel`` compiled a new binary for it."""
    before = _binaries_in_process(kernel)
    start = time.perf_counter()
    try:
        launch(v, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - reported per variant; the caller decides whether a failure is fatal
        return VariantResult(v, "failed", time.perf_counter() - start, f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - start
    after = _binaries_in_process(kernel)
    if interpreted or before is None or after is None:
        return VariantResult(v, "launched", seconds)
    return VariantResult(v, "compiled" if after > before else "cached", seconds)


def warm_planner() -> dict:
    """Compile the compiled planner's variants (or load them from numba's on-disk cache) so that the first plan()
    does not wait for numba (tens of seconds on a 2-core host): ``{"name", "seconds"}``."""
    name = planner_name()
    start = time.perf_counter()
    if name == "numba":
        compile_planner()
    return {"name": name, "seconds": time.perf_counter() - start}


def _skipped(variants: list[KernelVariant], why: str) -> WarmupReport:
    return WarmupReport([VariantResult(v, "skipped", error=why) for v in variants], mode="skipped")


def warmup_kernels(*, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtypes=torch.float16,
           max_q_len: int = 1, with_lse: bool = False, kv_write: bool = False,
           slot_dtype: torch.dtype = torch.int64, layout: WarmupLayout = WarmupLayout(), device=None,
           run_in_interpreter: bool = False, kv_dtypes=None, fp8_kv_scales=(True,),
           v_head_dim: int | None = None) -> WarmupReport:
    """Compile every kernel variant this configuration uses (see :func:`kernel_variants`) by launching each once.

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim, block_size, dtypes, max_q_len, with_lse, kv_write, slot_dtype, v_head_dim
        As in :func:`kernel_variants`.
    kv_dtypes, fp8_kv_scales
        The KV caches' dtypes (default: the dtypes of q) and, for fp8 caches, whether launches pass per-tensor
        scales (:func:`attention_variants`): an fp8 engine passes its cache dtype, so the fp8 attention and
        ``write_kv`` binaries compile here instead of at its first request.
    layout : WarmupLayout
        How the engine lays out q/k/v and the caches (default: contiguous tensors, separate caches;
        ``VLLM_LAYOUT``, ``SGLANG_LAYOUT``).
    device : torch.device or str, optional
        Where to launch; default the current CUDA device (CPU under the interpreter). Without a GPU (and no
        ``device``) nothing is compiled and every variant is reported "skipped".
    run_in_interpreter : bool
        Under ``TRITON_INTERPRET=1`` there is nothing to compile and the default is to only list the variants
        (status "skipped"); True launches each of them in the interpreter (tests of this path).

    Returns
    -------
    WarmupReport
        One result per variant (see :class:`VariantResult`); a failed variant carries its error and the others
        still run.

    Examples
    --------
    >>> report = prefixattn.warmup_kernels(num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
    ...                            dtypes=torch.bfloat16, max_q_len=8192)
    >>> print("\\n".join(report.lines()))
    """
    variants = kernel_variants(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               block_size=block_size, dtypes=dtypes, max_q_len=max_q_len, with_lse=with_lse,
                               kv_write=kv_write, slot_dtype=slot_dtype, kv_dtypes=kv_dtypes,
                               fp8_kv_scales=fp8_kv_scales, v_head_dim=v_head_dim)
    return run_warmup(variants, launch=lambda v, dev: (_launch_kv_write if v.kernel == KV_WRITE else
                                                       _launch_attention)(v, layout, dev),
                      kernel_of=_kernel_of, device=device, run_in_interpreter=run_in_interpreter)


def run_warmup(variants: list, *, launch, kernel_of, device, run_in_interpreter: bool) -> WarmupReport:
    """Warm the planner, then launch each of ``variants`` once (``launch(variant, device)``; ``kernel_of(variant)``:
    the Triton kernel whose binaries tell a compile from a cache hit): :func:`warmup_kernels`' driver, and
    :func:`prefixattn.warmup_mla_kernels`'."""
    planner = warm_planner()  # host code: compiled on any machine, also without a GPU
    interpreted = interpreter_enabled()
    if interpreted and not run_in_interpreter:
        return dataclasses.replace(_skipped(variants, "interpreter: nothing to compile"), planner=planner)
    if not interpreted and device is None and not torch.cuda.is_available():
        return dataclasses.replace(_skipped(variants, "no GPU: nothing to compile"), planner=planner)
    if device is None:
        device = "cpu" if interpreted else "cuda"
    device = torch.device(device)
    if not interpreted and device.type != "cuda":  # ROCm tensors are "cuda" too
        raise ValueError(f"device: expected a CUDA/ROCm device (kernels compile for a GPU), got {device}; under "
                         "the Triton interpreter there is nothing to compile")
    report = WarmupReport(mode="interpreter" if interpreted else "gpu", planner=planner)
    for v in variants:
        report.results.append(_run_one(v, launch, kernel_of(v), device, interpreted))
    return report
