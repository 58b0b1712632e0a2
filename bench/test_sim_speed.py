"""How long the simulator itself takes (wall and CPU seconds on this machine) for 30,000 requests; reported only.

The issue's target: 30,000 requests in under 60 s. BatchLLM case 1 scaled to 30,000 requests (same distributions)
is the workload; the time includes building the workload, the offline scheduling and the run.
"""

import time

import pytest

from prefixattn.sim.simulate import simulate
from prefixattn.sim.workloads import batchllm_case1

REQUESTS = 30_000


@pytest.mark.parametrize("policy", ["vllm", "sglang", "batchllm", "prefixattn"])
def test_simulate_30k_requests(results, policy):
    wall, cpu = time.perf_counter(), time.process_time()
    workload = batchllm_case1(num_requests=REQUESTS)
    (res,) = simulate(workload, [policy], model="mistral-7b", gpu="a100")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    shape = f"batchllm-case1x{REQUESTS}"
    results.add("sim-speed", policy, shape, "wall_s", wall, "s", device="host-cpu")
    results.add("sim-speed", policy, shape, "cpu_s", cpu, "s", device="host-cpu")
    results.add("sim-speed", policy, shape, "simulated_steps", res.steps, "count", device="host-cpu")
    results.add("sim-speed", policy, shape, "modeled_throughput_tok_s", res.throughput_tok_s, "tok/s",
                device=f"modeled:{res.gpu}/{res.model}")
    print(f"\n{policy}: {REQUESTS} requests simulated in {wall:.1f} s wall / {cpu:.1f} s CPU ({res.steps} steps)")
