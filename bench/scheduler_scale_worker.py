"""Run in a fresh process by ``test_scheduler_speed.py``: group and order an offline batch at BlendServe's scale
(400,000 requests), print JSON. ``argv``: number of requests, then the workload: ``case1`` (BatchLLM case-1-shaped
prompts of ~1,560 tokens, share degree ~7: ~625M tokens, 2.5 GB as int32, generated straight into one int32 array and
given to ``group_prompts`` as a ``PackedSequences``: a list of 400,000 row arrays would cost a second 2.5 GB copy to
pack) or ``blendserve`` (chat/MMLU/video mix, ~600 tokens each, a list of int32 row arrays; packing is timed).

A separate process so its peak memory (``VmHWM``) measures only this work: the peak is reset after the prompts are
generated, so ``peak_extra_bytes`` is the memory grouping and ordering needed beyond the prompts themselves.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

from batches.prompts import batchllm_case1_packed, blendserve_mix  # noqa: E402

from prefixattn.scheduling import group_prompts, order_groups  # noqa: E402


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    num_requests = int(sys.argv[1]) if len(sys.argv) > 1 else 400_000
    workload = sys.argv[2] if len(sys.argv) > 2 else "case1"
    if workload == "case1":
        prompts = batchllm_case1_packed(num_requests)
        # Snippet generation: outputs of a few hundred tokens (BatchLLM case 1); the blendserve order needs some.
        output_lens = np.random.default_rng(1).integers(100, 400, num_requests)
    elif workload == "blendserve":
        prompts, output_lens = blendserve_mix(num_requests)
    else:
        raise ValueError(f"workload: expected 'case1' or 'blendserve', got {workload!r}")
    tokens = int(prompts.offsets[-1]) if workload == "case1" else sum(len(p) for p in prompts)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
    base_kb = _status_kb("VmRSS")
    out = dict(workload=workload, num_requests=num_requests, tokens=tokens, prompt_bytes=tokens * 4)
    wall, cpu = time.perf_counter(), time.process_time()
    groups = group_prompts(prompts)
    out["group_wall_s"], out["group_cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
    for name, kwargs in (("batchllm", {}), ("blendserve", dict(output_lens=output_lens))):
        w, c = time.perf_counter(), time.process_time()
        ordered = order_groups(groups, name, **kwargs)
        out[f"order_{name}_wall_s"], out[f"order_{name}_cpu_s"] = time.perf_counter() - w, time.process_time() - c
        out[f"units_{name}"] = len(ordered)
    out["groups"] = len(groups)
    out["peak_extra_bytes"] = (_status_kb("VmHWM") - base_kb) * 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
