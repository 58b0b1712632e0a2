"""Throughput simulator: hardware/model presets, cost model, iteration-level engine, workloads.

Every number it produces is **modeled** on a calibrated cost model (:mod:`prefixattn.sim.calibration`), never
measured. Entry points: :func:`simulate` and the ``prefixattn simulate`` command.
"""

from prefixattn.sim.calibration import Calibration
from prefixattn.sim.step_cost import CostModel, StepShape
from prefixattn.sim.engine import Engine
from prefixattn.sim.metrics import SimResult
from prefixattn.sim.simulate import simulate
from prefixattn.sim.workloads import Workload, get_workload, load_jsonl

__all__ = ["Calibration", "CostModel", "Engine", "SimResult", "StepShape", "Workload", "get_workload", "load_jsonl",
           "simulate"]
