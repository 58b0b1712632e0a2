"""Programmatic dependent launch of a step's class launches (prefixattn/autotune/pdl.py: the one decision, in
Plan.stats) and how the launches are chained (launcher.chained_by_pdl). Grid dependency control needs an sm_90 GPU:
here the launches go to a recording stand-in; tests/tuning/test_pdl_binary.py compiles the binaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixattn import PrefixSharedAttention, attention, launcher, plan, plan_mla, prefix_attention
from prefixattn.autotune import pdl
from prefixattn.autotune.builds import HOPPER, asking_for
from prefixattn.autotune.lookup import planning_target
from prefixattn.autotune.pdl import PDL_ENV, asking_for_pdl, pdl_choice, pdl_refusal
from prefixattn.kernels import hopper_attention_kernel as hopper_module
from prefixattn.kernels.layout import CLASS_CHUNK, CLASS_DECODE, CLASS_SHARED
from prefixattn.planner import plans
from prefixattn.planner.stats import chained_us, modeled_step_us
from tests.test_hopper_build import _batch, _Jit
from tests.test_overlap import short_shared_step


def test_off_by_default_and_says_how_to_ask():
    b = _batch(torch.bfloat16)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always")
    assert p.pdl is False and p.stats["pdl"] is False and f"{PDL_ENV}=1" in p.stats["pdl_why"]


def test_asked_for_in_the_interpreter_stays_off_and_says_why():
    b = _batch(torch.bfloat16)
    with asking_for_pdl(True):
        p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always")
    assert p.pdl is False and "interpreter" in p.stats["pdl_why"]


@pytest.mark.parametrize("is_hip, arch, on", [(False, 90, True), (False, 100, True), (False, 80, False),
                                              (True, "gfx942", False), (False, None, False)])
def test_served_on_nvidia_sm90_and_newer(is_hip, arch, on):
    assert (pdl_refusal(is_hip=is_hip, arch=arch, interpreted=False) is None) == on
    got, why = pdl_choice(True, is_hip=is_hip, arch=arch, interpreted=False)
    assert got == on and (("asked for" in why) if on else (f"sm_{pdl.PDL_MIN_ARCH}" in why))
    assert pdl_choice(False, is_hip=is_hip, arch=arch, interpreted=False)[0] is False


def test_the_environment_asks_once_and_refuses_what_it_does_not_know(monkeypatch):
    monkeypatch.setattr(pdl._switch, "_stack", [])
    monkeypatch.setenv(PDL_ENV, "yes")
    with pytest.raises(ValueError, match="PREFIXATTN_PDL: expected one of 0, 1, got 'yes'"):
        pdl.requested_pdl()
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl.requested_pdl() is True
    monkeypatch.setenv(PDL_ENV, "0")  # read once: a later change does not move it
    assert pdl.requested_pdl() is True
    with asking_for_pdl(False):
        assert pdl.requested_pdl() is False
    assert pdl.requested_pdl() is True
    with pytest.raises(ValueError, match="asking_for_pdl: expected one of False, True, got 1"):
        with asking_for_pdl(1):
            pass


@pytest.fixture
def on_sm90(monkeypatch):
    """Plans for an sm_90 device with compiled kernels, whose launches are recorded by stand-ins (the JIT path)."""
    log: list = []
    monkeypatch.setattr(plans, "_KERNELS_INTERPRETED", False)
    monkeypatch.setattr(plans, "_device_arch", lambda device: (False, 90))
    portable = _Jit(prefix_attention.prefix_attention_kernel, log)
    hopper = _Jit(hopper_module.hopper_attention_kernel, log)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", portable)
    monkeypatch.setattr(hopper_module, "hopper_attention_kernel", hopper)
    monkeypatch.setattr(launcher, "ALLOW_DIRECT", False)
    with asking_for_pdl(True):
        yield log, portable, hopper


def test_every_launch_after_the_first_is_its_predecessors_dependent(on_sm90):
    log, portable, _ = on_sm90
    b = _batch(torch.bfloat16)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always")
    assert p.pdl is True and p.work_classes == (CLASS_SHARED, CLASS_CHUNK, CLASS_DECODE), p.stats
    attention(b.q, b.k_cache, b.v_cache, p)
    assert [args["USE_PDL"] for _, args, _ in log] == [True] * 3  # each signals its dependents
    assert [options.get("launch_pdl", False) for options in portable.options] == [False, True, True]


def test_the_hopper_build_keeps_ordinary_launches(on_sm90):
    log, portable, hopper = on_sm90
    b = _batch(torch.bfloat16)
    with asking_for(HOPPER):
        p = plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16, sharing="always")
    assert p.pdl is True and p.shared_build == p.chunk_build == HOPPER
    attention(b.q, b.k_cache, b.v_cache, p)
    assert [(name, args["USE_PDL"]) for name, args, _ in log] == [
        ("hopper_attention_kernel", False), ("hopper_attention_kernel", False), ("prefix_attention_kernel", True)]
    assert all("launch_pdl" not in options for options in hopper.options)
    assert portable.options == [{**portable.options[0], "launch_pdl": True}]  # after a launch, whichever build


def test_a_side_streams_first_launch_starts_its_own_chain():
    per_class = [((4,), {"A": 1}, {"num_warps": 4}), ((4,), {"A": 2}, {"num_warps": 8}),
                 ((4,), {"A": 3}, {"num_warps": 4})]
    chained = launcher.chained_by_pdl(per_class, beside_from=2)
    assert [options.get("launch_pdl", False) for _, _, options in chained] == [False, True, False]
    assert [options.get("launch_pdl", False) for _, _, options in launcher.chained_by_pdl(per_class)] == \
        [False, True, True]
    assert per_class[1][2] == {"num_warps": 8}  # not changed in place


def test_mla_plans_stay_in_series(on_sm90):
    qo, lens, table = torch.tensor([0, 1, 2]), torch.tensor([40, 40]), torch.tensor([[0, 1, 2], [0, 1, 3]])
    p = plan_mla(qo, lens, table, block_size=16, num_heads=16, sm_scale=0.1, q_dtype=torch.bfloat16)
    assert p.pdl is False and "MLA" in p.stats["pdl_why"]


def test_a_wrappers_run_chains_its_launches_as_attention_does(on_sm90):
    log, portable, _ = on_sm90
    b = _batch(torch.bfloat16)
    attn = PrefixSharedAttention(**b.heads, q_dtype=torch.bfloat16, max_tokens=64, max_requests=4,
                                 max_blocks_per_request=8, sharing="always")
    p = attn.plan(*b.metadata)
    assert p.pdl is True and len(p.work_classes) == 3
    attn.run(b.q, b.k_cache, b.v_cache)
    assert [args["USE_PDL"] for _, args, _ in log] == [True] * 3
    assert [options.get("launch_pdl", False) for options in portable.options] == [False, True, True]


def test_the_chained_step_is_the_spread_or_a_class_after_the_ones_before_it():
    """chained_us (modeled): no gap between launches; each class starts as the ones before it leave the slots."""
    modeled = np.array([[10.0, 6.0], [0.0, 0.0], [30.0, 25.0]])  # (makespan, ideal): shared, chunk, decode
    assert chained_us(modeled, (4, 4, 20)) == 36.0  # the shared programs' share, then the decode makespan
    assert chained_us(np.array([[10.0, 6.0], [0.0, 0.0], [3.0, 2.0]]), (4, 4, 20)) == 10.0  # the shared makespan
    assert chained_us(np.array([[0.0, 0.0], [0.0, 0.0], [30.0, 25.0]]), (0, 0, 9)) == 30.0  # one launch: its span
    assert chained_us(np.array([[9.0, 9.0], [8.0, 8.0], [7.0, 7.0]]), (1, 2, 3)) == 24.0  # full waves: their sum
    assert modeled_step_us(modeled, (4, 4, 20)) == 42.0  # in series: both makespans and a gap


def test_candidates_are_priced_chained(on_sm90):
    """tests/test_overlap.py's short step (sm90 prices): in series the shared launch costs more than it saves and the
    step runs unshared; chained to the decode launch it costs its programs' share of the slots, so a chained plan
    keeps the node (modeled)."""
    metadata, options = short_shared_step()
    with planning_target("sm90"):
        chained = plan(*metadata, **options)
        with asking_for_pdl(False):
            serial = plan(*metadata, **options)
            never = plan(*metadata, **options, sharing="never")
    assert serial.stats["sharing_declined"] and not serial.shared_nodes and "modeled_pdl_us" not in serial.stats
    assert chained.pdl and not chained.stats["sharing_declined"] and len(chained.shared_nodes) == 1
    assert chained.stats["modeled_pdl_us"] < never.stats["modeled_step_us"] < chained.stats["modeled_step_us"]
