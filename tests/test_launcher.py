"""The prepared launch (prefixattn/launcher.py): which path a launch takes, and that the direct path passes the compiled
kernel's launcher the arguments the JIT path passed, patched only with the layer's tensors.

There is no compiled kernel here (the kernels run in the interpreter), so the direct path runs against a stand-in:
a JIT function whose launches return a recording compiled kernel, with the direct launch allowed and Triton's current
device and stream stubbed. tests/test_launcher_compile.py holds a real compiled kernel's launcher signature against
the arguments.
"""

from __future__ import annotations

import pytest
import torch
from triton.backends.compiler import BaseBackend

from prefixattn import attention, launcher, plan, prefix_attention
from prefixattn.kernels.prefix_attention_kernel import prefix_attention_kernel
from prefixattn.launcher import prepared_launches
from tests.launch_count import launch_arguments
from tests.prefix_batches import make_batch

#: Arguments a layer changes; every other argument of a prepared launch is the plan's (or the call shape's).
PER_CALL = {"out_ptr", "lse_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "sinks_ptr", "k_scale_ptr", "v_scale_ptr",
            "qk_scale", "v_scale"}
#: The launcher's leading parameters before the kernel's own (Triton 3.6-3.9's ``CompiledKernel.run``).
LAUNCHER_HEAD = 9
STREAM = 77


class _Compiled:
    """A compiled kernel's stand-in: ``run`` is the launcher, recorded."""

    def __init__(self, name: str) -> None:
        self.function, self.packed_metadata, self.runs = f"function-{name}", f"metadata-{name}", []

    def run(self, *args) -> None:
        self.runs.append(args)


class _Jit:
    """The JIT function's stand-in: records each launch and returns one compiled kernel per (class, options)."""

    def __init__(self) -> None:
        self.fn, self.launches, self.compiled = prefix_attention_kernel.fn, [], {}

    def __getitem__(self, grid):
        def launch(*args, **options):
            named = launch_arguments(args, options)
            self.launches.append((grid, named))
            key = (named["IS_SHARED"], tuple(sorted(options.items())))
            return self.compiled.setdefault(key, _Compiled(str(key)))
        return launch


@pytest.fixture
def direct(monkeypatch):
    """The stand-in JIT function, with the direct launch allowed and device 0 / stream 77 current."""
    jit = _Jit()
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", jit)
    monkeypatch.setattr(launcher, "direct_launch_unsupported", lambda kernel, **kw: None)
    monkeypatch.setattr(launcher, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "current_stream", lambda device: STREAM)
    monkeypatch.setattr(launcher, "_COMPILED", {})
    return jit


def _batch_and_layers(num_layers: int):
    b = make_batch(0, q_lens=[1, 1, 2], extra_lens=[3, 5, 2], paths=[("a",), ("a",), ()], level_blocks={"a": 2},
                   block_size=4, num_qo_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    layers = [(b.q.clone(), b.k_cache.clone(), b.v_cache.clone(), torch.empty_like(b.q)) for _ in range(num_layers)]
    return b, layers


def _direct_runs(jit) -> list:
    return [run for c in jit.compiled.values() for run in c.runs]


def test_direct_path_passes_the_jit_arguments_patched_with_the_layer(direct):
    b, layers = _batch_and_layers(3)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="always")
    assert len(p.work_classes) == 2
    q, k, v, out = layers[0]
    attention(q, k, v, p, out=out)  # the first launch of each class goes through the JIT function
    assert len(direct.launches) == 2 and _direct_runs(direct) == []
    first = list(direct.launches)
    for q, k, v, out in layers[1:]:
        attention(q, k, v, p, out=out)
        assert len(direct.launches) == 2, "later layers launch directly"
    [launch] = prepared_launches(p).values()
    assert launch.direct == (True, True)
    for (grid, jit_args), compiled in zip(first, (direct.compiled[key] for key in direct.compiled)):
        assert len(compiled.runs) == 2
        for run, (q, k, v, out) in zip(compiled.runs, layers[1:]):
            assert run[:LAUNCHER_HEAD] == (grid[0], 1, 1, STREAM, compiled.function, compiled.packed_metadata, None,
                                           None, None)
            named = launch_arguments(run[LAUNCHER_HEAD:], {})
            assert list(named) == [n for n in jit_args if n not in ("num_warps", "num_stages")]
            assert named["q_ptr"] is q and named["k_cache_ptr"] is k and named["v_cache_ptr"] is v
            assert named["out_ptr"] is out
            for name, value in named.items():
                if name not in PER_CALL:
                    assert value is jit_args[name] or (type(value) is type(jit_args[name])
                                                       and value == jit_args[name]), name


def test_a_new_call_shape_or_alignment_goes_through_the_jit_first(direct):
    b, layers = _batch_and_layers(2)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="never")
    q, k, v, out = layers[0]
    attention(q, k, v, p, out=out)
    attention(q, k, v, p, out=out)
    assert len(direct.launches) == 1 and len(_direct_runs(direct)) == 1
    # q at an address that is not 16-byte aligned: Triton specializes the pointer differently, so the binary the
    # JIT function returned for the aligned q must not serve it.
    store = torch.empty(q.numel() + 1, dtype=q.dtype)
    odd = store[1:].view(q.shape).copy_(q)
    assert odd.data_ptr() % launcher.SPEC_ALIGN != 0
    attention(odd, k, v, p, out=out)
    assert len(direct.launches) == 2 and len(prepared_launches(p)) == 2
    # Another plan with the same shapes finds the compiled kernel the first one used: no JIT launch.
    again = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="never")
    attention(q, k, v, again, out=out)
    assert len(direct.launches) == 2 and len(_direct_runs(direct)) == 2


def test_jit_path_while_a_launch_hook_is_installed_or_under_another_device(direct, monkeypatch):
    from triton import knobs

    b, layers = _batch_and_layers(1)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="never")
    q, k, v, out = layers[0]
    attention(q, k, v, p, out=out)
    hook = lambda *args: None  # noqa: E731 - a profiler's enter hook
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        attention(q, k, v, p, out=out)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(direct.launches) == 2 and _direct_runs(direct) == []
    monkeypatch.setattr(launcher, "current_device", lambda: 1)
    attention(q, k, v, p, out=out)
    assert len(direct.launches) == 3 and _direct_runs(direct) == []
    monkeypatch.setattr(launcher, "current_device", lambda: 0)
    attention(q, k, v, p, out=out)
    assert len(direct.launches) == 3 and len(_direct_runs(direct)) == 1


def test_interpreter_launches_take_the_jit_path(device):
    b, layers = _batch_and_layers(2)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="always")
    for q, k, v, out in layers:
        attention(q, k, v, p, out=out)
    [launch] = prepared_launches(p).values()
    assert launch.unsupported is not None and launch.direct == (False, False)


def test_direct_launch_guard():
    from triton.runtime.jit import JITFunction

    compiled = JITFunction(prefix_attention_kernel.fn)  # a compiled (not interpreted) JIT function: no GPU needed
    assert launcher.direct_launch_unsupported(compiled, version=(3, 6), hip=False) is None
    assert launcher.direct_launch_unsupported(compiled, version=(3, 9), hip=False) is None
    for version in ((3, 5), (3, 10), (4, 0)):
        assert "3.6-3.9" in launcher.direct_launch_unsupported(compiled, version=version, hip=False)
    assert "AMD" in launcher.direct_launch_unsupported(compiled, version=(3, 9), hip=True)
    assert "interpreter" in launcher.direct_launch_unsupported(prefix_attention_kernel, version=(3, 9), hip=False)


def _native_spec(arg):
    from triton.runtime.jit import native_specialize_impl

    return native_specialize_impl(BaseBackend, arg, False, True, True)


def test_arg_spec_is_at_least_as_fine_as_triton_specialization():
    # Two arguments launcher.arg_spec calls alike must get the same binary: Triton's own specialization (the
    # installed version's, NVIDIA's rules) must agree on them.
    base = torch.zeros(256, dtype=torch.float16)
    values = [0, 1, 2, 3, 15, 16, 17, 32, 48, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, 2**40, 2**63 - 1, 2**63,
              -2**31, -2**31 - 1, 0.5, 1.0, True, False, None]
    values += [base[i:] for i in range(0, 17)] + [torch.zeros(8, dtype=d) for d in (torch.float32, torch.int32,
                                                                                     torch.bfloat16)]
    values += [torch.zeros(8, dtype=torch.float8_e4m3fn)[i:] for i in (0, 1, 16)]
    by_spec: dict = {}
    for value in values:
        by_spec.setdefault(launcher.arg_spec(value, False), []).append(value)
    for spec, group in by_spec.items():
        natives = {str(_native_spec(v)) for v in group}
        assert len(natives) == 1, (spec, natives)
    # Coarse enough to be useful: every 16-byte-aligned fp16 pointer shares one key, as do multiples of 16.
    assert launcher.arg_spec(base[8:], False) == launcher.arg_spec(base, False)
    assert launcher.arg_spec(32, False) == launcher.arg_spec(4096, False)
