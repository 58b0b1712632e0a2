"""Host microseconds per ``attention()`` and per ``PrefixSharedAttention.run()`` with the device work replaced at the
lowest level: Triton's launcher call (``CompiledKernel.run``), on a machine with no GPU.

Reports, never asserts (``python bench/host_launch_time.py [--layers N --steps N --json]``). Everything above the
launcher runs as on a GPU host: the input checks, the counters, the argument assembly and Triton's JIT dispatch
(binding, specialization keys, the kernel-cache lookup) or the prepared direct launch. What is stubbed:

* Triton's active driver (current device 0, stream 0, target ``cuda`` sm90): there is no CUDA driver here;
* ``triton.compiler.compile``: returns a stand-in compiled kernel whose ``run`` (the launcher) only counts;
* the interpreter's device check: the kernels are imported as JIT functions (``TRITON_INTERPRET`` unset), then
  ``TRITON_INTERPRET=1`` lets CPU tensors through ``attention()``'s device check (which reads it per call).

Torch ops the call makes (a memset, allocations) run on the CPU, where they cost about what a CUDA launch's host
side costs. The numbers are this host's (a loaded 2-core machine gives medians with a wide spread): compare
before/after only from runs interleaved on the same host. Run against another checkout with
``PYTHONPATH=/path/to/checkout python bench/host_launch_time.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions (the GPU host's dispatch path)

#: Decode shapes small enough to be host-bound on an H100 (GQA 4, head_dim 128, bf16): (name, requests, shared
#: prefix tokens, own tokens per request). The shared one launches two classes (shared nodes and decode tiles).
SHAPES = (("decode-8", 8, 0, 512), ("decode-32-shared", 32, 2048, 64))
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


class _StubCompiled:
    """Stands in for a ``CompiledKernel``: ``run`` is the launcher call, counted and dropped."""

    def __init__(self) -> None:
        self.launches = 0
        self.function = self.packed_metadata = None

    def run(self, *args) -> None:
        self.launches += 1

    def launch_metadata(self, *args):
        return None


class _StubDriver:
    """Triton's active-driver interface as the JIT dispatch uses it, for device 0 of an sm90 GPU."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def install_stubs() -> _StubCompiled:
    """Stub the driver and the compiler (module docstring); returns the stand-in compiled kernel."""
    import triton
    import triton.compiler
    from triton.runtime import driver

    compiled = _StubCompiled()
    driver.set_active(_StubDriver())
    triton.compiler.compile = lambda *args, **kwargs: compiled
    return compiled


def _batch(requests: int, shared: int, own: int):
    import torch

    per_request = -(-(shared + own) // BLOCK_SIZE)
    shared_blocks = shared // BLOCK_SIZE
    num_blocks = shared_blocks + requests * (per_request - shared_blocks) + 1
    table = torch.zeros((requests, per_request), dtype=torch.int32)
    nxt = shared_blocks
    for r in range(requests):
        table[r, :shared_blocks] = torch.arange(shared_blocks)
        table[r, shared_blocks:] = torch.arange(nxt, nxt + per_request - shared_blocks)
        nxt += per_request - shared_blocks
    qo_indptr = torch.arange(requests + 1, dtype=torch.int32)
    kv_lens = torch.full((requests,), shared + own, dtype=torch.int32)
    return qo_indptr, kv_lens, table, num_blocks


def _layers(num_layers: int, requests: int, num_blocks: int):
    import torch

    cache = lambda: torch.zeros((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=torch.bfloat16)  # noqa: E731
    return [(torch.zeros((requests, NUM_QO_HEADS, HEAD_DIM), dtype=torch.bfloat16), cache(), cache(),
             torch.empty((requests, NUM_QO_HEADS, HEAD_DIM), dtype=torch.bfloat16)) for _ in range(num_layers)]


def _time_layers(call, layers, steps: int, per_step=None) -> list[float]:
    """Microseconds of each ``call(q, k, v, out)``, ``steps`` times over ``layers`` (``per_step()`` before each)."""
    times = []
    for _ in range(steps):
        if per_step is not None:
            per_step()
        for q, k, v, out in layers:
            start = time.perf_counter_ns()
            call(q, k, v, out)
            times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def _summary(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4)
    return {"median_us": round(statistics.median(times), 2), "p25_us": round(q[0], 2), "p75_us": round(q[2], 2),
            "calls": len(times)}


def measure(num_layers: int, steps: int) -> list[dict]:
    """One row per (shape, entry point): host microseconds per call, median and quartiles."""
    compiled = install_stubs()
    import torch

    import prefixattn

    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors pass attention()'s per-call device check (docstring)
    rows = []
    for name, requests, shared, own in SHAPES:
        qo_indptr, kv_lens, table, num_blocks = _batch(requests, shared, own)
        layers = _layers(num_layers, requests, num_blocks)
        heads = dict(num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE)
        p = prefixattn.plan(qo_indptr, kv_lens, table, **heads, q_dtype=torch.bfloat16, sharing="auto")
        entries = {"attention": (lambda q, k, v, out: prefixattn.attention(q, k, v, p, out=out), None)}
        for graph in (False, True):
            attn = prefixattn.PrefixSharedAttention(**heads, q_dtype=torch.bfloat16, max_tokens=64, max_requests=64,
                                                    max_blocks_per_request=256, device="cpu", use_cuda_graph=graph)
            entries[f"run{'-graph' if graph else ''}"] = (
                lambda q, k, v, out, attn=attn: attn.run(q, k, v, out=out),
                lambda attn=attn: attn.plan(qo_indptr, kv_lens, table))
        for entry, (call, per_step) in entries.items():
            if per_step is not None:
                per_step()
            _time_layers(call, layers[:2], 1)  # the first launches compile (stubbed) and fill the caches
            before = compiled.launches
            times = _time_layers(call, layers, steps, per_step)
            launches = (compiled.launches - before) / (steps * num_layers)
            # A step's first layer after its plan() prepares the launches (the wrappers plan every step here).
            first = statistics.median(times[::num_layers])
            rows.append({"shape": name, "entry": entry, "launches_per_layer": launches, **_summary(times),
                         "first_layer_median_us": round(first, 2)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--label", default="")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args(argv)
    rows = measure(args.layers, args.steps)
    for row in rows:
        row["label"] = args.label
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{args.label:8s} {row['shape']:18s} {row['entry']:10s} median {row['median_us']:7.2f} us "
                  f"(p25 {row['p25_us']:.2f}, p75 {row['p75_us']:.2f}; {row['calls']} calls, "
                  f"{row['launches_per_layer']:.1f} launches/layer; a step's first layer "
                  f"{row['first_layer_median_us']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
