"""Count what a code region launches on the device: Triton kernel launches and torch ops that run a kernel.

Torch ops are seen through a ``TorchDispatchMode``; views (slicing, transpose, reshape of a view) and allocations
(``empty``, ``new_empty``) launch nothing on a GPU and are not counted. Triton launches are counted by wrapping
``run`` of Triton's JIT and interpreter functions; the torch ops a launch performs itself (the interpreter copies
tensors to numpy) are not counted as ops of the region. ``pause(obj, name)`` does the same for an engine method:
its calls are counted as one op and its inside is not (the engine's own cache-write op). :class:`RecordingKernel`
records what each launch of one kernel passes (grid, tensor addresses and strides, scalars): the CUDA-graph tests.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Allocation ops: no kernel runs (the caching allocator hands out memory).
_ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}


class LaunchCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.torch_ops: list[str] = []
        self.triton: list[str] = []
        self.engine_ops: list[str] = []
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._paused and not func.is_view and name not in _ALLOCATIONS:
            self.torch_ops.append(name)
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def wrap(self, fn, record: list, name: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            record.append(name)
            with self.paused():
                return fn(*args, **kwargs)
        return wrapper


@contextlib.contextmanager
def count_launches(monkeypatch):
    """``with count_launches(monkeypatch) as c: ...`` then ``c.triton``, ``c.torch_ops``, ``c.engine_ops``."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from prefixattn import launcher

    counter = LaunchCounter()
    # Every launch through the JIT function, where it is counted (a compiled kernel's launcher called directly is not).
    monkeypatch.setattr(launcher, "ALLOW_DIRECT", False)
    for cls in (InterpretedFunction, JITFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            counter.triton.append(self.fn.__name__ if hasattr(self, "fn") else self.__name__)
            with counter.paused():
                return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", run)
    with counter:
        yield counter


def count_engine_op(monkeypatch, counter: LaunchCounter, obj, name: str) -> None:
    """Count calls of ``obj.name`` as one engine op each, without counting what it does inside."""
    monkeypatch.setattr(obj, name, counter.wrap(getattr(obj, name), counter.engine_ops, name))


__all__ = ["LaunchCounter", "count_engine_op", "count_launches"]


def launch_arguments(args: tuple, kwargs: dict) -> dict:
    """A launch of the fused kernel as ``{parameter: value}``: the launcher passes the kernel's arguments by position
    (in parameter order) and its launch options (``num_warps``, ...) by keyword."""
    from prefixattn.kernels.prefix_attention_kernel import prefix_attention_kernel

    names = prefix_attention_kernel.fn.__code__.co_varnames[:len(args)]
    return {**dict(zip(names, args)), **kwargs}


class RecordingKernel:
    """Stands in for the @triton.jit kernel: records each launch's grid, tensor addresses/strides and scalars."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = launch_arguments(args, kwargs)
            self.launches.append((grid, {k: (v.data_ptr(), v.stride()) if isinstance(v, torch.Tensor) else v
                                         for k, v in named.items()}))
            return self.kernel[grid](*args, **kwargs)
        return launch


def fixed_launch_args(plan) -> list:
    """The grids and the plan-independent arguments (addresses of tensors, scalars) of a plan's prepared launches:
    what a CUDA graph captures, equal for every later plan of a ``use_cuda_graph`` wrapper."""
    from prefixattn.launcher import prepared_launches

    out = []
    for launch in prepared_launches(plan).values():
        fixed = [i for i in range(len(launch.params.names)) if i not in launch.params.per_call]
        out.append([(grid, [args[i].data_ptr() if isinstance(args[i], torch.Tensor) else args[i] for i in fixed])
                    for grid, args, *_ in launch.launches])
    return out


def specialization_keys(plan) -> dict:
    """``{(constexprs, launch options): Triton's specialization of the other arguments}`` of the launches the
    launcher prepared for ``plan`` (its memo, every call shape): what decides which binary a launch runs, beyond the
    constexprs (an int's ``== 1`` and ``% 16 == 0``, a pointer's 16-byte alignment)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from prefixattn import launcher
    from prefixattn.kernels.prefix_attention_kernel import UNSPECIALIZED_ARGS

    keys = {}
    for launch in launcher._prepared_launches[id(plan)][1].values():
        prm = launch.params
        for _grid, args, options, _spec, _compiled, _build in launch.launches:  # _build: None (portable)
            constexprs = tuple(args[i] for i in prm.constexprs)
            others = tuple(str(native_specialize_impl(BaseBackend, args[i], False,
                                                      prm.names[i] not in UNSPECIALIZED_ARGS, True))
                           for i in range(len(args)) if i not in prm.constexprs)
            keys[(constexprs, tuple(sorted(options.items())))] = others
    return keys
