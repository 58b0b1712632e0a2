"""The GPU check's cases on the matrix classes' Hopper build (bench/gpu_check/correctness.py): they run in a child
process, and its report (one JSON line a case, its exit, a timeout) becomes the rows and the verdict the timing step
reads before it times ``prefixattn-hopper``. The child itself needs an sm_90 GPU; here it is a stand-in."""

import json
import re
import subprocess
import types

import pytest

from gpu_check import clock as step_clock
from gpu_check import correctness, timing


class Rows:
    def __init__(self):
        self.rows = []

    def add(self, benchmark, provider, shape, metric, value, unit):
        self.rows.append((benchmark, provider, shape, metric, value))


def _case(name, passed):
    return correctness.HOPPER_LINE + json.dumps(dict(case=name, seconds=1.0, passed=passed, max_abs_err=1e-3,
                                                     lse_max_abs_err=1e-4, bit_identical=True,
                                                     padding_untouched=True, work_items=3, shared_nodes=1))


@pytest.fixture
def child(monkeypatch):
    """The child's stand-in: ``child.reply`` is what subprocess.run returns (or raises)."""
    calls = types.SimpleNamespace(reply=None, cmd=None)

    def run(cmd, **kwargs):
        calls.cmd = cmd
        if isinstance(calls.reply, BaseException):
            raise calls.reply
        return calls.reply

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(step_clock, "DEADLINE", float("inf"))
    monkeypatch.setattr(correctness, "HOPPER_VERDICT", [])
    return calls


def _run(child_reply, child):
    child.reply = child_reply
    rows = Rows()
    correctness._hopper_cases(types.SimpleNamespace(dry_run=False), rows, step_clock.Clock("correctness", []), 4)
    return rows, correctness.HOPPER_VERDICT


def test_passed_cases_let_the_timing_step_time_it(child):
    out = "\n".join([_case("decode/bf16/d128", True), "[warn] noise", _case("mixed/fp16/d64", True)])
    rows, verdict = _run(subprocess.CompletedProcess([], 0, out, ""), child)
    assert child.cmd[-2:] == ["--hopper-cases", "4"]
    assert verdict == [True, "2 cases passed"]
    assert ("gpu_check_correctness", "prefixattn-hopper", "mixed/fp16/d64", "passed", 1.0) in rows.rows


@pytest.mark.parametrize("reply,why", [
    (subprocess.CompletedProcess([], 0, _case("decode/bf16/d128", False), ""), "1 of 1 cases failed"),
    (subprocess.CompletedProcess([], 0, "", ""), "0 of 0 cases failed"),
    (subprocess.CompletedProcess([], -11, _case("decode/bf16/d128", True), "Segmentation fault"),
     "exit -11: Segmentation fault"),
    (subprocess.TimeoutExpired([], correctness.HOPPER_CHILD_S, output=_case("decode/bf16/d128", True).encode()),
     f"did not finish within {correctness.HOPPER_CHILD_S} s (1 cases reported)"),
])
def test_a_failure_a_crash_or_a_hang_keeps_it_untimed(child, reply, why):
    rows, verdict = _run(reply, child)
    assert verdict == [False, why]
    from peers.flashinfer import Unavailable
    with pytest.raises(Unavailable, match=re.escape("its correctness cases did not pass: " + why)):
        timing._prepare("prefixattn-hopper", types.SimpleNamespace(), {})


def test_untimed_where_the_correctness_step_did_not_run(monkeypatch):
    from peers.flashinfer import Unavailable
    monkeypatch.setattr(correctness, "HOPPER_VERDICT", [])
    with pytest.raises(Unavailable, match="did not run in this call"):
        timing._prepare("prefixattn-hopper", types.SimpleNamespace(), {})


def test_the_cases_reach_both_classes_of_the_hopper_build(monkeypatch):
    """What the child would run on an sm_90 GPU (plans only: the sm90 tables, an sm_90 device, compiled kernels): its
    correctness cases at the GPU's scale take the Hopper build for the shared class and for the chunk class, and
    each feature case for both."""
    import prefixattn
    from gpu_check.cases import GPU_SCALE, build_case
    from prefixattn.autotune.builds import HOPPER, asking_for
    from prefixattn.autotune.lookup import planning_target
    from prefixattn.kernels.layout import CLASS_CHUNK, CLASS_SHARED
    from prefixattn.planner import plans

    monkeypatch.setattr(plans, "_KERNELS_INTERPRETED", False)
    monkeypatch.setattr(plans, "_device_arch", lambda device: (False, 90))

    def hopper_classes(case, seed, features):
        b, options = build_case(case, GPU_SCALE, seed)
        model = {k: v for k, v in features.items() if k != "sinks"}
        with planning_target("sm90"), asking_for(HOPPER):
            p = prefixattn.plan(*b.metadata, **b.heads, q_dtype=case.dtype, **options, **model)
        return {c for c in p.work_classes if p.build_of(c) == HOPPER}

    taken = {name: hopper_classes(case, seed, features) for name, case, seed, features in correctness.hopper_cases()}
    assert sum(CLASS_SHARED in t for t in taken.values()) >= 3, taken
    assert sum(CLASS_CHUNK in t for t in taken.values()) >= 3, taken
    for name in correctness.HOPPER_FEATURE_CASES:
        assert taken[f"mixed/bfloat16/d128/gqa8/page16+{name}"] == {CLASS_SHARED, CLASS_CHUNK}, taken
