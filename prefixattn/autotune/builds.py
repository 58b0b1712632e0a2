"""Which build of each matrix class a plan's launches take: the portable Triton kernel
(:mod:`prefixattn.kernels.prefix_attention_kernel`) or the Hopper build
(:mod:`prefixattn.kernels.hopper_attention_kernel`: K/V by TMA, a loading warp apart from the computing warpgroups),
decided here and nowhere else (:func:`class_build`, per class), reported in ``Plan.stats`` (``shared_build``,
``chunk_build``) with the reason.

Both builds read the same plan and workspace and merge through the same counters; the Hopper build serves
:func:`hopper_refusal`'s shapes of the shared class and the chunk (prefill) class; the decode class is always the
portable kernel's. It is taken only where asked for (``PREFIXATTN_BUILD=hopper``): it compiles for sm_90 under Triton
3.6, 3.8 and 3.9 with no spills (``prefixattn compile-check``), but it has not run on a GPU yet, so the portable
kernel stays the default until the GPU check has measured it correct and faster.

No torch or triton import here (dtypes by Triton's names, ``"bf16"``): the planner and the compile-check share it.
"""

from __future__ import annotations

from prefixattn.autotune.env_switch import EnvSwitch

#: The environment variable that asks for a build of the matrix classes: ``portable`` (the default) or ``hopper``.
BUILD_ENV = "PREFIXATTN_BUILD"
PORTABLE, HOPPER = "portable", "hopper"
BUILDS = (PORTABLE, HOPPER)
#: The classes the Hopper build serves, by the names ``Plan.stats`` reports them under (``<class>_build``).
HOPPER_CLASSES = ("shared", "chunk")
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
#: Feature switches it serves, per class. Sinks join at the merge, which both builds share. A shared node masks no
#: key, so the window and the NaN guard change nothing there. A chunk tile loads whole pages, so the slots past a
#: request's last key reach its masked tiles: with the NaN guard (non-finite V at unseen keys must not leak) the
#: chunk class stays portable, which loads no key past the range. ``HAS_KV_SCALE`` and ``HAS_V_HEAD_DIM`` stay
#: portable in both.
HOPPER_FEATURES = {"shared": ("HAS_SOFT_CAP", "HAS_WINDOW", "HAS_SINKS", "USE_NAN_GUARD"),
                   "chunk": ("HAS_SOFT_CAP", "HAS_WINDOW", "HAS_SINKS")}
#: Query rows one warpgroup's MMAs cover: the build's warps are 4 per 64 rows of its tile (two warpgroups at 128
#: rows; a 64-row tile at 8 warps would compute its rows twice).
HOPPER_ROWS_PER_WARPGROUP = 64
#: K/V stages of the Hopper build. A tile's stage is freed only once its P @ V product is done, which now runs under
#: the next tile's softmax: two stages are held at once, and a third lets the copies run a tile ahead (at 2 the next
#: tile's copy would start when its turn comes). A stage is 32 KB (K and V of the tile's 64 keys at d128, 128 at d64);
#: with the query tile 115-131 KB of shared memory, and its registers keep one program per SM anyway.
HOPPER_STAGES = 3


#: ``PREFIXATTN_BUILD``, read once per process (:class:`~prefixattn.autotune.env_switch.EnvSwitch`).
_switch = EnvSwitch(BUILD_ENV, {b: b for b in BUILDS}, PORTABLE, "asking_for")


def requested_build() -> str:
    """The build asked for: the innermost :func:`asking_for`, else ``PREFIXATTN_BUILD`` (default ``portable``), read
    once per process. ``ValueError`` naming the variable for a value it does not know."""
    return _switch.requested()


def asking_for(build: str):
    """Plans made inside ask for ``build`` (``portable`` or ``hopper``) whatever the environment says (the GPU check
    times both builds in one process; tests): a context manager."""
    return _switch.asking_for(build)


def hopper_refusal(work_class: str, *, is_hip: bool, arch, dtype: str, kv_dtype: str | None, head_dim: int,
                   v_head_dim: int | None, block_size: int, block_m: int, block_n: int, kv_heads: int = 1,
                   features: tuple = ()) -> str | None:
    """Why the Hopper build cannot serve ``work_class`` (``"shared"`` or ``"chunk"``) of these shapes (None: it can).
    ``arch``: the compute capability (``90``) or gfx ISA; ``dtype``/``kv_dtype``: q's and the cache's element types
    (Triton's names); ``block_m``/``block_n``/``kv_heads``: the class's launch tile (query lanes, KV positions per
    step, KV heads per program); ``features``: the feature switches on."""
    if work_class not in HOPPER_CLASSES:
        return f"the {'/'.join(HOPPER_CLASSES)} classes, not {work_class}"
    if is_hip or arch != HOPPER_ARCH:
        return f"sm_{HOPPER_ARCH} only (TMA, warpgroup MMAs, setmaxnreg), not {arch}"
    if dtype not in HOPPER_DTYPES or kv_dtype not in (None, dtype):
        return f"q and K/V of one 16-bit dtype ({'/'.join(HOPPER_DTYPES)}), not {dtype} over {kv_dtype or dtype}"
    if head_dim not in HOPPER_HEAD_DIMS or v_head_dim not in (None, head_dim):
        return (f"head sizes {'/'.join(map(str, HOPPER_HEAD_DIMS))} with values of the keys' size, not "
                f"{head_dim}/{v_head_dim or head_dim}")
    if block_m % HOPPER_ROWS_PER_WARPGROUP or kv_heads != 1:
        return (f"tiles of whole warpgroups ({HOPPER_ROWS_PER_WARPGROUP} rows each) over one KV head, not {block_m} "
                f"rows over {kv_heads}")
    if block_size not in HOPPER_PAGE_SIZES or block_n % block_size:
        return (f"block sizes {'/'.join(map(str, HOPPER_PAGE_SIZES))} dividing the {work_class} tile's {block_n} "
                f"keys, not {block_size}")
    other = [f for f in features if f not in HOPPER_FEATURES[work_class]]
    if other:
        return f"the {work_class} class not with {', '.join(other)}"
    return None


_DEFAULT = (PORTABLE, f"the default ({BUILD_ENV}=hopper asks for the Hopper build)")


def hopper_num_warps(block_m: int) -> int:
    """The Hopper build's warps for a ``block_m``-row tile (the loading warp comes on top)."""
    return 4 * (block_m // HOPPER_ROWS_PER_WARPGROUP)


def class_build(work_class: str, requested: str, *, interpreted: bool, **shapes) -> tuple[str, str]:
    """``(build, why)``: the build of ``work_class`` (``"shared"``, ``"chunk"``) a plan's launches take, and why.
    ``requested``: :func:`requested_build`'s; ``interpreted``: the kernels run in Triton's interpreter (Gluon has
    none); ``shapes``: :func:`hopper_refusal`'s arguments."""
    if requested == PORTABLE:
        return _DEFAULT
    if interpreted:
        return PORTABLE, "the kernels run in Triton's interpreter, which has no Gluon"
    refusal = hopper_refusal(work_class, **shapes)
    if refusal is not None:
        return PORTABLE, f"the Hopper build serves {refusal}"
    return HOPPER, f"asked for ({BUILD_ENV}=hopper), and it serves these shapes"


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
