"""What ``prefixattn compile-check`` compiles: one :class:`CompileJob` per (kernel, variant, dtype, head size, target,
config), with the signature a real launch would specialize to.

Triton specializes a launch on its arguments: an int equal to 1 becomes the constant 1, an int divisible by 16 and
a 16-byte aligned pointer carry a divisibility hint, and on HIP a pointer into a buffer under 2 GiB may use buffer
instructions. The jobs here reproduce that from a representative launch (Llama-3-8B-like heads, 16-token blocks,
contiguous tensors), so the checked binaries are the ones users run.

Variants of the fused kernel: one binary per work class (``IS_SHARED`` and the class's ``BLOCK_M``/``BLOCK_N``): the
shared class and the decode class from a decode config (variants ``decode`` and ``decode/suffix-only``), the chunk
class from a chunked-prefill config (``chunked_prefill/suffix-only``); its other constexpr switches are ``HAS_LSE``
and ``USE_FP32_DOT`` (tied to the fp32 dtype on GPUs), and the feature switches (``HAS_SOFT_CAP``, ``HAS_WINDOW``,
``HAS_SINKS``, ``HAS_KV_SCALE`` with fp8 K/V pointers, ``USE_NAN_GUARD``), off in the default variants and on in
:func:`feature_jobs` (for every binary). Split-k and merging are run-time paths of every binary (work items and the
in-kernel last-arriver merge), so each record lists them under ``serves``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from prefixattn.autotune.config_space import (MODEL_SWITCHES, AttentionConfig, LaunchOptions, MergeConfig, block_d,
                                              fp8_block_n, mla_class_tiles, packed_kv_heads, part_registers)
from prefixattn.autotune.builds import HOPPER_STAGES, hopper_num_warps, hopper_refusal
from prefixattn.autotune.targets import Target, writes_own_l2_fences
from prefixattn.kernels.layout import page_size_constexpr
from prefixattn.tuning.launch_limits import DECODE_SUFFIX_MAX_REGS, required_pipeline_depth

FUSED_KERNEL = "prefixattn.kernels.prefix_attention_kernel:prefix_attention_kernel"
MERGE_PAIR_KERNEL = "prefixattn.kernels.merge_states:merge_state_pair_kernel"
MERGE_N_KERNEL = "prefixattn.kernels.merge_states:merge_states_kernel"
MLA_KERNEL = "prefixattn.kernels.mla_attention_kernel:mla_attention_kernel"
HOPPER_KERNEL = "prefixattn.kernels.hopper_attention_kernel:hopper_attention_kernel"

#: Representative launch: 32 query heads over 8 KV heads (GQA 4, Llama-3-8B / Mistral-7B), 16-token KV blocks.
#: GQA 4 keeps ``group`` an ordinary int (an MHA launch with group 1 compiles a second binary with group = 1).
NUM_QO_HEADS = 32
NUM_KV_HEADS = 8
BLOCK_SIZE = 16
#: A block-table row length that is not a multiple of 16: no divisibility hint, as at run time (the kernel does not
#: specialize its row stride, UNSPECIALIZED_ARGS).
MAX_BLOCKS = 129
#: Merge states per token in the n-way merge (its loop bound; any value above 1 gives the same code).
NUM_STATES = 3
#: Tensors that can exceed 2 GiB (the paged KV caches): no 32-bit buffer-offset hint for them on HIP.
_LARGE_TENSORS = ("k_cache_ptr", "v_cache_ptr")
#: Alignment Triton checks for its divisibility hint.
_ALIGN = 16
#: Representative feature values: Gemma 2's attention soft cap (50) and Mistral's 4096-token window (W = S - 1).
REPRESENTATIVE_SOFT_CAP = 50.0
REPRESENTATIVE_WINDOW_LEFT = 4095
#: The kernel's feature switches (a model's soft cap, window and sinks, fp8 K/V scales, the NaN guard), all off in
#: the default variants.
FEATURE_SWITCHES = ("HAS_SOFT_CAP", "HAS_WINDOW", "HAS_SINKS", "HAS_KV_SCALE", "USE_NAN_GUARD")
#: Triton's names of the fp8 KV-cache element types: torch.float8_e4m3fn and torch.float8_e5m2.
FP8_KV_TYPES = ("fp8e4nv", "fp8e5")
#: Triton compiles fp8e4nv (OCP e4m3) for NVIDIA from sm_89 on; sm_80 takes only e5m2 ("type fp8e4nv not supported
#: in this architecture", Triton 3.9), which prefixattn.attention() refuses there with a ValueError.
FP8_E4M3_MIN_CUDA_ARCH = 89
#: Starts the part of a fused job's variant name that a launch rule added (``config_space``'s ``for_kv`` warps,
#: stages and register cap; ``fp8_block_n``'s KV tile): such a binary's failure is the rule's, not its table config's
#: (:func:`prefixattn.tuning.compile_check.exclusions_from_report`).
RULE_MARK = "@"


def fp8_kv_types(target: Target) -> tuple:
    """The fp8 KV element types ``target`` compiles (Triton names)."""
    if not target.is_hip and int(target.arch) < FP8_E4M3_MIN_CUDA_ARCH:
        return FP8_KV_TYPES[1:]
    return FP8_KV_TYPES


@dataclass(frozen=True)
class CompileJob:
    """Everything a worker process needs to compile one binary (plain data, so it pickles)."""

    kernel: str  # short name: "prefix_attention", "merge_state_pair", "merge_states"
    variant: str  # "decode", "chunked_prefill" (+ "+lse"), "pair", "n_way"
    dtype: str
    head_dim: int
    target: str
    config_name: str
    config: dict
    fn: str  # "module:attribute"
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    default: bool = True
    #: (M, K, N) of the dots that belong to the shared-node part (empty: no shared part)
    shared_dots: tuple = ()
    serves: tuple = field(default_factory=tuple)
    #: whether the shared part must issue matrix instructions for the check to pass
    require_matrix: bool = False
    #: K/V tiles in flight the compiled KV loops must keep (0: reported, not required)
    min_pipeline_depth: int = 0
    #: registers per thread the binary may use at most (0: no bound; the decode suffix-only budget on NVIDIA)
    max_registers: int = 0
    #: a Hopper build: its PTX must hold TMA loads, warpgroup MMAs and setmaxnreg (warp specialization)
    require_hopper: bool = False
    #: a launch chained by PDL: its PTX must signal its dependents and wait for the launch before it (griddepcontrol)
    require_pdl: bool = False


def _specialize(name: str, value, dtype: str | None, target: Target):
    """(signature type, constexpr value or None, attrs) of one argument, as a launch would specialize it."""
    if dtype is not None:  # pointer
        attrs = [["tt.divisibility", _ALIGN]]
        if target.is_hip and name not in _LARGE_TENSORS:
            attrs.append(["tt.pointer_range", 32])
        return f"*{dtype}", None, attrs
    if isinstance(value, float):
        return "fp32", None, []
    if value == 1:
        return "constexpr", 1, []
    return "i32", None, ([["tt.divisibility", _ALIGN]] if value % _ALIGN == 0 else [])


def build_signature(param_names, pointer_dtypes: dict, values: dict, constexprs: dict, target: Target):
    """Signature, constexprs and attrs for ``triton.compile(ASTSource(...))`` from a representative launch."""
    signature, consts, attrs = {}, {}, {}
    for i, name in enumerate(param_names):
        if name in constexprs:
            signature[name] = "constexpr"
            consts[name] = constexprs[name]
            continue
        if name.endswith("_ptr"):
            if name not in pointer_dtypes:
                raise ValueError(f"compile spec: no element type for pointer argument {name!r}")
            ty, const, a = _specialize(name, None, pointer_dtypes[name], target)
        else:
            if name not in values:
                raise ValueError(f"compile spec: no representative value for argument {name!r}")
            ty, const, a = _specialize(name, values[name], None, target)
        signature[name] = ty
        if const is not None:
            consts[name] = const
        if a:
            attrs[(i,)] = a
    return signature, consts, attrs


def _contiguous_strides(shape) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return list(reversed(strides))


def fused_launch_values(head_dim: int, v_head_dim: int | None = None) -> dict:
    """Run-time scalar arguments of a representative fused launch (contiguous tensors; V and the output of
    ``v_head_dim``, default ``head_dim``)."""
    h, hkv, d, dv = NUM_QO_HEADS, NUM_KV_HEADS, head_dim, v_head_dim or head_dim
    q, o = _contiguous_strides([64, h, d]), _contiguous_strides([64, h, dv])
    lse = _contiguous_strides([64, h])
    k, v = _contiguous_strides([1000, BLOCK_SIZE, hkv, d]), _contiguous_strides([1000, BLOCK_SIZE, hkv, dv])
    return dict(
        num_kv_heads=hkv, group=h // hkv, head_dim=d, v_head_dim=dv, block_size=BLOCK_SIZE, qk_scale=0.125,
        stride_o_t=o[0], stride_o_h=o[1], stride_o_d=o[2], stride_lse_t=lse[0], stride_lse_h=lse[1],
        stride_ws_t=o[0], stride_ws_h=o[1], stride_ws_d=o[2], stride_wl_t=lse[0], stride_wl_h=lse[1],
        stride_q_t=q[0], stride_q_h=q[1], stride_q_d=q[2],
        stride_k_blk=k[0], stride_k_tok=k[1], stride_k_head=k[2], stride_k_d=k[3],
        stride_v_blk=v[0], stride_v_tok=v[1], stride_v_head=v[2], stride_v_d=v[3],
        stride_bt_r=MAX_BLOCKS,
        # Feature scalars (read only behind their switches): a Gemma-2-like cap, a Mistral-like window (4096 - 1).
        soft_cap_log2=REPRESENTATIVE_SOFT_CAP * 1.4426950408889634, window_left=REPRESENTATIVE_WINDOW_LEFT,
        v_scale=1.0,
    )


def fused_pointer_dtypes(dtype: str, kv_dtype: str | None = None) -> dict:
    kv = kv_dtype or dtype
    return {"out_ptr": dtype, "q_ptr": dtype, "k_cache_ptr": kv, "v_cache_ptr": kv,
            "lse_ptr": "fp32", "ws_o_ptr": "fp32", "ws_lse_ptr": "fp32",
            "sinks_ptr": "fp32", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32",
            "counters_ptr": "i32", "item_range_ptr": "i32", "items_ptr": "i32", "gather_ptr": "i32",
            "mrows_ptr": "i32", "block_table_ptr": "i32"}


def _param_names(fn_path: str) -> list[str]:
    import importlib

    module, attr = fn_path.split(":")
    return list(getattr(importlib.import_module(module), attr).arg_names)


def fused_job(*, target: Target, dtype: str, head_dim: int, config: AttentionConfig, variant: str,
              has_lse: bool, has_shared: bool = True, default: bool = True, param_names=None,
              features: tuple = (), kv_dtype: str | None = None, v_head_dim: int | None = None,
              pdl: bool = False) -> CompileJob:
    """The fused kernel's binary of one work class with ``config`` (``param_names``: the kernel's arguments;
    imported when not given).

    ``has_shared=True``: the shared class (``config.shared`` tiles under ``config.launch``); False: a suffix class
    (``config.suffix`` under ``config.suffix_launch``; the decode class of a decode config, the chunk class of a
    chunked-prefill one). ``features``: feature switches to turn on (of :data:`FEATURE_SWITCHES`); ``kv_dtype``: the
    K/V cache element type when it differs from ``dtype`` (fp8); ``v_head_dim``: V's head size where it differs
    from ``head_dim`` (``config`` is then the tiles of the wider one, as a plan picks them); ``pdl``: the binary of a
    launch chained by programmatic dependent launch (``USE_PDL``, launched with ``launch_pdl``:
    :mod:`prefixattn.autotune.pdl`).
    """
    bd = block_d(head_dim)
    own_v = v_head_dim is not None and v_head_dim != head_dim
    bdv = block_d(v_head_dim) if own_v else bd
    bd_tiles = max(bd, bdv)  # the tiles' head size (planner.tiles.tile_head_dim): what the launch rules read
    names = param_names if param_names is not None else _param_names(FUSED_KERNEL)
    use_fp32_dot = dtype == "fp32"  # what plan() sets on a GPU: fp32 inputs keep IEEE fp32 dots
    tiles = config.shared if has_shared else config.suffix
    kv_fp8 = kv_dtype in FP8_KV_TYPES
    nan_guard = "USE_NAN_GUARD" in features
    model_switches = any(f in features for f in MODEL_SWITCHES)
    block_n = fp8_block_n(tiles.block_m, tiles.block_n, kv_fp8=kv_fp8, block_d=bd_tiles, has_shared=has_shared,
                          is_hip=target.is_hip, nan_guard=nan_guard, model_switches=model_switches)
    # KV heads per program as a plan fits and launches them (the config's suffix tile read as a decode tile; a
    # narrower fp8 KV tile holds fewer: AttentionTiles.launch_options).
    heads = 1 if has_shared else min(packed_kv_heads(tiles.kv_heads, block_d=bd_tiles, nan_guard=nan_guard),
                                     block_n)
    constexprs = dict(IS_SHARED=has_shared, HAS_LSE=has_lse, USE_FP32_DOT=use_fp32_dot, IS_HIP=target.is_hip,
                      USE_L2_FENCES=writes_own_l2_fences(target.arch), USE_PDL=pdl,
                      PAGE_SIZE=page_size_constexpr(BLOCK_SIZE),
                      KV_HEADS=heads, BLOCK_M=tiles.block_m, BLOCK_N=block_n // heads, BLOCK_D=bd,
                      HAS_V_HEAD_DIM=own_v, BLOCK_DV=bdv)
    for switch in FEATURE_SWITCHES:
        if switch in names:
            constexprs[switch] = switch in features
        elif switch in features:
            raise ValueError(f"fused_job: the kernel has no {switch} switch")
    sig, consts, attrs = build_signature(names, fused_pointer_dtypes(dtype, kv_dtype),
                                         fused_launch_values(head_dim, v_head_dim), constexprs, target)
    bm, bn = config.shared.block_m, block_n
    launch = config.launch_for(has_shared).for_kv(has_shared=has_shared, kv_fp8=kv_fp8, is_hip=target.is_hip,
                                                  block_d=bd_tiles, block_m=tiles.block_m, block_n=tiles.block_n,
                                                  nan_guard=nan_guard, q_fp32=dtype == "fp32",
                                                  model_switches=model_switches)
    name = (variant + ("" if has_shared else "/suffix-only") + ("+lse" if has_lse else "")
            + "".join("+" + f.split("_", 1)[1].lower() for f in FEATURE_SWITCHES if f in features)
            + (f"+{kv_dtype}" if kv_dtype else "") + (f"+v{v_head_dim}" if own_v else "")
            + (f"{RULE_MARK}w{launch.num_warps}s{launch.num_stages}" if launch != config.launch_for(has_shared)
               else "")
            + (f"r{launch.maxnreg}" if launch.maxnreg else "")
            + (f"{RULE_MARK}n{block_n}" if block_n != tiles.block_n else "")  # the fp8 and NaN-guard rules
            + ("+pdl" if pdl else ""))
    serves = (variant, "split_k", "in-kernel merge") if has_shared else (variant + " without shared nodes", "split_k")
    options = {**launch.compile_options(target), **({"launch_pdl": True} if pdl else {})}
    return CompileJob(
        kernel="prefix_attention", variant=name, dtype=dtype, head_dim=head_dim,
        target=target.name, config_name=config.short(), config=config.to_dict(), fn=FUSED_KERNEL, signature=sig,
        constexprs=consts, attrs=attrs, options=options, default=default, require_pdl=pdl,
        shared_dots=((bm, bd, bn), (bm, bn, bdv)) if has_shared else (), serves=serves,
        # IEEE fp32 dots have no tensor-core path on NVIDIA (tf32 would break the fp32 tolerance): CUDA cores there.
        require_matrix=has_shared and (dtype != "fp32" or target.is_hip),
        min_pipeline_depth=required_pipeline_depth(target),
        # The 128-register budget belongs to the tables' 16-bit decode rows without features (the table builder's
        # estimate places those); fp8 K/V launches run at more warps.
        max_registers=(0 if has_shared or variant != "decode" or kv_dtype or features
                       else decode_suffix_register_budget(target, dtype, head_dim, config)),
    )


def decode_suffix_register_budget(target: Target, dtype: str, head_dim: int, config: AttentionConfig) -> int:
    """Registers a decode-shaped suffix-only binary may use (``DECODE_SUFFIX_MAX_REGS`` of
    :mod:`~prefixattn.tuning.launch_limits`, so several programs share an SM): the shipped-table builder's budget where
    it placed the config's suffix launch under it (NVIDIA; its estimate), else 0 (no bound: fp32 and large heads on FMA
    dots do not fit it)."""
    lo = config.launch_for(False)
    if target.is_hip or part_registers(config.suffix, head_dim, dtype, lo.num_warps, target) > DECODE_SUFFIX_MAX_REGS:
        return 0
    return DECODE_SUFFIX_MAX_REGS


#: The switches that do not touch the K/V element type (every dtype compiles them): the model's and the NaN guard.
NON_FP8_FEATURES = MODEL_SWITCHES + ("USE_NAN_GUARD",)


def feature_specs(target: Target, dtype: str, *, worst_case_only: bool = False) -> list[tuple]:
    """``(features, kv_dtype)`` of the feature variants a binary is checked with: every non-fp8 switch (the model's
    and the NaN guard); fp8 K/V with scales, each fp8 type the target compiles; every model switch over an fp8 cache
    (a Gemma-2-like model on an fp8 cache); and every switch, the NaN guard's too, over each fp8 type
    (``plan(nan_guard=True)``, a debugging mode, on an fp8 cache). ``worst_case_only`` (CI's selection): every
    model switch over a 16-bit cache, and each fp8 type alone and under every model switch (more switches do not
    always mean more registers: sm_90, head_dim 256, 32 x 32 decode tiles at 8 warps spilled over a plain fp8 cache
    and not under the model switches, Triton 3.9); CI adds :func:`guarded_fp8_specs` for suffix-only binaries. fp32
    inputs get only the non-fp8 switches (no engine pairs an fp32 model with an fp8 cache)."""
    if dtype == "fp32":
        return [(NON_FP8_FEATURES, None)]
    kinds = fp8_kv_types(target)
    with_model = [(MODEL_SWITCHES + ("HAS_KV_SCALE",), kind) for kind in kinds]
    if worst_case_only:
        return [(MODEL_SWITCHES, None)] + [(("HAS_KV_SCALE",), kind) for kind in kinds] + with_model
    return ([(NON_FP8_FEATURES, None)] + [(("HAS_KV_SCALE",), kind) for kind in kinds] + with_model[:1]
            + guarded_fp8_specs(target))


def guarded_fp8_specs(target: Target) -> list[tuple]:
    """``(features, kv_dtype)``: every switch, the NaN guard's too, over each fp8 type the target compiles: the most
    a suffix-only binary holds (the guard compiles to nothing in a launch with shared items)."""
    return [(NON_FP8_FEATURES + ("HAS_KV_SCALE",), kind) for kind in fp8_kv_types(target)]


def feature_jobs(*, target: Target, dtype: str, head_dim: int, config: AttentionConfig, variant: str,
                 has_shared: bool, specs=None, param_names=None, default: bool = True) -> list[CompileJob]:
    """The feature variants (:func:`feature_specs`, or ``specs``) of one work class's binary (``config``,
    ``variant``, ``has_shared`` as in :func:`fused_job`), all with LSE. Empty for a kernel without the switches."""
    names = param_names if param_names is not None else _param_names(FUSED_KERNEL)
    if not all(f in names for f in FEATURE_SWITCHES):
        return []
    specs = feature_specs(target, dtype) if specs is None else specs
    return [fused_job(target=target, dtype=dtype, head_dim=head_dim, config=config, variant=variant, has_lse=True,
                      has_shared=has_shared, default=default, param_names=names, features=features,
                      kv_dtype=kv_dtype)
            for features, kv_dtype in specs]


def merge_jobs(*, target: Target, dtype: str, head_dim: int, config: MergeConfig, default: bool = True,
               param_names: dict | None = None) -> list[CompileJob]:
    """Both merge kernels with ``config`` (states ``[tokens, (states,) heads, head_dim]``, fp32 LSEs)."""
    bd = block_d(head_dim)
    h = NUM_QO_HEADS
    v3, s2 = _contiguous_strides([64, h, head_dim]), _contiguous_strides([64, h])
    v4, s3 = _contiguous_strides([64, NUM_STATES, h, head_dim]), _contiguous_strides([64, NUM_STATES, h])
    constexprs = {"BLOCK_H": config.block_h, "BLOCK_D": bd}
    options = {"num_warps": config.num_warps}
    jobs = []
    pair_values = dict(num_heads=h, head_dim=head_dim,
                       stride_vo_t=v3[0], stride_vo_h=v3[1], stride_vo_d=v3[2], stride_so_t=s2[0], stride_so_h=s2[1],
                       stride_va_t=v3[0], stride_va_h=v3[1], stride_va_d=v3[2], stride_sa_t=s2[0], stride_sa_h=s2[1],
                       stride_vb_t=v3[0], stride_vb_h=v3[1], stride_vb_d=v3[2], stride_sb_t=s2[0], stride_sb_h=s2[1])
    pair_ptrs = {"v_out_ptr": dtype, "s_out_ptr": "fp32", "v_a_ptr": dtype, "s_a_ptr": "fp32",
                 "v_b_ptr": dtype, "s_b_ptr": "fp32"}
    n_values = dict(num_states=NUM_STATES, num_heads=h, head_dim=head_dim,
                    stride_vo_t=v3[0], stride_vo_h=v3[1], stride_vo_d=v3[2], stride_so_t=s2[0], stride_so_h=s2[1],
                    stride_v_t=v4[0], stride_v_n=v4[1], stride_v_h=v4[2], stride_v_d=v4[3],
                    stride_s_t=s3[0], stride_s_n=s3[1], stride_s_h=s3[2])
    n_ptrs = {"v_out_ptr": dtype, "s_out_ptr": "fp32", "v_ptr": dtype, "s_ptr": "fp32"}
    for kernel, fn, variant, values, ptrs in (
            ("merge_state_pair", MERGE_PAIR_KERNEL, "pair", pair_values, pair_ptrs),
            ("merge_states", MERGE_N_KERNEL, "n_way", n_values, n_ptrs)):
        names = (param_names or {}).get(fn) or _param_names(fn)
        sig, consts, attrs = build_signature(names, ptrs, values, constexprs, target)
        jobs.append(CompileJob(kernel=kernel, variant=variant, dtype=dtype, head_dim=head_dim, target=target.name,
                               config_name=f"h{config.block_h}_w{config.num_warps}", config=config.to_dict(), fn=fn,
                               signature=sig, constexprs=consts, attrs=attrs, options=options, default=default,
                               serves=("split_k merge", "cascade merge")))
    return jobs


#: Representative MLA launch: DeepSeek-V3 (kv_lora_rank 512, rope 64) at its 128 query heads (data-parallel
#: attention: 8 head blocks of 16), vLLM's 64-token MLA cache blocks.
MLA_NUM_HEADS = 128
MLA_HEADS_PER_PROGRAM = 16
MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64
MLA_BLOCK_SIZE = 64
#: The MLA kernel's rotary lanes at MLA_ROPE_DIM (a power of two, at least the smallest dot).
MLA_BLOCK_R = 64


def mla_jobs(*, target: Target, dtype: str, kv_dtype: str | None = None, param_names=None) -> list[CompileJob]:
    """The MLA kernel's three class binaries (shared, chunk, decode: ``config_space.mla_class_tiles``) for the
    representative launch, with LSE; ``kv_dtype``: an fp8 latent cache (with its scale)."""
    names = param_names if param_names is not None else _param_names(MLA_KERNEL)
    d, width = MLA_KV_LORA_RANK, MLA_KV_LORA_RANK + MLA_ROPE_DIM
    q = _contiguous_strides([64, MLA_NUM_HEADS, width])
    o = _contiguous_strides([64, MLA_NUM_HEADS, d])
    lse = _contiguous_strides([64, MLA_NUM_HEADS])
    kv = _contiguous_strides([1000, MLA_BLOCK_SIZE, width])
    values = dict(num_head_blocks=MLA_NUM_HEADS // MLA_HEADS_PER_PROGRAM, group=MLA_HEADS_PER_PROGRAM,
                  kv_lora_rank=d, rope_dim=MLA_ROPE_DIM, block_size=MLA_BLOCK_SIZE, qk_scale=0.1, kv_scale=1.0,
                  stride_o_t=o[0], stride_o_h=o[1], stride_o_d=o[2], stride_lse_t=lse[0], stride_lse_h=lse[1],
                  stride_ws_t=o[0], stride_ws_h=o[1], stride_ws_d=o[2], stride_wl_t=lse[0], stride_wl_h=lse[1],
                  stride_q_t=q[0], stride_q_h=q[1], stride_q_d=q[2],
                  stride_kv_blk=kv[0], stride_kv_tok=kv[1], stride_kv_d=kv[2], stride_bt_r=MAX_BLOCKS)
    kv_type = kv_dtype or dtype
    pointers = {"out_ptr": dtype, "q_ptr": dtype, "kv_cache_ptr": kv_type, "lse_ptr": "fp32", "ws_o_ptr": "fp32",
                "ws_lse_ptr": "fp32", "kv_scale_ptr": "fp32", "counters_ptr": "i32", "item_range_ptr": "i32",
                "items_ptr": "i32", "gather_ptr": "i32", "mrows_ptr": "i32", "block_table_ptr": "i32"}
    decode, chunk, shared = mla_class_tiles(fp32=dtype == "fp32", kv_fp8=kv_dtype is not None, is_hip=target.is_hip)
    jobs = []
    for variant, tile, has_shared in (("shared", shared, True), ("chunk", chunk, False), ("decode", decode, False)):
        block_m, block_n, warps, stages = tile
        constexprs = dict(IS_SHARED=has_shared, HAS_LSE=True, HAS_KV_SCALE=kv_dtype is not None,
                          USE_FP32_DOT=dtype == "fp32", IS_HIP=target.is_hip,
                          USE_L2_FENCES=writes_own_l2_fences(target.arch),
                          PAGE_SIZE=page_size_constexpr(MLA_BLOCK_SIZE), BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_C=block_d(d), BLOCK_R=MLA_BLOCK_R)
        sig, consts, attrs = build_signature(names, pointers, values, constexprs, target)
        launch = LaunchOptions(num_warps=warps, num_stages=stages)
        jobs.append(CompileJob(
            kernel="mla_attention", variant=variant + "+lse" + (f"+{kv_dtype}" if kv_dtype else ""), dtype=dtype,
            head_dim=d, target=target.name, config_name=f"{block_m}x{block_n}_w{warps}_s{stages}",
            config={"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}, fn=MLA_KERNEL,
            signature=sig, constexprs=consts, attrs=attrs, options=launch.compile_options(target),
            shared_dots=((block_m, block_d(d), block_n), (block_m, block_n, block_d(d))) if has_shared else (),
            serves=("mla " + variant, "split_k") + (("in-kernel merge",) if has_shared else ()),
            require_matrix=has_shared and (dtype != "fp32" or target.is_hip)))
    return jobs


def hopper_job(*, target: Target, dtype: str, head_dim: int, config: AttentionConfig, has_shared: bool,
               has_lse: bool, features: tuple = (), default: bool = True, param_names=None,
               strict: bool = True) -> CompileJob | None:
    """The Hopper build (:mod:`prefixattn.kernels.hopper_attention_kernel`) of a matrix class with ``config``'s tiles
    (``has_shared``: the shared class; else the chunk class of a chunked-prefill config): the portable binary's job
    (:func:`fused_job`: the same parameters, so the same signature) for the Gluon kernel, with its ``STAGES`` and its
    warps (:func:`~prefixattn.autotune.builds.hopper_num_warps`; Gluon schedules no software pipeline: no
    ``num_stages``). Where the build does not serve these shapes (:func:`prefixattn.autotune.builds.hopper_refusal`):
    ValueError, or None when not ``strict``."""
    work_class = "shared" if has_shared else "chunk"
    fused_names = None if param_names is None else [n for n in param_names if n != "STAGES"]
    base = fused_job(target=target, dtype=dtype, head_dim=head_dim, config=config, variant=f"hopper-{work_class}",
                     has_lse=has_lse, has_shared=has_shared, default=default, param_names=fused_names,
                     features=features)
    refusal = hopper_refusal(work_class, is_hip=target.is_hip, arch=target.arch, dtype=dtype, kv_dtype=None,
                             head_dim=head_dim, v_head_dim=None, block_size=BLOCK_SIZE,
                             block_m=base.constexprs["BLOCK_M"], block_n=base.constexprs["BLOCK_N"],
                             kv_heads=base.constexprs["KV_HEADS"], features=features)
    if refusal is not None and not strict:
        return None
    if refusal is not None:
        raise ValueError(f"hopper_job: the Hopper build serves {refusal}")
    return replace(base, kernel="hopper", fn=HOPPER_KERNEL, variant=base.variant.replace("/suffix-only", ""),
                   signature={**base.signature, "STAGES": "constexpr"},
                   constexprs={**base.constexprs, "STAGES": HOPPER_STAGES},
                   options={"num_warps": hopper_num_warps(base.constexprs["BLOCK_M"])}, min_pipeline_depth=0,
                   require_hopper=True,
                   serves=(f"{work_class} class, sm_90 build", "split_k", "in-kernel merge"))
