"""How the GPU check times a provider, the same way for every provider: CUDA-graph replay where the provider can be
captured, the eager call beside it, each under one L2 policy, repeated.

- **L2 policy.** ``flushed`` (the headline): a 256 MiB buffer is overwritten before each timed run (not timed), so
  every run reads its KV from HBM, as a layer of a model step does (the other layers' KV evicted it). ``warm``:
  back-to-back runs on the same buffers, reported beside it: working sets under the L2 (~50 MB on an H100) are then
  served from L2, which no model step sees. Both policies for every provider and shape; eager runs are flushed too.
- **Repetitions.** :data:`REPEATS` repetitions of ``runs`` timed runs each (CUDA events around each run); a
  repetition's value is its median run, and the rows give the min and the median over the repetitions.
- **Card state.** SM clock, memory clock, temperature and power read through NVML after each shape.

In the dry run (CPU interpreter) one wall-clock run stands for every statistic: it proves the code path, not a time.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import time

REPEATS = 3
#: GPU time each repetition's runs cover (runs = this / one run's time, within RUNS_RANGE): enough runs that the
#: median is stable, few enough that ~50 shapes x ~11 providers x 3 policies fit the timing step's budget. A run
#: longer than this is one run per repetition (the no-sharing peers take ~50 ms on the 32K-prefix MHA shapes).
TARGET_REP_MS = 3.0
RUNS_RANGE = (1, 30)
#: Bytes overwritten before a flushed run: 5x the H100's 50 MB L2 (and 4x the H200's 60 MB).
FLUSH_BYTES = 256 * 1024 * 1024
POLICIES = ("graph_flushed", "graph_warm", "eager_flushed")


def capture(fn):
    """(graph, result): ``fn`` once on a side stream (module loads, lazy allocations), then captured once; the
    graph's replays rewrite ``result``'s tensors."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    torch.cuda.synchronize()
    return graph, result


class Timer:
    """Times callables on the current CUDA device (or by wall clock in the dry run) under the module's policies."""

    def __init__(self, dry_run: bool, device: str):
        self.dry_run = dry_run
        self.flush_buf = None
        if not dry_run:
            import torch

            self.flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)

    def _runs_ms(self, fn, runs: int, flush: bool, before=None) -> list[float]:
        import torch

        events = []
        for _ in range(runs):
            if before is not None:
                before()
            if flush:
                self.flush_buf.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]

    def runs_for(self, fn, before=None) -> int:
        """Timed runs per repetition for ``fn``: from one flushed run's time."""
        if self.dry_run:
            return 1
        one = self._runs_ms(fn, 1, flush=True, before=before)[0]
        return int(min(max(math.ceil(TARGET_REP_MS / max(one, 1e-3)), RUNS_RANGE[0]), RUNS_RANGE[1]))

    def repeat(self, fn, runs: int, flush: bool, before=None) -> dict:
        """``{"min": us, "median": us}`` over :data:`REPEATS` repetitions' median runs. ``before()`` runs ahead of
        each run, outside its events (state a run consumes, such as merge counters, reset untimed)."""
        if self.dry_run:
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            us = (time.perf_counter() - start) * 1e6
            return dict(min=us, median=us)
        reps = [statistics.median(self._runs_ms(fn, runs, flush, before)) * 1e3 for _ in range(REPEATS)]
        return dict(min=min(reps), median=statistics.median(reps))


def gpu_state(device_index: int = 0) -> dict:
    """SM and memory clocks (MHz), temperature (C) and power (W) now, through NVML (nvidia-ml-py), else parsed from
    ``nvidia-smi``; empty where neither answers (the dry run, a CPU host)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        return dict(sm_clock_mhz=float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                    mem_clock_mhz=float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
                    temperature_c=float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                    power_w=pynvml.nvmlDeviceGetPowerUsage(h) / 1e3)
    except Exception:  # noqa: BLE001 - no NVML here: try the command line
        pass
    try:
        out = subprocess.run(["nvidia-smi", "-i", str(device_index), "--format=csv,noheader,nounits",
                              "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        sm, mem, temp, power = (float(x) for x in out.split(","))
        return dict(sm_clock_mhz=sm, mem_clock_mhz=mem, temperature_c=temp, power_w=power)
    except Exception:  # noqa: BLE001 - neither: the rows are simply absent
        return {}


def record_state(results, benchmark: str, shape: str) -> dict:
    """The card's state as rows (provider ``gpu-state``) after a shape's timings."""
    state = gpu_state()
    units = dict(sm_clock_mhz="MHz", mem_clock_mhz="MHz", temperature_c="C", power_w="W")
    for metric, value in state.items():
        results.add(benchmark, "gpu-state", shape, metric, value, units[metric])
    return state
