"""Every step of one configuration launches the binaries its first steps (and the warm-up) compiled: what Triton
specializes a launch on (a pointer's 16-byte alignment, an int's ``== 1`` and ``% 16 == 0``) must not depend on the
step's data.

On the H200 (bench/results/gpu/nvidia-h200-74e5177*) a mixed step after the warm-up compiled two more binaries
(``tests/test_warmup.py``'s GPU test): the metadata tables' sections started wherever the step's item count put them,
and a step in which no rows merge passed ``[1, 1]`` workspace placeholders (strides 1) where a step with merges passed
real ones. Here each launch's key is Triton's own specialization (``native_specialize_impl``) of the arguments the
launch was prepared with, the per-call tensors alike in every step.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from prefixattn import attention, launcher, plan
from prefixattn.kernels.prefix_attention_kernel import UNSPECIALIZED_ARGS
from tests.launch_count import specialization_keys

HEADS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=16)


def _step_keys(q_lens: list[int], kv_extra: int, sharing: str, table_width: int) -> dict:
    """``{(constexprs, launch options): Triton's key of the other arguments}`` of one step's launches."""
    n = len(q_lens)
    qo = torch.tensor([0] + q_lens).cumsum(0)
    kv_lens = torch.tensor(q_lens) + kv_extra
    # Blocks 0-1 shared by every request, then each request's own; columns past a request's KV are never read.
    table = torch.tensor([[0, 1] + [2 + table_width * r + j for j in range(table_width - 2)] for r in range(n)])
    p = plan(qo, kv_lens, table, q_dtype=torch.float16, sharing=sharing, **HEADS)
    g = torch.Generator().manual_seed(0)
    blocks = 2 + table_width * n
    k = torch.randn(blocks, 16, 2, 64, generator=g, dtype=torch.float16)
    v = torch.randn(blocks, 16, 2, 64, generator=g, dtype=torch.float16)
    q = torch.randn(int(qo[-1]), 8, 64, generator=g, dtype=torch.float16)
    attention(q, k, v, p)
    return specialization_keys(p)


def test_launch_specialization_does_not_depend_on_the_step():
    steps = [([1] * 6, 40, "always", 7),  # decode under a shared prefix: rows merge
             ([64, 1, 1], 40, "auto", 7),  # the H200 warm-up test's mixed step
             ([3, 17], 40, "never", 7),  # nothing merges: workspace placeholders
             ([1] * 5, 20, "never", 5),  # other item counts move every later section
             ([1] * 7, 60, "always", 16),  # a table row of 16 blocks (a multiple of 16)
             ([2, 1, 1], 3, "always", 3)]
    seen: dict = {}
    classes = 0
    for step in steps:
        for binary, key in _step_keys(*step).items():
            classes += 1
            if binary in seen:
                assert key == seen[binary][1], (f"step {step} specializes a launch unlike step {seen[binary][0]}:",
                                                [(a, b) for a, b in zip(key, seen[binary][1]) if a != b])
            else:
                seen[binary] = (step, key)
    assert classes > len(seen), "no binary ran in two steps: the comparison compared nothing"


@pytest.mark.parametrize("name", UNSPECIALIZED_ARGS)
def test_the_compiled_kernel_does_not_specialize_the_table_row_stride(name):
    # The interpreter's function does not keep do_not_specialize; a compiled JIT function (no GPU needed) does.
    code = ("from prefixattn.kernels.prefix_attention_kernel import prefix_attention_kernel as k\n"
            f"print([p.do_not_specialize for p in k.params if p.name == {name!r}])")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[True]", out.stdout


def test_a_rocm_device_launches_with_the_merge_fences_of_its_gfx_isa(monkeypatch):
    """``USE_L2_FENCES`` of a launch on a ROCm device: the device's gfx ISA (``gcnArchName`` without its feature
    suffix) asked of :func:`~prefixattn.autotune.targets.writes_own_l2_fences`, once per device."""
    from types import SimpleNamespace

    asked = []
    monkeypatch.setattr(launcher.torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(gcnArchName=["gfx942:sramecc+:xnack-", "gfx90a"][index]))
    monkeypatch.setattr(launcher, "writes_own_l2_fences", lambda arch: asked.append(arch) or arch == "gfx942")
    assert launcher._own_l2_fences_at.__wrapped__(0) is True and launcher._own_l2_fences_at.__wrapped__(1) is False
    assert asked == ["gfx942", "gfx90a"]
