"""Which build of the shared class a plan's launch takes: the portable Triton kernel
(:mod:`prefixattn.kernels.prefix_attention_kernel`) or the Hopper build (:mod:`prefixattn.kernels.hopper_shared_kernel`:
K/V by TMA, a loading warp apart from the computing warpgroups), decided here and nowhere else
(:func:`shared_build`), reported in ``Plan.stats["shared_build"]`` with the reason.

Both builds read the same plan and workspace and merge through the same counters; the Hopper build serves
:func:`hopper_shared_refusal`'s shapes. It is taken only where asked for (``PREFIXATTN_SHARED_BUILD=hopper``): it
compiles for sm_90 under Triton 3.6, 3.8 and 3.9 with no spills (``prefixattn compile-check``), but it has not run
on a GPU yet, so the portable kernel stays the default until the GPU check has measured it correct and faster.

No torch or triton import here (dtypes by Triton's names, ``"bf16"``): the planner and the compile-check share it.
"""

from __future__ import annotations

import contextlib
import os

#: The environment variable that asks for a build of the shared class: ``portable`` (the default) or ``hopper``.
SHARED_BUILD_ENV = "PREFIXATTN_SHARED_BUILD"
PORTABLE, HOPPER = "portable", "hopper"
SHARED_BUILDS = (PORTABLE, HOPPER)
#: The Hopper build's target (TMA, warpgroup MMAs and setmaxnreg: sm_90 only; Blackwell's MMAs are others).
HOPPER_ARCH = 90
#: q and K/V element types it serves (one dtype for both: no fp8 cache, whose scales it does not apply).
HOPPER_DTYPES = ("fp16", "bf16")
#: Head sizes it serves: a TMA box is a page of one head, so the head needs no padded lanes (the tile's BLOCK_D). Not
#: 256: its shipped shared tile (64 x 16) at one warpgroup spills under Triton 3.8 (8 bytes, bf16 with LSE, sm_90;
#: 3.6 and 3.9 do not), and at two it computes every row twice.
HOPPER_HEAD_DIMS = (64, 128)
#: Block sizes it serves: the kernel's specialized page sizes (a box's rows are a compile-time constant).
HOPPER_PAGE_SIZES = (16, 32, 64)
#: Feature switches it serves (a shared node masks no key, so the window and the NaN guard change nothing there;
#: sinks join at the merge, which both builds share); ``HAS_KV_SCALE`` and ``HAS_V_HEAD_DIM`` stay portable.
HOPPER_FEATURES = ("HAS_SOFT_CAP", "HAS_WINDOW", "HAS_SINKS", "USE_NAN_GUARD")
#: Query rows one warpgroup's MMAs cover: the build's warps are 4 per 64 rows of its tile (two warpgroups at 128
#: rows; a 64-row tile at 8 warps would compute its rows twice).
HOPPER_ROWS_PER_WARPGROUP = 64
#: K/V tiles in flight in the Hopper build (2: a d128 tile's K and V take 32 KB, with the 32 KB query tile 96 KB of
#: shared memory: one program per SM, as the portable shared binary).
HOPPER_STAGES = 2


_requested: list = []  # the environment's request, read once; asking_for's overrides after it


def requested_shared_build() -> str:
    """The build asked for: the innermost :func:`asking_for`, else ``PREFIXATTN_SHARED_BUILD`` (default
    ``portable``), read once per process (an environment read costs ~0.8 us, every plan would pay it). ``ValueError``
    naming the variable for a value it does not know."""
    if not _requested:
        value = os.environ.get(SHARED_BUILD_ENV, PORTABLE)
        if value not in SHARED_BUILDS:
            raise ValueError(f"{SHARED_BUILD_ENV}: expected one of {', '.join(SHARED_BUILDS)}, got {value!r}")
        _requested.append(value)
    return _requested[-1]


@contextlib.contextmanager
def asking_for(build: str):
    """Plans made inside ask for ``build`` (``portable`` or ``hopper``) whatever the environment says (the GPU check
    times both builds in one process; tests)."""
    if build not in SHARED_BUILDS:
        raise ValueError(f"asking_for: expected one of {', '.join(SHARED_BUILDS)}, got {build!r}")
    requested_shared_build()  # the environment's value stays first
    _requested.append(build)
    try:
        yield
    finally:
        _requested.pop()


def hopper_shared_refusal(*, is_hip: bool, arch, dtype: str, kv_dtype: str | None, head_dim: int,
                          v_head_dim: int | None, block_size: int, block_m: int, block_n: int,
                          features: tuple = ()) -> str | None:
    """Why the Hopper build cannot serve a shared class of these shapes (None: it can). ``arch``: the compute
    capability (``90``) or gfx ISA; ``dtype``/``kv_dtype``: q's and the cache's element types (Triton's names);
    ``block_m``/``block_n``: the shared tile's query lanes and KV positions; ``features``: the feature switches
    on."""
    if is_hip or arch != HOPPER_ARCH:
        return f"sm_{HOPPER_ARCH} only (TMA, warpgroup MMAs, setmaxnreg), not {arch}"
    if dtype not in HOPPER_DTYPES or kv_dtype not in (None, dtype):
        return f"q and K/V of one 16-bit dtype ({'/'.join(HOPPER_DTYPES)}), not {dtype} over {kv_dtype or dtype}"
    if head_dim not in HOPPER_HEAD_DIMS or v_head_dim not in (None, head_dim):
        return (f"head sizes {'/'.join(map(str, HOPPER_HEAD_DIMS))} with values of the keys' size, not "
                f"{head_dim}/{v_head_dim or head_dim}")
    if block_m % HOPPER_ROWS_PER_WARPGROUP:
        return f"tiles of whole warpgroups ({HOPPER_ROWS_PER_WARPGROUP} rows each), not {block_m} rows"
    if block_size not in HOPPER_PAGE_SIZES or block_n % block_size:
        return (f"block sizes {'/'.join(map(str, HOPPER_PAGE_SIZES))} dividing the shared tile's {block_n} keys, "
                f"not {block_size}")
    other = [f for f in features if f not in HOPPER_FEATURES]
    if other:
        return f"not with {', '.join(other)}"
    return None


_DEFAULT = (PORTABLE, f"the default ({SHARED_BUILD_ENV}=hopper asks for the Hopper build)")


def hopper_num_warps(block_m: int) -> int:
    """The Hopper build's warps for a ``block_m``-row tile (the loading warp comes on top)."""
    return 4 * (block_m // HOPPER_ROWS_PER_WARPGROUP)


def shared_build(requested: str, *, interpreted: bool, **shapes) -> tuple[str, str]:
    """``(build, why)``: the build of the shared class a plan's launches take, and why. ``requested``:
    :func:`requested_shared_build`'s; ``interpreted``: the kernels run in Triton's interpreter (Gluon has none);
    ``shapes``: :func:`hopper_shared_refusal`'s arguments."""
    if requested == PORTABLE:
        return _DEFAULT
    if interpreted:
        return PORTABLE, "the kernels run in Triton's interpreter, which has no Gluon"
    refusal = hopper_shared_refusal(**shapes)
    if refusal is not None:
        return PORTABLE, f"the Hopper build serves {refusal}"
    return HOPPER, f"asked for ({SHARED_BUILD_ENV}=hopper), and it serves these shapes"


#: TMA's alignment of a tensor's base address and of its strides (bytes).
TMA_ALIGN = 16


def hopper_cache_refusal(name: str, *, dtype: str, q_dtype: str, head_dim: int, strides: tuple, element_bytes: int,
                         data_ptr: int) -> str | None:
    """Why the Hopper build cannot read cache ``name`` (None: it can): a TMA box is a page of one head, so a
    token's heads must sit side by side (``stride_head == head_dim``, unit ``stride_d``), in q's dtype, with the
    base address and the block and token strides 16-byte aligned. ``strides``: the cache's four strides
    (elements)."""
    s_blk, s_tok, s_head, s_d = strides
    if dtype != q_dtype:
        return f"{name}: expected q's dtype {q_dtype} (no fp8 cache), got {dtype}"
    if s_head != head_dim or s_d != 1:
        return f"{name}: expected a token's heads side by side (strides [.., .., {head_dim}, 1]), got {list(strides)}"
    if data_ptr % TMA_ALIGN or (s_blk * element_bytes) % TMA_ALIGN or (s_tok * element_bytes) % TMA_ALIGN:
        return f"{name}: expected a {TMA_ALIGN}-byte aligned base and block and token strides, got {list(strides)}"
    return None
