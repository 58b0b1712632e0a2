"""One layer's launches of an attention kernel (one per work class), prepared once per plan and call shape, and the
memo of them per plan (:func:`prepared`, :func:`remember_launch`).

A :class:`PreparedLaunch` holds the kernel's argument list in parameter order, assembled once from the plan (its
tables, scalars and tiles) and the call's shape (strides, dtypes, feature switches); a call patches only the
tensors that change from layer to layer (``out``, ``lse``, ``q``, the caches, the sink and scale pointers) and the
two scalars a float scale changes. Each class's launch then calls the compiled kernel's own launcher
(``CompiledKernel.run``) directly where :func:`direct_launch_unsupported` allows it: no binding of ~55 keyword
arguments, no specialization keys, no kernel-cache lookup per layer (Triton's JIT dispatch, ~45-80 us a launch on
the 2-core host, bench/host_launch_time.py). Otherwise, and for a call shape's first launch (which compiles or
finds the binary), the launch goes through the JIT function with the same positional arguments.

Why reusing a compiled kernel is exact: the JIT function picks a binary by the constexprs, the launch options and
each argument's specialization (NVIDIA: a pointer's dtype and 16-byte alignment; an int's ``== 1``, ``% 16 == 0``
and i32/i64/u64 range). :func:`arg_spec` computes that key, or a finer one, from the same arguments, so a binary the
JIT function returned for one key serves every launch with that key. The caller keys prepared launches by the exact
strides and 16-byte alignment of the per-call tensors, which refines Triton's key for them. What else selects a
binary (Triton's knobs and compile environment) is taken to stay as it is while the process runs.
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref

import torch
import triton
from triton import knobs
from triton.runtime import _allocation, driver  # _allocation: Triton's allocator (a context variable; 3.6-3.9)

from prefixattn.autotune.buckets import dtype_name
from prefixattn.autotune.builds import BUILD_ENV, HOPPER_STAGES, hopper_cache_refusal, hopper_num_warps
from prefixattn.autotune.targets import gfx_isa, writes_own_l2_fences
from prefixattn.kernels.layout import CLASS_SHARED
from prefixattn.kernels.prefix_attention_kernel import prefix_attention_kernel
from prefixattn.planner.plans import Plan

#: Triton versions whose JIT dispatch and launcher this module's direct launch follows (both ends included): the
#: JIT function returns the ``CompiledKernel``, whose ``run(grid_x, grid_y, grid_z, stream, function,
#: packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`` takes every kernel argument in parameter order
#: (constexprs included, which the launcher skips). Checked in the 3.6.0 and 3.9.0 wheels' ``runtime/jit.py`` and
#: ``compiler/compiler.py``.
DIRECT_LAUNCH_TRITON = ((3, 6), (3, 9))
#: Pointer alignment (bytes) Triton's NVIDIA specialization records (the ``D`` attribute: divisible by 16).
SPEC_ALIGN = 16
#: Int ranges Triton types a non-constexpr int argument by (i32, then i64, then u64).
_I32 = (-2**31, 2**31 - 1)
_I64_MAX = 2**63 - 1
#: Compiled kernels kept across plans, by (kernel, device, specialization): one per binary the engine runs. Cleared
#: past this many (a process that keeps changing shapes re-looks them up through the JIT function).
_MAX_COMPILED = 256
_COMPILED: dict = {}
#: False: every launch goes through the JIT function (to compare the two paths, or to rule the direct one out).
ALLOW_DIRECT = True


@functools.cache
def _triton_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def direct_launch_unsupported(kernel, *, version: tuple[int, int] | None = None, hip: bool | None = None) -> str | None:
    """Why ``kernel``'s compiled launcher may not be called directly here (None: it may).

    Only a compiled JIT function (not the interpreter's), on an NVIDIA backend (AMD's specialization also reads the
    tensors' sizes, which the prepared key does not cover), under a Triton in :data:`DIRECT_LAUNCH_TRITON`.
    """
    from triton.runtime.jit import JITFunction

    version = _triton_version() if version is None else version
    if not DIRECT_LAUNCH_TRITON[0] <= version <= DIRECT_LAUNCH_TRITON[1]:
        return f"triton {version[0]}.{version[1]}: the direct launch follows Triton 3.6-3.9"
    if not isinstance(kernel, JITFunction) or type(kernel).__name__ == "InterpretedFunction":
        return "the kernel is not a compiled JIT function (the interpreter, or a stand-in)"
    if torch.version.hip is not None if hip is None else hip:
        return "AMD: Triton's specialization there reads more than dtype and alignment"
    return None


def arg_spec(arg, is_constexpr: bool):
    """What of ``arg`` selects the binary (module docstring), as a hashable value equal for args Triton specializes
    alike (or finer)."""
    if is_constexpr:
        return ("c", arg)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % SPEC_ALIGN == 0)
    if isinstance(arg, bool) or arg is None:
        return ("v", arg)
    if isinstance(arg, int):
        return ("i", arg == 1, arg % 16 == 0, _I32[0] <= arg <= _I32[1], arg <= _I64_MAX)
    if isinstance(arg, float):
        return ("f",)
    return ("o", type(arg), arg)


@functools.lru_cache(maxsize=1024)
def _int_spec(value):
    """``arg_spec`` of a plain (hashable) argument, memoized: the same ints and floats come back every step."""
    return arg_spec(value, False)


def spec_of(args: list, prm: "_Params") -> tuple:
    """``arg_spec`` of every argument, grouped by the kind of parameter (pointers, constexprs, the rest): computed
    once per prepared launch, i.e. on the first layer of every step, so kept to three passes over positions."""
    return (tuple([(args[i].dtype, args[i].data_ptr() % SPEC_ALIGN == 0) if type(args[i]) is torch.Tensor
                   else arg_spec(args[i], False) for i in prm.pointers]),
            tuple([args[i] for i in prm.constexprs]),
            tuple([_int_spec(args[i]) for i in prm.others]))


def _hooks_idle() -> bool:
    """No launch hook is installed (a profiler's): a direct launch then skips them, as the JIT path's calls of the
    empty hook chains do nothing."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and (type(hook).__name__ != "HookChain" or hook.calls):
            return False
    return True


def current_device():
    """Triton's current device (what a compiled kernel was loaded for)."""
    return driver.active.get_current_device()


def current_stream(device):
    """Triton's current stream on ``device`` (the one the JIT path launches on)."""
    return driver.active.get_current_stream(device)


#: The fused kernel's parameters a call patches (the tensors that change from layer to layer, and the two scalars a
#: float scale changes), in the order :meth:`PreparedLaunch.__call__` takes their values.
FUSED_PER_CALL = ("out_ptr", "lse_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "sinks_ptr", "k_scale_ptr",
                  "v_scale_ptr", "qk_scale", "v_scale")


class _Params:
    """The kernel's parameters, in order, and the positions of those a call or a class changes."""

    def __init__(self, fn, per_call: tuple) -> None:
        params = inspect.signature(fn).parameters
        self.names = tuple(params)
        self.constexpr = tuple(p.annotation is not inspect.Parameter.empty and "constexpr" in str(p.annotation)
                               for p in params.values())
        self.per_call = tuple(self.names.index(n) for n in per_call)
        positions = range(len(self.names))
        self.constexprs = tuple(i for i in positions if self.constexpr[i])
        self.pointers = tuple(i for i in positions if not self.constexpr[i] and self.names[i].endswith("_ptr"))
        self.others = tuple(i for i in positions if not self.constexpr[i] and i not in self.pointers)


_PARAMS: dict = {}


def _params(kernel, per_call: tuple = FUSED_PER_CALL) -> _Params:
    """The parameters of ``kernel`` (a stand-in without its own ``fn`` takes the fused kernel's)."""
    fn = getattr(kernel, "fn", None) or prefix_attention_kernel.fn
    got = _PARAMS.get((fn, per_call))
    if got is None:
        got = _PARAMS[(fn, per_call)] = _Params(fn, per_call)
    return got


class PreparedLaunch:
    """The launches of one layer for one plan and call shape (module docstring).

    Parameters
    ----------
    kernel : JITFunction
        The fused kernel (``prefix_attention_kernel``, or a test's stand-in with its ``fn``).
    named : dict
        Every non-class argument by parameter name, from the call that prepares it (its per-call tensors give the
        strides and specialization every later call with the same key shares).
    per_class : list of (grid, dict, dict) or (grid, dict, dict, kernel)
        One launch each, in order: its grid, its class arguments (``item_range_ptr``, ``IS_SHARED``, ``BLOCK_M``,
        ``BLOCK_N``) and its launch options (``num_warps``, ``num_stages``, AMD's); a fourth element is the
        class's own build (a matrix class's Hopper build: ``kernel``'s parameters and its own constexprs, which
        the class arguments give). Such a build's global scratch (its TMA descriptors) comes from a buffer the
        launch owns (:class:`ScratchBuffer`): no allocation after the first call, as CUDA graphs need.
    per_call : tuple of str
        The parameters each call patches, in the order ``__call__`` takes their values (default: the fused kernel's,
        :data:`FUSED_PER_CALL`).

    beside_from : int, optional
        The first launch (an index into ``per_class``) that runs beside the ones before it: from it on the launches
        go to a side stream forked from the current one, which the current stream joins before the call returns
        (:func:`side_stream`; a plan with ``overlap=True``). None: every launch on the current stream.

    A direct launch runs under the device that was current when the launch was prepared (the compiled kernel is
    loaded there); under another one the launch goes through the JIT function.
    """

    def __init__(self, kernel, named: dict, per_class: list, per_call: tuple = FUSED_PER_CALL,
                 beside_from: int | None = None) -> None:
        self.kernel = kernel
        self.beside_from = beside_from
        self.params = _params(kernel, per_call)
        self.launches = []
        self.unsupported = direct_launch_unsupported(kernel)
        self.device = current_device() if self.unsupported is None else None
        self.scratch = None
        for grid, class_args, options, *own in per_class:
            build = own[0] if own else kernel
            prm = _params(build, per_call)
            if prm.per_call != self.params.per_call:  # one patch for every launch: the same per-call parameters
                raise ValueError(f"PreparedLaunch: {build.fn.__name__}'s per-call parameters are not at "
                                 f"{kernel.fn.__name__}'s places")
            if own:
                self.scratch = self.scratch or ScratchBuffer()
            args = [named[n] if n not in class_args else class_args[n] for n in prm.names]
            spec = None
            if self.unsupported is None and direct_launch_unsupported(build) is None:
                spec = (id(build.fn), self.device, tuple(sorted(options.items())), spec_of(args, prm))
            self.launches.append([grid, args, options, spec, _COMPILED.get(spec) if spec is not None else None,
                                  build if own else None])

    @property
    def direct(self) -> tuple[bool, ...]:
        """Per launch: whether the next call launches through the compiled kernel's launcher directly."""
        return tuple(entry[4] is not None for entry in self.launches)

    def __call__(self, kernel, *values) -> None:
        """Launch every class with this layer's ``values`` of the ``per_call`` parameters, on the current stream
        (those from ``beside_from`` on a side stream it forks and joins). ``kernel``: the one to launch now (the
        prepared one, or a test's stand-in put in its place since, which takes the JIT path)."""
        patch = tuple(zip(self.params.per_call, values))
        direct_ok = ALLOW_DIRECT and kernel is self.kernel and self.unsupported is None and _hooks_idle()
        if direct_ok:
            direct_ok = current_device() == self.device
        split = self.beside_from
        if split is None:
            self._run(self.launches, kernel, patch, direct_ok)
            return
        main = torch.cuda.current_stream()
        side = side_stream(main)
        side.wait_stream(main)  # fork: the side launches see everything queued before this call
        try:
            self._run(self.launches[:split], kernel, patch, direct_ok)
            with torch.cuda.stream(side):
                self._run(self.launches[split:], kernel, patch, direct_ok)
        finally:  # join, also after a launch that raised: what follows on the current stream sees both sides
            main.wait_stream(side)

    def _run(self, launches: list, kernel, patch: tuple, direct_ok: bool) -> None:
        """``launches`` (entries of :attr:`launches`) on the current stream."""
        stream = current_stream(self.device) if direct_ok else None
        scratch = self.scratch.lend() if self.scratch is not None else None
        try:
            for entry in launches:
                grid, base, options, spec, compiled, build = entry
                args = base.copy()  # not patched in place: the prepared list keeps no layer's tensors alive
                for i, value in patch:
                    args[i] = value
                if direct_ok and compiled is not None:
                    run, function, metadata = compiled
                    run(grid[0], 1, 1, stream, function, metadata, None, None, None, *args)
                    continue
                compiled = (build or kernel)[grid](*args, **options)
                if direct_ok and spec is not None and _is_compiled(compiled):
                    entry[4] = _remember(spec, compiled)
        finally:
            if scratch is not None:
                self.scratch.give_back(scratch)


class ScratchBuffer:
    """The global scratch of a launch's own builds (the Hopper build's TMA descriptors, 128 bytes a program), which
    Triton's launcher asks its allocator for at every launch: lent as Triton's allocator around the launches
    (:meth:`lend`, :meth:`give_back`), one device buffer, grown only when a launch asks for more than it holds (the
    first call; a grid that grew). Triton's allocator is a context variable: what the caller had set is back after
    the launches."""

    def __init__(self) -> None:
        self.buffer = None

    def __call__(self, size: int, alignment: int, stream) -> "torch.Tensor":
        if self.buffer is None or self.buffer.numel() < size:
            device = torch.device("cuda", torch.cuda.current_device())
            self.buffer = torch.empty(size, dtype=torch.uint8, device=device)  # the caching allocator: 512-aligned
        return self.buffer

    def lend(self):
        return _allocation._allocator.set(self)

    def give_back(self, token) -> None:
        _allocation._allocator.reset(token)


#: :func:`side_stream`'s streams by (device, handle of the stream they fork from).
_SIDE_STREAMS: dict = {}


def side_stream(main: "torch.cuda.Stream") -> "torch.cuda.Stream":
    """The stream a plan's overlapped launches run on beside ``main`` (the current stream), one per stream they
    start from (created at its first use: two engine streams, e.g. two micro-batches, never wait on each other through
    it). The caller forks it from ``main`` and joins it back (:meth:`PreparedLaunch.__call__`), so work and memory
    stay ordered as on one stream for everything before and after the call; under CUDA-graph capture the fork and
    join become the graph's branches."""
    key = (main.device, main.cuda_stream)
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS[key] = torch.cuda.Stream(device=main.device)
    return stream


def _is_compiled(kernel) -> bool:
    """Whether the JIT function returned a loaded ``CompiledKernel`` (not None, nor an async compile's future)."""
    return (kernel is not None and not hasattr(kernel, "result") and getattr(kernel, "function", False) is not False
            and hasattr(kernel, "packed_metadata") and hasattr(kernel, "run"))


def _remember(spec, kernel) -> tuple:
    if len(_COMPILED) >= _MAX_COMPILED:
        _COMPILED.clear()
    compiled = _COMPILED[spec] = (kernel.run, kernel.function, kernel.packed_metadata)
    return compiled


def class_launches(tiles, classes: tuple, grid_items: tuple, ranges, num_kv_heads: int, kv_fp8: bool,
                   nan_guard: bool = False, q_fp32: bool = False, model_switches: bool = False) -> list:
    """``per_class`` of :class:`PreparedLaunch`: each class's grid, class arguments and launch options."""
    per_class = []
    for work_class, items in zip(classes, grid_items):
        options = tiles.launch_options(work_class, kv_fp8=kv_fp8, nan_guard=nan_guard, q_fp32=q_fp32,
                                       model_switches=model_switches)
        heads = options.pop("KV_HEADS")
        class_args = dict(item_range_ptr=ranges[work_class], IS_SHARED=work_class == CLASS_SHARED,
                          BLOCK_M=options.pop("BLOCK_M"), BLOCK_N=options.pop("BLOCK_N"), KV_HEADS=heads)
        per_class.append(((items * (num_kv_heads // heads),), class_args, options))
    return per_class


def with_hopper(per_class: list, index: int, q, k_cache, v_cache, features: dict) -> list:
    """``per_class`` (:func:`class_launches`') with the matrix class of entry ``index`` (shared or chunk) launched by
    its Hopper build (a plan's ``shared_build``/``chunk_build``: :mod:`prefixattn.autotune.builds`), its K/V stages
    one more class argument, its own warps (:func:`~prefixattn.autotune.builds.hopper_num_warps`); ValueError where
    this call's caches (``q``'s dtype, a token's heads side by side, TMA's alignment) or scales (``features``: the
    call's feature arguments) are not what it reads."""
    from prefixattn.kernels.hopper_attention_kernel import hopper_attention_kernel  # Gluon: imported where it runs

    if features["HAS_KV_SCALE"]:
        raise ValueError(f"k_scale/v_scale: the Hopper build ({BUILD_ENV}=hopper) applies no K/V scale; plan with "
                         "the portable build for scaled caches")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        why = hopper_cache_refusal(name, dtype=dtype_name(cache.dtype) if cache.element_size() > 1 else "fp8",
                                   q_dtype=dtype_name(q.dtype), head_dim=q.shape[2], strides=cache.stride(),
                                   element_bytes=cache.element_size(), data_ptr=cache.data_ptr())
        if why is not None:
            raise ValueError(f"{why}: the Hopper build ({BUILD_ENV}=hopper) reads it by TMA")
    grid, class_args, options = per_class[index][:3]
    own = (grid, {**class_args, "STAGES": HOPPER_STAGES, "USE_PDL": False},
           {"num_warps": hopper_num_warps(class_args["BLOCK_M"])}, hopper_attention_kernel)
    return [*per_class[:index], own, *per_class[index + 1:]]


def chained_by_pdl(per_class: list, beside_from: int | None = None) -> list:
    """``per_class`` (:func:`class_launches`') of a plan whose launches chain by programmatic dependent launch
    (``Plan.pdl``: :mod:`prefixattn.autotune.pdl`): every launch of the portable kernel after the first on its stream
    (``beside_from``: :class:`PreparedLaunch`'s) launched as the previous launch's dependent (``launch_pdl``). A
    class's own build (the Hopper build, which has no PDL) keeps an ordinary launch: in series, as without PDL."""
    chained = []
    for index, (grid, class_args, options, *own) in enumerate(per_class):
        if not own and index not in (0, beside_from):
            options = {**options, "launch_pdl": True}
        chained.append((grid, class_args, options, *own))
    return chained


#: The launches prepared per plan and call shape (an engine has one or two shapes): the launcher's memo, not the
#: plan's. Keyed by the plan's id, holding a weak reference to it (a recycled id never matches; a weak-keyed
#: dictionary's lookup makes a weak reference per call, ~0.3 us of every layer); past _MAX_PREPARED plans it starts
#: over (a free plan() per step leaves one entry per step).
_prepared_launches: dict = {}
_MAX_PREPARED = 64


def call_key(q, k_cache, v_cache, out, return_lse, sinks, k_scale, v_scale, *, graph: bool):
    """What the checks and the launch's specialization read of one call's inputs: each tensor's shape, strides,
    dtype, device and 16-byte alignment (this module's :func:`arg_spec`), ``return_lse``, which features are on (a
    float ``v_scale`` of 1 switches ``HAS_KV_SCALE`` off). None for an input that is not what the key describes
    (not a tensor, ``return_lse`` not a bool): the checks then run and name it. Reading no value of any tensor, the
    checks are a function of this key, so a call whose key the plan has seen skips them (~9 us on the 2-core host)."""
    tensors = (q, k_cache, v_cache) if out is None else (q, k_cache, v_cache, out)
    if type(return_lse) is not bool or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    key = [graph, return_lse, out is None]
    try:
        for t in tensors:
            key += (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % SPEC_ALIGN)
        for f in (sinks, k_scale, v_scale):
            key.append(None if f is None else (f.shape, f.stride(), f.dtype, f.device, f.data_ptr() % SPEC_ALIGN)
                       if isinstance(f, torch.Tensor) else bool(f == 1.0) if f is v_scale else type(f))
        key = tuple(key)  # hashable: sizes, tuples of ints, dtypes, devices, ints, bools, types
    except Exception:  # a tensor without strides or data, a scale no float compares with: the checks name it
        return None
    return key


def prepared(p: Plan, key) -> PreparedLaunch | None:
    """The launch prepared for plan ``p`` and a call with ``key``, if ``p`` is still the current plan of its
    workspace."""
    if key is None or type(p) is not Plan or not (p.workspace is None or p.workspace.step == p.workspace_step):
        return None
    hit = _prepared_launches.get(id(p))
    return hit[1].get(key) if hit is not None and hit[0]() is p else None


def prepared_launches(p: Plan) -> dict:
    """The launches prepared for plan ``p`` so far, by call key (inspection and tests; empty before its first
    :func:`attention` call or once the memo started over)."""
    hit = _prepared_launches.get(id(p))
    return dict(hit[1]) if hit is not None and hit[0]() is p else {}


def own_l2_fences(device: torch.device) -> bool:
    """The kernels' ``USE_L2_FENCES`` on a ROCm ``device`` (:func:`~prefixattn.autotune.targets.writes_own_l2_fences`
    of its gfx ISA)."""
    return _own_l2_fences_at(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _own_l2_fences_at(index: int) -> bool:
    return writes_own_l2_fences(gfx_isa(torch.cuda.get_device_properties(index).gcnArchName))


def remember_launch(p: Plan, key, launch: PreparedLaunch) -> None:
    """Keep ``launch`` for plan ``p`` and calls with ``key`` (:data:`_prepared_launches`; not kept for a None key)."""
    if key is None:
        return
    hit = _prepared_launches.get(id(p))
    if hit is None or hit[0]() is not p:
        if len(_prepared_launches) >= _MAX_PREPARED:
            _prepared_launches.clear()
        hit = _prepared_launches[id(p)] = (weakref.ref(p), {})
    if len(hit[1]) >= _MAX_PREPARED:
        hit[1].clear()
    hit[1][key] = launch
