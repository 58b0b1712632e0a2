"""MODELED (not measured) kernel time of the full-size Fig. 8 steps on H100 / A100 / MI300X (issue 14's evidence):
the fused launch today ("after"), the kernel issue 14 read ("before": the same model with one K/V tile in flight,
the program-count split, serial merge reports and the tables of that time) and a three-launch cascade over the same
work, next to the roofline floor. Host only (plan() at full size, no kernel launch): ~15 s for the three targets.

Every number is the latency-aware model of prefixattn.autotune.cost_model (bench/kernel_time.py); no GPU ran any
of it. Rows say ``device=<gpu> (modeled)`` and ``unit=us (modeled)``. Benchmarks report: nothing here asserts a time.
"""

from __future__ import annotations

import pytest

from prefixattn.autotune.config_space import AttentionConfig, LaunchOptions, Tiles, config_registers, part_registers
from prefixattn.autotune.targets import get_target

from kernel_time import TARGETS, model_shape, us
from shapes import Shape, fig8_shapes

BENCHMARK = "kernel_time_modeled"
#: Issue 14's headline step: 256 decodes under one 2,048-token prefix, Llama-3-8B heads (32:8), bf16, page 16. The
#: issue gives no own length (its ~13.6 MB of distinct KV is ~5 own tokens per request): one 16-token page each.
ISSUE_SHAPE = Shape(scenario="decode", num_decode=256, num_prefill=0, shared=2048, distinct=16, per_group=0,
                    num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", paper="issue14:256/2048/16")
SHAPES = fig8_shapes(scaled=False) + fig8_shapes(scaled=False, gqa=True) + [ISSUE_SHAPE]
#: The one-binary alternative for launches with shared items on sm90 (issue 14, occupancy): every program at 4
#: warps, shared tiles small enough for two programs per SM (compile-check on sm_90, bf16, head_dim 128: shared
#: 64x16 + suffix 16x32 at 4 warps, 3 stages: 209 registers, 0 spills, 2 programs per SM; no config with shared
#: tiles reaches <= 128 registers at 4 warps: 64x32 -> 240, 64x64 -> 248).
ONE_BINARY_4_WARPS = AttentionConfig(Tiles(64, 16), Tiles(16, 32), LaunchOptions(num_warps=4, num_stages=3),
                                     LaunchOptions(num_warps=4, num_stages=3))


def _label(shape) -> str:
    return f"{shape.paper}/h{shape.num_qo_heads}:{shape.num_kv_heads} [{shape.name}]"


@pytest.mark.parametrize("target", list(TARGETS))
def test_kernel_time_modeled(results, target):
    device = f"{TARGETS[target]} (modeled)"
    print(f"\n{TARGETS[target]} ({target}), MODELED microseconds (prefixattn.autotune.cost_model; nothing measured)")
    print(f"{'shape':34s} {'floor':>8s} {'after':>8s} {'before':>8s} {'cascade':>8s} {'MB/SM':>7s} "
          f"{'GFLOP/SM':>8s} {'rt crit':>7s} {'rt mean':>7s} {'crit us':>7s} {'occ':>3s}  config")
    for shape in SHAPES:
        m = model_shape(shape, target)
        a = m.after
        sms = get_target(target).num_sms
        label = _label(shape)
        print(f"{shape.paper + '/h' + str(shape.num_qo_heads) + ':' + str(shape.num_kv_heads):34s} "
              f"{us(m.floor):>8s} {us(a.seconds):>8s} {us(m.before.seconds):>8s} {us(m.cascade_seconds):>8s} "
              f"{a.bytes / sms / 1e6:7.2f} {a.flops / sms / 1e9:8.3f} {a.critical_round_trips:7.1f} "
              f"{a.mean_round_trips:7.1f} {us(a.critical_program):>7s} {a.occupancy:3d}  {m.config}")
        for metric, value in (("floor_us", m.floor), ("after_us", a.seconds), ("before_us", m.before.seconds),
                              ("cascade_us", m.cascade_seconds), ("critical_program_us", a.critical_program)):
            results.add(BENCHMARK, "prefixattn", label, metric, value * 1e6, "us (modeled)", device=device)
        for metric, value, unit in (("bytes_per_sm", a.bytes / sms, "bytes (modeled)"),
                                    ("flops_per_sm", a.flops / sms, "FLOPs (modeled)"),
                                    ("critical_round_trips", a.critical_round_trips, "round trips (modeled)"),
                                    ("mean_round_trips", a.mean_round_trips, "round trips (modeled)"),
                                    ("resident_programs_per_sm", a.occupancy, "programs (modeled)"),
                                    ("cascade_launches", len(m.cascade), "count")):
            results.add(BENCHMARK, "prefixattn", label, metric, value, unit, device=device)
    print("floor: max(distinct KV bytes / HBM, attention FLOPs / matrix peak), datasheet peaks. after: today's fused "
          "launch as planned. before: 1 tile in flight, program-count split, serial merge reports, the tables issue "
          "14 read. cascade: the same model over shared launch + suffix launch + merge launch. rt: dependent round "
          "trips per program (critical-path program, mean). occ: resident programs per SM.")


def test_occupancy_trade_off_sm90(results):
    """One binary per launch: with shared items every program takes the shared branch's registers. The shipped
    8-warp config (1 program per SM with shared items, 4 per SM in suffix-only launches) vs every program at 4 warps
    (2 per SM), modeled on the sm90 decode shapes with sharing."""
    target = get_target("sm90")
    print("\nH100 occupancy trade-off, MODELED microseconds (registers: the estimate the tuner uses; compile-check "
          "measures them)")
    for shape in [s for s in SHAPES if s.scenario == "decode" and s.shared]:
        shipped = model_shape(shape, "sm90")
        four = model_shape(shape, "sm90", config=ONE_BINARY_4_WARPS)
        row = []
        for name, m in (("shipped", shipped), ("4-warp", four)):
            row.append(f"{name} {m.config} {us(m.after.seconds)} us occ {m.after.occupancy}")
            results.add(BENCHMARK, name, _label(shape), "after_us", m.after.seconds * 1e6, "us (modeled)",
                        device="H100 (modeled)")
        print(f"{shape.paper + '/h' + str(shape.num_kv_heads):28s} " + " | ".join(row))
    regs = config_registers(ONE_BINARY_4_WARPS, 128, "bf16", target)
    print(f"4-warp one-binary estimate: ~{regs} registers with shared items; shipped suffix-only 16x32 at 4 warps: "
          f"~{part_registers(Tiles(16, 32), 128, 'bf16', 4, target)} (estimates; see README for compile-check numbers)")
