"""A real compiled kernel against the prepared launch's arguments (prefixattn/launcher.py), with no GPU.

In a subprocess without the interpreter, Triton's driver is stubbed (device 0, stream 0, an sm90 target) and
``attention()`` prepares a layer's launches with its JIT function in warm-up mode (``kernel.warmup``: compile, no
launch). The binary it compiles must take the arguments the direct launch passes: one per parameter of its
source's signature, in that order (the launcher skips the constexprs by position), with the specialization
:func:`prefixattn.launcher.arg_spec` keys it by.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, "bench")
import host_launch_time as h
import triton, triton.compiler
from triton.runtime import driver

driver.set_active(h._StubDriver())
import torch
import prefixattn
from prefixattn import launcher, prefix_attention

seen = {}


class Warmup:
    # The JIT function in warm-up mode: compiles (or finds) the binary for these arguments and launches nothing.
    fn = None

    def __getitem__(self, grid):
        def launch(*args, **options):
            compiled = prefix_attention.prefix_attention_kernel_real.warmup(*args, grid=grid, **options)
            seen.setdefault("runs", []).append((compiled, args))
            return None
        return launch


prefix_attention.prefix_attention_kernel_real = prefix_attention.prefix_attention_kernel
prefix_attention.prefix_attention_kernel = Warmup()
os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors through the per-call device check (the kernels are compiled ones)
qo_indptr, kv_lens, table, num_blocks = h._batch(4, 32, 40)
p = prefixattn.plan(qo_indptr, kv_lens, table, num_qo_heads=h.NUM_QO_HEADS, num_kv_heads=h.NUM_KV_HEADS,
                    head_dim=h.HEAD_DIM, block_size=h.BLOCK_SIZE, q_dtype=torch.float16, sharing="always")
q, k, v, out = h._layers(1, 4, num_blocks)[0]
q, k, v, out = (t.to(torch.float16) for t in (q, k, v, out))
prefixattn.attention(q, k, v, p, out=out)
report = []
for compiled, args in seen["runs"]:
    names = list(compiled.src.signature)
    constexprs = [n for n in names if compiled.src.signature[n] == "constexpr"]
    report.append({"names": names, "num_args": len(args), "constexprs": constexprs,
                   "expected": list(launcher._params(prefix_attention.prefix_attention_kernel_real).names)})
print(json.dumps(report))
"""


@pytest.mark.compile
def test_compiled_kernel_takes_the_prepared_arguments_in_order():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, cwd=root,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(report) == 2, "the shared class and the decode class"
    for launch in report:
        assert launch["names"] == launch["expected"] and launch["num_args"] == len(launch["names"])
        # The launch's switches and tiles are compile-time constants of the binary.
        assert {"IS_SHARED", "HAS_LSE", "BLOCK_M", "BLOCK_N", "BLOCK_D", "PAGE_SIZE"} <= set(launch["constexprs"])
