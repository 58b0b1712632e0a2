"""``prefixattn warmup``: compile every kernel variant a model configuration will launch, before serving.

Prints one line per variant (status, seconds, what it is) after a summary line; ``--json`` prints the same as JSON.
``--dry-run`` (or ``--target NAME``, the tables of another GPU) only lists what would be compiled. ``--mla``: an
MLA model's variants of the MLA kernel (:func:`prefixattn.warmup_mla_kernels`). Without a GPU, or
under ``TRITON_INTERPRET=1``, there is nothing to compile: the variants are listed as skipped. Exit code 0 when
every variant compiled (or was listed), 1 when a variant failed, 2 for a bad argument or configuration.
"""

from __future__ import annotations

import argparse
import json
import sys

from prefixattn.cli.arg_types import positive_int
from prefixattn.kernels.layout import WORK_CLASSES
from prefixattn.validation import SUPPORTED_HEAD_DIMS, torch_dtype_name

HELP = "compile every kernel variant a model configuration uses (heads, head size, dtype, block size) before serving"
#: What ``--mla`` needs and what it does not take.
_MHA_ONLY = (("num_kv_heads", "--num-kv-heads"), ("head_dim", "--head-dim"), ("kv_write", "--kv-write"),
             ("layout", "--layout"), ("v_head_dim", "--v-head-dim"))

#: ``--dtype`` names.
_DTYPES = ("fp16", "bf16", "fp32")
#: ``--kv-dtype`` names: the model dtypes and the fp8 caches (``fp8`` is e4m3, as vLLM's ``--kv-cache-dtype fp8``).
_KV_DTYPES = _DTYPES + ("fp8", "fp8_e4m3", "fp8_e5m2")


def _parse_dtypes(text: str, allowed: tuple[str, ...]):
    import torch

    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes from {allowed}, got {text}")
    by_name = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn,
               "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    return list(dict.fromkeys(by_name[n] for n in names))


def dtype_list(text: str):
    """argparse type: comma-separated dtype names (fp16, bf16, fp32) -> torch dtypes."""
    return _parse_dtypes(text, _DTYPES)


def kv_dtype_list(text: str):
    """argparse type: comma-separated KV cache dtype names (a model dtype, fp8, fp8_e4m3, fp8_e5m2)."""
    return _parse_dtypes(text, _KV_DTYPES)


def add_arguments(parser) -> None:
    parser.add_argument("--num-qo-heads", type=positive_int, required=True, help="query heads per GPU (after TP)")
    parser.add_argument("--num-kv-heads", type=positive_int, default=None,
                        help="KV heads per GPU (after TP); required unless --mla")
    parser.add_argument("--head-dim", type=int, default=None, choices=SUPPORTED_HEAD_DIMS,
                        help="required unless --mla")
    parser.add_argument("--v-head-dim", type=int, default=None, choices=SUPPORTED_HEAD_DIMS,
                        help="V's head size where it differs from --head-dim (plan(v_head_dim=...))")
    parser.add_argument("--mla", action="store_true",
                        help="an MLA model (DeepSeek-V2/V3/R1, Kimi-K2): the MLA kernel's variants over a latent "
                             "cache of --kv-lora-rank + --rope-dim per token")
    parser.add_argument("--kv-lora-rank", type=positive_int, default=512, help="with --mla (default 512)")
    parser.add_argument("--rope-dim", type=positive_int, default=64, help="with --mla (default 64)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="KV cache block (page) size")
    parser.add_argument("--dtype", type=dtype_list, default=None, help="model dtypes, e.g. bf16 or fp16,bf16 "
                        "(default bf16)")
    parser.add_argument("--kv-dtype", type=kv_dtype_list, default=None,
                        help="KV cache dtypes, e.g. fp8 (= fp8_e4m3) or fp8_e5m2 for an fp8 cache (default: the "
                             "model dtypes); fp8 compiles the fp8-loading attention and quantizing K/V write binaries")
    parser.add_argument("--no-fp8-scales", action="store_true",
                        help="fp8 launches without per-tensor scales (SGLang without checkpoint scales); default: "
                             "with scale tensors, as vLLM passes them")
    parser.add_argument("--max-q-len", type=positive_int, default=None,
                        help="longest query chunk of a request in one step (the engine's chunked-prefill size; "
                             "default: every length the tile tables distinguish)")
    parser.add_argument("--lse", action="store_true", help="also the variants that return the LSE")
    parser.add_argument("--kv-write", action="store_true", help="also the K/V write kernel (prefixattn.write_kv)")
    parser.add_argument("--layout", choices=("contiguous", "vllm", "sglang"), default=None,
                        help="tensor layout to compile for: contiguous tensors (library use), or an engine's "
                             "(q/k/v slices of a fused projection; vllm: K and V halves of one cache)")
    parser.add_argument("--target", default=None,
                        help="list what this GPU target's tables select (e.g. sm90) instead of compiling here")
    parser.add_argument("--dry-run", action="store_true", help="list the variants, compile nothing")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _as_json(results, mode: str, planner: dict) -> str:
    rows = []
    for r in results:
        v = r.variant
        row = {"kernel": v.kernel, "dtype": torch_dtype_name(v.dtype), "block_size": v.block_size,
               "kv_dtype": torch_dtype_name(v.cache_dtype), "has_kv_scale": v.has_kv_scale,
               "work_class": WORK_CLASSES[v.work_class], "has_lse": v.has_lse}
        if v.kernel == "mla_attention":
            row.update(num_heads=v.num_heads, kv_lora_rank=v.kv_lora_rank, rope_dim=v.rope_dim)
        else:
            row.update(num_qo_heads=v.num_qo_heads, num_kv_heads=v.num_kv_heads, head_dim=v.head_dim,
                       v_head_dim=v.v_head_dim or v.head_dim, max_q_lens=list(v.max_q_lens))
        row.update(description=v.describe(), status=r.status, seconds=round(r.seconds, 3), error=r.error)
        if getattr(v, "config", None) is not None:
            row["config"] = v.config.to_dict()
        rows.append(row)
    return json.dumps({"mode": mode, "planner": planner, "variants": rows}, indent=1)


def _check_shape_arguments(args) -> str | None:
    """What is missing or out of place among the shape arguments (None: nothing)."""
    if args.mla:
        given = [flag for name, flag in _MHA_ONLY if getattr(args, name) not in (None, False)]
        return f"{given[0]}: not an MLA argument (--mla takes --num-qo-heads, --kv-lora-rank, --rope-dim)" \
            if given else None
    missing = [flag for name, flag in _MHA_ONLY[:2] if getattr(args, name) is None]
    return f"{missing[0]}: required (or --mla for an MLA model)" if missing else None


def run(args) -> int:
    import torch

    from prefixattn import mla_warmup as mw
    from prefixattn import warmup as w
    from prefixattn.autotune.targets import get_target

    problem = _check_shape_arguments(args)
    if problem:
        print(f"prefixattn warmup: {problem}", file=sys.stderr)
        return 2
    common = dict(block_size=args.block_size, dtypes=args.dtype or [torch.bfloat16],
                  max_q_len=args.max_q_len or w.MAX_DISTINCT_Q_LEN, with_lse=args.lse, kv_dtypes=args.kv_dtype,
                  fp8_kv_scales=(not args.no_fp8_scales,))
    if args.mla:
        config = dict(common, num_heads=args.num_qo_heads, kv_lora_rank=args.kv_lora_rank, rope_dim=args.rope_dim)
    else:
        config = dict(common, num_qo_heads=args.num_qo_heads, num_kv_heads=args.num_kv_heads,
                      head_dim=args.head_dim, kv_write=args.kv_write, v_head_dim=args.v_head_dim)
    try:
        if args.dry_run or args.target is not None:
            if args.mla:
                is_hip = get_target(args.target).is_hip if args.target is not None else None
                variants = mw.mla_kernel_variants(**config, is_hip=is_hip)
            else:
                variants = w.kernel_variants(**config, target=args.target if args.target is not None else "auto")
            why = f"listed for {args.target}" if args.target is not None else "dry run"
            report = w.WarmupReport([w.VariantResult(v, "listed", error=why) for v in variants], mode="listed")
        elif args.mla:
            report = mw.warmup_mla_kernels(**config)
        else:
            layout = {None: w.WarmupLayout(), "contiguous": w.WarmupLayout(), "vllm": w.VLLM_LAYOUT,
                      "sglang": w.SGLANG_LAYOUT}[args.layout]
            report = w.warmup_kernels(**config, layout=layout)
    except ValueError as e:
        print(f"prefixattn warmup: {e}", file=sys.stderr)
        return 2
    print(_as_json(report.results, report.mode, report.planner) if args.json else "\n".join(report.lines()))
    return 1 if report.failed else 0
