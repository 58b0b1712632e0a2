"""MODELED kernel time of full-size Fig. 8 steps (issue 14's evidence), host only: every number here is the
latency-aware model of :mod:`prefixattn.autotune.cost_model` applied to the work lists ``plan()`` builds for the
target (its shipped table, its SM count). Nothing runs a kernel; nothing here is measured.

Per shape and target, three modeled times next to the roofline floor (:func:`gpu_cases.floor_seconds` at the
datasheet peaks: every distinct KV byte once, or the attention FLOPs):

* ``after``: today's fused launch, as planned (critical-path split, vector merge reports, K/V tiles in flight from
  the table's ``num_stages``);
* ``before``: the kernel issue 14 read, by parameters of the same model (:data:`cost_model.BEFORE`: one tile in
  flight, the program-count split, serial merge reports) over the tables of that time (:data:`BEFORE_CONFIGS`);
* ``cascade``: the same model over a FlashInfer-style cascade of the same work (shared-prefix launch, suffix launch,
  merge launch; each with its own overhead and tail).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixattn import plan
from prefixattn.autotune import cost_model as cm
from prefixattn.autotune.config_space import AttentionConfig, LaunchOptions, Tiles
from prefixattn.autotune.lookup import fixed_config, planning_target
from prefixattn.autotune.targets import get_target
from prefixattn.planner import MIN_SPLIT_TOKENS

from gpu_cases import floor_seconds
from shapes import DTYPES, build_batch

#: The targets of the issue's evidence and the product each stands for.
TARGETS = {"sm90": "H100", "sm80": "A100", "gfx942": "MI300X"}
_TORCH_TO_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _cfg(shared, suffix, warps, stages, suffix_warps=None, suffix_stages=None) -> AttentionConfig:
    lo = LaunchOptions(num_warps=warps, num_stages=stages)
    sl = LaunchOptions(num_warps=suffix_warps or warps, num_stages=suffix_stages or stages)
    return AttentionConfig(Tiles(*shared), Tiles(*suffix), lo, sl)


#: The shipped head_dim-128 16-bit configs issue 14 was written against (main before 878deed: sm80/sm90 tables
#: before the latency-aware rebuild, the gfx942 table before this branch's): (decode, chunked prefill). The sm90
#: shared tiles are the "128 x 16" the issue names.
BEFORE_CONFIGS = {
    "sm90": (_cfg((128, 16), (16, 128), 8, 3), _cfg((128, 16), (128, 16), 8, 3)),
    "sm80": (_cfg((128, 16), (16, 64), 8, 3, 4, 3), _cfg((128, 16), (128, 16), 8, 3)),
    "gfx942": (_cfg((128, 64), (16, 64), 4, 2, 2, 2), _cfg((128, 64), (128, 64), 4, 2)),
}


@dataclass(frozen=True)
class ShapeModel:
    """Modeled times (seconds) of one shape on one target, and what they are made of."""

    floor: float
    floor_bound: str  # "memory" or "compute"
    after: cm.LaunchTime
    before: cm.LaunchTime
    cascade: list  # of cm.LaunchTime, one per launch
    config: str

    @property
    def cascade_seconds(self) -> float:
        return sum(launch.seconds for launch in self.cascade)


def _plan(batch, shape, target, num_sms, config=None):
    kwargs = dict(block_size=shape.block_size, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
                  head_dim=shape.head_dim, q_dtype=DTYPES[shape.dtype], num_blocks=batch.num_blocks, num_sms=num_sms)
    with planning_target(target.name):
        if config is None:
            return plan(batch.qo_indptr, batch.kv_lens, batch.block_table, **kwargs)
        with fixed_config(config):
            return plan(batch.qo_indptr, batch.kv_lens, batch.block_table, **kwargs)


def model_shape(shape, target_name: str, *, config: AttentionConfig | None = None) -> ShapeModel:
    """Plan ``shape`` for ``target_name`` (its table, or ``config``) and model it: after, before, cascade, floor."""
    target = get_target(target_name)
    batch = build_batch(shape, metadata_only=True)
    dtype = _TORCH_TO_DTYPE[shape.dtype]
    common = dict(head_dim=shape.head_dim, dtype=dtype, group=shape.num_qo_heads // shape.num_kv_heads,
                  num_kv_heads=shape.num_kv_heads)
    planned = _plan(batch, shape, target, target.num_sms, config)
    cfg = cm.config_from_tiles(planned.tiles)
    after = cm.launch_time(cm.ranges_from_plan(planned), cfg, target, **common)
    # num_sms=1: nothing is split (the fair share is the whole launch), the ranges the split rules start from.
    whole = cm.ranges_from_plan(_plan(batch, shape, target, 1, config))
    cascade = cm.cascade_time(whole, cfg, target, min_split_tokens=MIN_SPLIT_TOKENS, **common)
    decode_cfg, prefill_cfg = BEFORE_CONFIGS[target_name]
    old = decode_cfg if shape.num_prefill == 0 else prefill_cfg
    old_whole = cm.ranges_from_plan(_plan(batch, shape, target, 1, old))
    split = dict(block_n_shared=old.shared.block_n, block_n_suffix=old.suffix.block_n,
                 num_kv_heads=shape.num_kv_heads, num_sms=target.num_sms, min_split_tokens=MIN_SPLIT_TOKENS)
    before = cm.launch_time(cm.resplit(old_whole, cm.BEFORE.split, **split), old, target, structure=cm.BEFORE,
                            **common)
    peak = (target.fp32_tflops if dtype == "fp32" else target.matmul_tflops) * 1e12
    floor, bound = floor_seconds(batch, target.mem_bw_gbs * 1e9, peak)
    return ShapeModel(floor=floor, floor_bound=bound, after=after, before=before, cascade=cascade,
                      config=cfg.short())


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}" if math.isfinite(seconds) else "inf"
