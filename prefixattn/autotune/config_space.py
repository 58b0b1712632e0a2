"""Tile configurations, the spaces they come from, and the prune that keeps only what a target can run.

The fused kernel runs two kinds of programs in one launch (BatchLLM section 4.4): shared-node tiles (all query rows
under a shared prefix node x GQA group in M, GEMM-like) and suffix/decode tiles (one request's rows x GQA group,
GEMV-like). Each kind has its own ``(BLOCK_M, BLOCK_N)``; ``num_warps``, ``num_stages`` and the HIP knobs belong to
the launch and so are shared by both kinds. The merge kernels have their own small space.

Resource estimates here are deliberately simple (element counts per thread, buffers per stage) and only prune what
cannot fit; ``prefixattn compile-check`` measures the real registers, spills and shared memory.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace

from prefixattn.autotune.targets import Target

#: Input dtypes the kernels take, and their element size in bytes.
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
#: Head sizes the fused kernel is tuned for (prefixattn.validation.SUPPORTED_HEAD_DIMS; kept literal so this module
#: stays free of torch).
HEAD_DIMS = (64, 80, 96, 128, 256)
#: tl.dot needs M, N and K >= 16 (NVIDIA mma m16n8k16; the 16x16 MFMA on CDNA).
MIN_DOT_DIM = 16

#: Candidate values per knob (comprehension inputs). Shared tiles are GEMM-shaped (rows of many requests); suffix
#: tiles are decode-shaped (a GQA group of one or a few rows) up to a prefill chunk's 128 rows.
SHARED_BLOCK_M = (16, 32, 64, 128)
SHARED_BLOCK_N = (16, 32, 64, 128)
SUFFIX_BLOCK_M = (16, 32, 64, 128)
SUFFIX_BLOCK_N = (16, 32, 64, 128)
NUM_WARPS = (2, 4, 8)
NUM_STAGES_CUDA = (1, 2, 3, 4)
#: HIP's stream pipeliner: 1 = off, 2 = prefetch through registers into one LDS buffer; more rarely helps attention.
NUM_STAGES_HIP = (1, 2)

#: Registers per thread as a function of the tile words per thread ``w`` (fp32 accumulator, query tile, scores,
#: probabilities and K/V tiles in flight, in 32-bit words): ``max(w + 32, min(scale * w + base, *cap))`` with
#: ``cap = (slope, intercept)`` (no cap on CDNA), fitted to compile-check measurements of the fused kernel.
#: NVIDIA (bf16, head_dim 128, block ids loaded a tile ahead, ptxas of Triton 3.9 for sm_90): small tiles grow ~2
#: registers per word (suffix 16x32 at 4 warps: 62 words -> 126 registers, 16x64: 100 -> 194, 16x64 at 8 warps:
#: 50 -> 80), large ones less (the K/V operands of the shared part's dots stay in shared memory: 128x32 at 8 warps:
#: 136 -> 205, 128x64: 176 -> 232; sm_80, mma.sync: 255, no spills). CDNA: 100-176 words -> 270-410 VGPRs, a ~200
#: register base (addresses, many kernel arguments); 236 words (d256, 64-row suffix tile, 2 warps) spills at 512.
_REG_FIT = {"cuda": (2.0, -10.0), "hip": (1.2, 200.0)}
_REG_CAP = {"cuda": (0.7, 110.0)}
#: The cap holds where the dots read K/V from shared memory (wgmma, sm_90+) with 16-bit inputs only: on sm_80
#: (mma.sync operands in registers) 128x64 tiles at 8 warps spill 168-288 bytes, and IEEE fp32 FMA dots on sm_90
#: spill thousands of bytes at the sizes the cap would admit (compile-check, Triton 3.9).
_REG_CAP_MIN_ARCH = 90
#: IEEE fp32 dots on NVIDIA run on FMA units, each thread holding its own slices of both operands: the register
#: footprint of the tiles grows by half (sm80/sm90: 32x64 tiles spill at head_dim 64, 16x16 fit at 256).
_FMA_DOT_FACTOR = 1.5
#: Fraction of the register limit the estimate may fill: the fit scatters by ~5-10% (measured 126-232 vs estimated
#: 114-233 on sm_90); compile-check measures the real count, and spilling defaults are excluded from the tables.
_REG_HEADROOM = 0.95
#: Score elements each thread should own at least: a tile smaller than the program leaves threads idle.
_MIN_ELEMS_PER_THREAD = 1


#: MLA's class tiles, ``(decode, chunk, shared)`` per ``(is_hip, kv_fp8)``, each ``(BLOCK_M, BLOCK_N, num_warps,
#: num_stages)``, for 16-bit q. Not measured on a GPU yet: the largest tiles that compile without spills at two K/V
#: tiles in flight under Triton 3.6 and 3.9, compiled afresh (a warm Triton cache served stale binaries;
#: ``prefixattn compile-check --kernels mla_attention``: DeepSeek-V3's 512 + 64 at 128 heads). A 64-lane matrix tile
#: (FlashMLA's) spilled 1.9-2.8 KB on sm_90 at 8 warps (its 64 x 512 fp32 accumulator alone is 128 registers a
#: thread): 32 lanes x 32 positions at 8 warps and 3 stages, 210-240 registers and 110 KiB. The decode tile is one
#: row's 16 heads (as vLLM's Triton MLA decode tiles its heads): 16 x 32 at 4 warps and 3 stages spilled 8 bytes on
#: sm_80 under 3.6, 16 x 16 takes 204-210 registers. An fp8 latent's upcasts cost registers: at 4 warps 16 x 16
#: tiles spilled 20 bytes with fp16 q (sm_90), and 32-lane tiles 8-104 bytes at 8 warps under 3.6, so every class
#: runs 16 x 16 tiles at 8 warps: a shared tile then holds one request's 16 heads, and the sharing rule keeps no node
#: at 16 heads (8 heads: two requests a tile). On AMD a 32 x 32 matrix tile at 8 warps (512 threads) spilled 131-449
#: VGPRs and at 4 warps 1 (gfx90a): 32 x 16 at 4 warps; 3 stages of 16 x 32 decode tiles take 72 KiB, over the 64 KiB
#: of LDS: 2. Over an fp8 latent a 16 x 16 decode tile spilled 17-20 VGPRs on gfx90a under 3.6 (e4m3, fp16 q): every
#: class runs the matrix tile there (one binary for chunk and decode).
MLA_TILES = {
    (False, False): ((16, 16, 4, 3), (32, 32, 8, 3), (32, 32, 8, 3)),
    (False, True): ((16, 16, 8, 3), (16, 16, 8, 3), (16, 16, 8, 3)),
    (True, False): ((16, 32, 4, 2), (32, 16, 4, 2), (32, 16, 4, 2)),
    (True, True): ((32, 16, 4, 2), (32, 16, 4, 2), (32, 16, 4, 2)),
}
#: fp32 q (the interpreter's tests, an fp32 model), per ``is_hip``: one 16 x 16 tile at 2 stages for every class, at
#: 8 warps on NVIDIA (4 spilled 348 bytes on sm_80 under 3.6) and 4 on AMD (8 spilled 146-774 VGPRs).
MLA_FP32_TILES = {False: (16, 16, 8, 2), True: (16, 16, 4, 2)}


def mla_class_tiles(*, fp32: bool, kv_fp8: bool, is_hip: bool) -> tuple:
    """``(decode, chunk, shared)`` tiles of the MLA kernel (:data:`MLA_TILES`, :data:`MLA_FP32_TILES`)."""
    return (MLA_FP32_TILES[is_hip],) * 3 if fp32 else MLA_TILES[(is_hip, kv_fp8)]


def block_d(head_dim: int) -> int:
    """The padded head dimension the kernels tile with (power of two, at least the minimum dot size)."""
    return max(MIN_DOT_DIM, pow2_at_least(head_dim))


def pow2_at_least(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 << (max(1, int(x)) - 1).bit_length()


#: The largest padded head size (``BLOCK_D``) at which a decode program attends several KV heads
#: (:attr:`Tiles.kv_heads`); above it, one. sm_90, bf16, LSE, the shipped 16 x 64 decode tile at 4 warps, Triton 3.9:
#: head_dim 256 takes 212 registers at one head and spills 216 / 516 bytes at 2 / 4 (Triton 3.6: 234 at 1, 2 and 4, no
#: spill); at 128 and below no target spills under either (sm_80, sm_90, gfx90a, gfx942: 80-233 registers;
#: compile-check).
KV_HEADS_MAX_BLOCK_D = 128


def packed_kv_heads(kv_heads: int, *, block_d: int, nan_guard: bool) -> int:
    """The KV heads per program a decode binary takes of a tile's ``kv_heads`` (:attr:`Tiles.kv_heads`): one with
    the NaN guard (its redos read one head per program) and above :data:`KV_HEADS_MAX_BLOCK_D`. The one rule of
    :func:`fitted_kv_heads` and compile-check."""
    return 1 if nan_guard or block_d > KV_HEADS_MAX_BLOCK_D else kv_heads


def fitted_kv_heads(kv_heads: int, *, num_kv_heads: int, group: int, block_m: int, block_d: int,
                    nan_guard: bool) -> int:
    """The KV heads per decode program a plan of ``num_kv_heads`` KV heads (GQA ``group``) takes of a tile's
    ``kv_heads``: the largest power of two up to :func:`packed_kv_heads`'s that divides ``num_kv_heads`` and leaves
    the tile a query row (``group * heads <= block_m``). The one rule of the plan
    (:func:`prefixattn.planner.tiles.fit_kv_heads`) and the tuner's candidates."""
    heads = packed_kv_heads(kv_heads, block_d=block_d, nan_guard=nan_guard)
    while heads > 1 and (num_kv_heads % heads or group * heads > block_m):
        heads //= 2
    return heads


@dataclass(frozen=True, order=True)
class Tiles:
    """``(BLOCK_M, BLOCK_N)`` of one kind of program: M packs (query row x GQA head), N is keys per step.

    ``kv_heads`` (a suffix tile only; read for the decode class): KV heads one program attends, side by side in its
    lanes (M packs query row x KV head x GQA head) and in each step's K/V tile (``BLOCK_N`` rows: ``BLOCK_N //
    kv_heads`` positions of each head). One item's block ids and metadata then serve several heads, and a step reads
    the heads of each of its tokens together (:mod:`prefixattn.kernels.prefix_attention_kernel`). A plan takes the
    largest power of two up to it that divides its KV heads and fits its lanes, and one above
    :data:`KV_HEADS_MAX_BLOCK_D` (:func:`prefixattn.planner.tiles.fit_kv_heads`); no shipped table sets it (not yet
    measured on a GPU)."""

    block_m: int
    block_n: int
    kv_heads: int = 1

    def to_dict(self) -> dict:
        """The fields a table stores (``kv_heads`` only when set)."""
        d = asdict(self)
        if self.kv_heads == 1:
            del d["kv_heads"]
        return d

    def short(self) -> str:
        """``16x32``, or ``16x32h4`` with 4 KV heads per program."""
        return f"{self.block_m}x{self.block_n}" + (f"h{self.kv_heads}" if self.kv_heads != 1 else "")


#: Warps of a suffix-only launch over an fp8 K/V cache on NVIDIA. The tables' decode rows are tuned for 16-bit K/V
#: at 4 warps (<= 128 registers, so 4 programs share an SM); the fp8 -> 16-bit conversion of each K/V tile costs
#: registers on top: sm_90, bf16/fp16 q, 4 warps: 137 (d64, 16x64) and 168 (d128, 16x32) registers under Triton 3.9,
#: and an 8-byte spill at d64 under Triton 3.6 (compile-check). At 8 warps the same tiles take 100-106 registers
#: (Triton 3.9) and 127-128 (Triton 3.6), no spill (the compile-check feature jobs check it on every run). AMD is
#: unchanged (its fp8 jobs compile without spills at the tables' options).
FP8_SUFFIX_MIN_WARPS = 8
#: Except tiles of at most this many rows and KV positions, which keep their table's warps: sm_80's bf16 16 x 16
#: decode tiles at head_dim 128 over e5m2 (LSE, 3 stages) at 8 warps: ptxas held them at 80 registers and spilled 12
#: bytes (Triton 3.6 without the model switches, 3.9 with them); at 4 warps 124-128 registers, none (both, with and
#: without; compile-check).
FP8_NARROW_TILE = 16
#: Except decode tiles with narrowed KV tiles (:data:`FP8_LARGE_TILE_ROWS` rows or more, fewer than
#: :data:`FP8_LARGE_HEAD_CHUNK_ROWS`) at a padded head size of :data:`FP8_LARGE_HEAD_DIM`: they run at exactly this many
#: warps. At 8 warps ptxas holds such a program to 128 registers and spills (compile-check, bf16 q, LSE, Triton 3.9,
#: 32 x 16 tiles, 3 stages: sm_90 e4m3 44 bytes, e5m2 44-80; sm_80 e5m2 16; 32 x 32: 12-52), while at 4 warps the
#: same binaries take 214-242 registers and spill nothing, with and without the model switches, on both. 16 x 64 tiles
#: go the other way (4 warps: 255 registers, 104-512 bytes spilled; 8 warps: 128-179, none but sm_90 e5m2 with the
#: model switches, 116), so they keep the rule above.
FP8_LARGE_HEAD_DECODE_WARPS = 4
FP8_LARGE_HEAD_CHUNK_ROWS = 64
#: Stages of a suffix-only NVIDIA launch over an fp8 K/V cache, at most: sm_80, bf16 q, e5m2 K/V, 16 x 64 tiles at 8
#: warps spill 16 bytes at 4 stages (80 registers) and none at 3 (101 registers, 2 tiles in flight: the depth
#: compile-check requires) under Triton 3.9 (compile-check).
FP8_SUFFIX_MAX_STAGES = 3
#: A launch over an fp8 K/V cache with tiles of :data:`FP8_LARGE_TILE_ROWS` rows or more at a padded head size
#: (``BLOCK_D``) of :data:`FP8_LARGE_HEAD_DIM` or more takes KV tiles of at most :data:`FP8_MAX_BLOCK_N` positions:
#: the fp8 -> 16-bit conversion of each K/V tile needs the registers. Compile-check, bf16 q, head_dim 256, LSE,
#: Triton 3.9: sm_90 e4m3, 64 x 32 at 8 warps, 3 stages: shared class 255 registers, 80-96 bytes spilled (88 at 2
#: stages, 560 at 16 warps), 64 x 16: 243, none; chunk class 255 and 176 bytes, 64 x 16: 236, none (244 and none
#: with soft cap and window); gfx90a / gfx942 e4m3, chunk class 64 x 32 at 4 warps with soft cap, window and sinks:
#: 512 VGPRs + AGPRs, 242-346 spilled, 64 x 16: 360-370, none; sm_90 / sm_80, decode class 32 x 32 at 4 warps
#: (:data:`FP8_LARGE_HEAD_DECODE_WARPS`) with the model switches: sm_90 e4m3 255 registers, 20 bytes spilled, e5m2
#: 128; 32 x 16: 214-242 registers, none. 16-row decode tiles fit as they are.
FP8_LARGE_HEAD_DIM = 256
FP8_LARGE_TILE_ROWS = 32
FP8_MAX_BLOCK_N = 16
#: KV positions of a suffix-only NVIDIA launch's tile over an fp8 K/V cache at a padded head size of
#: :data:`FP8_MID_HEAD_DIM`, at most (compile-check, LSE, 8 warps, 3 stages): sm_90 bf16 16 x 64 decode tiles over
#: e5m2: Triton 3.9 128 registers and 40 bytes spilled, 16 x 32: 99 and none (Triton 3.6: 172 and 128, none); its
#: 128 x 64 chunk tiles over e4m3 with every switch and the NaN guard: 255 and 20 bytes (Triton 3.9), 128 x 32: 219,
#: none (both).
FP8_MID_HEAD_DIM = 128
FP8_MID_HEAD_SUFFIX_MAX_BLOCK_N = 32
#: The same launches' decode tiles (:data:`NAN_GUARD_DECODE_ROWS` rows at most) with the NaN guard or a model switch
#: (soft cap, window, sinks), at most. The NaN guard: sm_90 fp16 16 x 32 tiles over e4m3 or e5m2 with every switch:
#: Triton 3.6 128 registers, 8 bytes spilled; 16 x 16: 122, none (Triton 3.9: 98). A model switch: see
#: :data:`FP8_SWITCHED_DECODE_MAX_REGS`.
FP8_DECODE_NARROW_BLOCK_N = 16
#: Registers per thread, at most, of those decode tiles under a model switch without the NaN guard. sm_90 bf16 16 x 32
#: tiles (LSE, scales, 8 warps, 3 stages), Triton 3.6: e4m3 with a window 128 registers and 8 bytes spilled (with
#: every switch too), e4m3 with sinks and e5m2 with any switch 128, none, without a switch 124; Triton 3.9: 122-128,
#: none; another machine's build of the same source held e4m3 with every switch at 127 and none: ptxas's 128-register
#: line (2 programs per SM at 8 warps), crossed by how it happens to allocate. 16 x 16 tiles left to ptxas: e4m3
#: without a switch 80 and 8 bytes (it aims at 3 programs per SM); capped at 128: 90-100 (3.6) and 92-94 (3.9) with
#: and without the switches, e4m3 and e5m2, none (compile-check). 2 programs per SM either way.
FP8_SWITCHED_DECODE_MAX_REGS = 128
#: The kernel's model switches, the ones a model turns on (Gemma 2: soft cap and window; gpt-oss: sinks and window),
#: as opposed to the NaN guard: ``model_switches`` of :meth:`LaunchOptions.for_kv` and :func:`fp8_block_n` says a
#: launch has one of them on.
MODEL_SWITCHES = ("HAS_SOFT_CAP", "HAS_WINDOW", "HAS_SINKS")
#: Warps of a suffix-only NVIDIA launch with the NaN guard (``plan(nan_guard=True)``, the kernel's ``USE_NAN_GUARD``)
#: at a padded head size of :data:`NAN_GUARD_SMALL_HEAD_DIM` or less, at least. At 4 warps Triton 3.6's binaries kept
#: values in local memory across the KV loops at 80-96 registers (compile-check, LSE, every non-fp8 switch: sm_80
#: bf16/fp16, 16 x 32 decode tiles, 4 stages: 8 bytes; sm_90 fp32, 16 x 16: 24 bytes); at 8 warps 80 registers, none
#: (Triton 3.6 and 3.9). Larger heads keep their warps: sm_90's 32 x 32 decode tiles at head_dim 256 fit at 4 warps.
NAN_GUARD_MIN_WARPS = 8
NAN_GUARD_SMALL_HEAD_DIM = 64
#: Warps of a suffix-only NVIDIA launch with 16-bit q and K/V and the NaN guard whose tiles hold at most
#: :data:`NAN_GUARD_DECODE_ROWS` rows (the decode class) at a padded head size of :data:`NAN_GUARD_MID_HEAD_DIM`:
#: at 8 warps Triton 3.8's ptxas held sm_90's bf16 16 x 64 decode binary (LSE, every non-fp8 switch, 3 stages) at
#: 128 registers and spilled 64 bytes (40 at 2 stages); at 4 warps 196 registers, none (Triton 3.9: 200, none).
#: fp32 q keeps its warps: at 4 warps Triton 3.6 spilled sm_80's fp32 16 x 32 decode binary with the guard (16 bytes).
NAN_GUARD_MID_HEAD_DIM = 128
NAN_GUARD_DECODE_ROWS = 16
NAN_GUARD_MID_HEAD_DECODE_WARPS = 4
#: Except tiles of at most this many KV positions, which take at least :data:`NAN_GUARD_MIN_WARPS`: sm_80's fp16 16 x
#: 16 decode tiles (LSE, every non-fp8 switch, 3 stages) at 4 warps: Triton 3.6 128 registers, 16 bytes spilled; at 8
#: warps 124 (Triton 3.9: 98), none.
NAN_GUARD_NARROW_BLOCK_N = 16
#: Registers per thread, at most, of a suffix-only NVIDIA launch with the NaN guard over an fp8 K/V cache whose
#: decode tiles (:data:`NAN_GUARD_DECODE_ROWS` rows at most) have a padded head size of
#: :data:`NAN_GUARD_SMALL_HEAD_DIM` or less (so :data:`NAN_GUARD_MIN_WARPS` warps or more). Left to itself ptxas
#: held sm_80's bf16/fp16 16 x 32 decode binary (LSE, every switch, e5m2, 8 warps, 3 stages) at 80 registers and
#: spilled 24-32 bytes (Triton 3.9, compile-check; 2 stages alike); capped at 128 it takes 120 and spills nothing:
#: 2 programs per SM at 8 warps. The cap is no floor: ptxas fills it (the same launch without the guard: 80
#: registers uncapped, 122 capped), so no other launch has it.
NAN_GUARD_FP8_MAX_REGS = 128


@dataclass(frozen=True, order=True)
class LaunchOptions:
    """Per-launch compile options. HIP-only knobs (``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``) keep their
    Triton defaults (0, 0 = let the compiler pick, 1) on CUDA and are never passed there; the NVIDIA-only
    ``maxnreg`` (registers per thread, at most; 0 = ptxas picks) is set by :meth:`for_kv`'s rules, never by a
    table, and never passed to AMD."""

    num_warps: int = 4
    num_stages: int = 2
    waves_per_eu: int = 0
    matrix_instr_nonkdim: int = 0
    kpack: int = 1
    maxnreg: int = 0

    def for_kv(self, *, has_shared: bool, kv_fp8: bool, is_hip: bool, block_d: int, block_m: int, block_n: int,
               nan_guard: bool = False, q_fp32: bool = False, model_switches: bool = False) -> "LaunchOptions":
        """These options for a launch of ``block_m`` x ``block_n`` tiles (the table's KV tile, before
        :func:`fp8_block_n`) at a padded head size ``block_d`` whose K/V cache is fp8 (when ``kv_fp8``): a
        suffix-only NVIDIA launch gets at most :data:`FP8_SUFFIX_MAX_STAGES` stages and at least
        :data:`FP8_SUFFIX_MIN_WARPS` warps (tiles of at most :data:`FP8_NARROW_TILE` rows and positions keep
        theirs), or exactly :data:`FP8_LARGE_HEAD_DECODE_WARPS` for 32-row decode tiles of large heads. With the NaN
        guard (``nan_guard``) a suffix-only NVIDIA launch at a padded head size of :data:`NAN_GUARD_SMALL_HEAD_DIM`
        or less gets at least :data:`NAN_GUARD_MIN_WARPS` warps, and one of decode tiles at
        :data:`NAN_GUARD_MID_HEAD_DIM` with 16-bit q and K/V (``q_fp32`` false) exactly
        :data:`NAN_GUARD_MID_HEAD_DECODE_WARPS` (at least :data:`NAN_GUARD_MIN_WARPS` with KV tiles of
        :data:`NAN_GUARD_NARROW_BLOCK_N` positions or fewer); the small-head decode tiles of such a launch over an
        fp8 cache at most :data:`NAN_GUARD_FP8_MAX_REGS` registers (``maxnreg``). Without the guard, a suffix-only
        NVIDIA launch of decode tiles over an fp8 cache at :data:`FP8_MID_HEAD_DIM` under a model switch
        (``model_switches``: soft cap, window or sinks) at most :data:`FP8_SWITCHED_DECODE_MAX_REGS`. Everything
        else is unchanged. The one rule (with :func:`fp8_block_n`), used by the launch
        (:meth:`prefixattn.planner.tiles.AttentionTiles.launch_options`), the warm-up and compile-check."""
        lo = self
        if kv_fp8 and not has_shared and not is_hip:
            if block_d >= FP8_LARGE_HEAD_DIM and FP8_LARGE_TILE_ROWS <= block_m < FP8_LARGE_HEAD_CHUNK_ROWS:
                warps = FP8_LARGE_HEAD_DECODE_WARPS
            elif block_m <= FP8_NARROW_TILE and block_n <= FP8_NARROW_TILE:
                warps = self.num_warps
            else:
                warps = max(self.num_warps, FP8_SUFFIX_MIN_WARPS)
            lo = replace(self, num_warps=warps, num_stages=min(self.num_stages, FP8_SUFFIX_MAX_STAGES))
            if (model_switches and not nan_guard and block_d == FP8_MID_HEAD_DIM
                    and block_m <= NAN_GUARD_DECODE_ROWS):
                lo = replace(lo, maxnreg=FP8_SWITCHED_DECODE_MAX_REGS)
        if nan_guard and not has_shared and not is_hip:
            if block_d <= NAN_GUARD_SMALL_HEAD_DIM:
                lo = replace(lo, num_warps=max(lo.num_warps, NAN_GUARD_MIN_WARPS))
                if kv_fp8 and block_m <= NAN_GUARD_DECODE_ROWS:
                    lo = replace(lo, maxnreg=NAN_GUARD_FP8_MAX_REGS)
            elif (not kv_fp8 and not q_fp32 and block_d == NAN_GUARD_MID_HEAD_DIM
                  and block_m <= NAN_GUARD_DECODE_ROWS):
                narrow = block_n <= NAN_GUARD_NARROW_BLOCK_N
                lo = replace(lo, num_warps=max(lo.num_warps, NAN_GUARD_MIN_WARPS) if narrow
                             else NAN_GUARD_MID_HEAD_DECODE_WARPS)
        return lo

    def compile_options(self, target: Target) -> dict:
        """Keyword options for ``triton.compile`` / a kernel launch on ``target``."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if target.is_hip:
            opts.update(waves_per_eu=self.waves_per_eu, matrix_instr_nonkdim=self.matrix_instr_nonkdim,
                        kpack=self.kpack)
        elif self.maxnreg:
            opts["maxnreg"] = self.maxnreg
        return opts

    def short(self) -> str:
        """Compact name for tables and logs: ``w8_s3`` (+ the HIP knobs when set: ``_wpe2_nk16_kp1``)."""
        s = f"w{self.num_warps}_s{self.num_stages}"
        if self.waves_per_eu or self.matrix_instr_nonkdim or self.kpack != 1:
            s += f"_wpe{self.waves_per_eu}_nk{self.matrix_instr_nonkdim}_kp{self.kpack}"
        return s

    def to_dict(self) -> dict:
        """The fields a table or cache stores (``maxnreg`` only where a rule set it)."""
        d = asdict(self)
        if not self.maxnreg:
            del d["maxnreg"]
        return d


def fp8_block_n(block_m: int, block_n: int, *, kv_fp8: bool, block_d: int, has_shared: bool, is_hip: bool,
                nan_guard: bool, model_switches: bool = False) -> int:
    """The KV tile a launch of ``block_m`` x ``block_n`` tiles takes when its K/V cache is fp8: at most
    :data:`FP8_MAX_BLOCK_N` positions from :data:`FP8_LARGE_TILE_ROWS` rows and a padded head size (``block_d``) of
    :data:`FP8_LARGE_HEAD_DIM` on; a suffix-only NVIDIA launch at :data:`FP8_MID_HEAD_DIM` at most
    :data:`FP8_MID_HEAD_SUFFIX_MAX_BLOCK_N`, or :data:`FP8_DECODE_NARROW_BLOCK_N` for decode tiles with the NaN
    guard or a model switch (``model_switches``: soft cap, window or sinks; any KV tile computes the same result:
    the plan's ranges do not depend on it)."""
    if not kv_fp8:
        return block_n
    if block_m >= FP8_LARGE_TILE_ROWS and block_d >= FP8_LARGE_HEAD_DIM:
        return min(block_n, FP8_MAX_BLOCK_N)
    if block_d == FP8_MID_HEAD_DIM and not has_shared and not is_hip:
        if (nan_guard or model_switches) and block_m <= NAN_GUARD_DECODE_ROWS:
            return min(block_n, FP8_DECODE_NARROW_BLOCK_N)
        return min(block_n, FP8_MID_HEAD_SUFFIX_MAX_BLOCK_N)
    return block_n


@dataclass(frozen=True, order=True)
class AttentionConfig:
    """One configuration of the fused kernel: tiles per kind of program plus the launch options they share.

    ``launch`` applies to launches holding shared-node items (``HAS_SHARED=True``: both kinds of programs share one
    warp count and pipeline depth); ``suffix_launch`` to launches of suffix items only (``HAS_SHARED=False``, the
    shared branch compiled out: plain paged decode, split-k), whose small tiles want fewer warps. ``None`` means
    the same as ``launch``.
    """

    shared: Tiles
    suffix: Tiles
    launch: LaunchOptions = LaunchOptions()
    suffix_launch: LaunchOptions | None = None

    def launch_for(self, has_shared: bool) -> LaunchOptions:
        """Launch options of a launch with (or without) shared-node items."""
        return self.launch if has_shared or self.suffix_launch is None else self.suffix_launch

    def to_dict(self) -> dict:
        d = {"shared": self.shared.to_dict(), "suffix": self.suffix.to_dict(), "launch": self.launch.to_dict()}
        if self.suffix_launch is not None:
            d["suffix_launch"] = self.suffix_launch.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionConfig":
        """Inverse of :meth:`to_dict`; ValueError naming the field on anything malformed."""
        try:
            sl = d.get("suffix_launch")
            cfg = cls(shared=Tiles(**d["shared"]), suffix=Tiles(**d["suffix"]),
                      launch=LaunchOptions(**d.get("launch", {})),
                      suffix_launch=LaunchOptions(**sl) if sl is not None else None)
        except (KeyError, TypeError) as e:
            raise ValueError(f"config: expected {{'shared': {{block_m, block_n}}, 'suffix': {{...}}, "
                             f"'launch': {{num_warps, num_stages, ...}}}}, got {d!r} ({e})") from None
        check_config(cfg)
        return cfg

    def short(self) -> str:
        """Compact name for tables and logs: ``sh128x64_sf16x64_w4_s2`` (+ HIP knobs when set)."""
        s = f"sh{self.shared.short()}_sf{self.suffix.short()}_{self.launch.short()}"
        if self.suffix_launch is not None and self.suffix_launch != self.launch:
            s += f"_sf{self.suffix_launch.short()}"
        return s


@dataclass(frozen=True, order=True)
class MergeConfig:
    """Tiles of the merge kernels: ``BLOCK_H`` heads per program (``BLOCK_D`` follows the head size)."""

    block_h: int
    num_warps: int = 4

    def to_dict(self) -> dict:
        return asdict(self)


def _is_pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and (x & (x - 1)) == 0


def check_config(cfg: AttentionConfig) -> None:
    """Structural checks every config must pass (powers of two, dot minimums); ValueError names the field."""
    check_tiles(cfg.shared, "config.shared")
    check_tiles(cfg.suffix, "config.suffix")
    if cfg.shared.kv_heads != 1:
        raise ValueError(f"config.shared.kv_heads: expected 1 (a shared program attends one KV head; kv_heads is the "
                         f"decode tile's), got {cfg.shared.kv_heads!r}")
    check_launch(cfg.launch, "config.launch")
    if cfg.suffix_launch is not None:
        check_launch(cfg.suffix_launch, "config.suffix_launch")


def check_tiles(tiles: Tiles, where: str) -> None:
    """``tiles`` are powers of two of at least the dot minimum; ValueError names the field under ``where``."""
    for name in ("block_m", "block_n"):
        v = getattr(tiles, name)
        if not _is_pow2(v) or v < MIN_DOT_DIM:
            raise ValueError(f"{where}.{name}: expected a power of two >= {MIN_DOT_DIM}, got {v!r}")
    if not _is_pow2(tiles.kv_heads) or tiles.kv_heads > tiles.block_n:
        raise ValueError(f"{where}.kv_heads: expected a power of two <= block_n ({tiles.block_n}), got "
                         f"{tiles.kv_heads!r}")


def check_launch(lo: LaunchOptions, where: str) -> None:
    """``lo`` holds values Triton takes; ValueError names the field under ``where``."""
    if not _is_pow2(lo.num_warps) or lo.num_warps > 16:
        raise ValueError(f"{where}.num_warps: expected a power of two <= 16, got {lo.num_warps!r}")
    if not isinstance(lo.num_stages, int) or lo.num_stages < 1:
        raise ValueError(f"{where}.num_stages: expected an int >= 1, got {lo.num_stages!r}")
    if lo.matrix_instr_nonkdim not in (0, 16, 32):
        raise ValueError(f"{where}.matrix_instr_nonkdim: expected 0, 16 or 32, got {lo.matrix_instr_nonkdim!r}")
    if lo.kpack not in (1, 2):
        raise ValueError(f"{where}.kpack: expected 1 or 2, got {lo.kpack!r}")


# ---------------------------------------------------------------------------------------------------------------
# Resource estimates
# ---------------------------------------------------------------------------------------------------------------

def part_registers(tiles: Tiles, head_dim: int, dtype: str, num_warps: int, target: Target) -> int:
    """Estimated 32-bit registers per thread of one kind of program.

    Live across the KV loop: the fp32 accumulator ``BLOCK_M x BLOCK_D``, the query tile (input dtype), the fp32
    score tile ``BLOCK_M x BLOCK_N`` and its probabilities in the dot dtype, and the K/V tiles being loaded.
    """
    bd = block_d(head_dim)
    b = DTYPE_BYTES[dtype]
    bm, bn = tiles.block_m, tiles.block_n
    words = (bm * bd                  # accumulator, fp32
             + bm * bd * b / 4        # query tile
             + bm * bn                # scores, fp32
             + bm * bn * b / 4        # probabilities fed to the second dot
             + 2 * bn * bd * b / 4)   # K and V tiles in flight
    w = words / (num_warps * target.warp_size)
    if dtype == "fp32" and not target.is_hip:
        w *= _FMA_DOT_FACTOR
    scale, base = _REG_FIT[target.backend]
    fit = scale * w + base
    if target.backend in _REG_CAP and dtype != "fp32" and target.arch >= _REG_CAP_MIN_ARCH:
        slope, intercept = _REG_CAP[target.backend]
        fit = min(fit, slope * w + intercept)
    return int(max(w + 32, fit))


def part_shared_bytes(tiles: Tiles, head_dim: int, dtype: str, num_stages: int, target: Target) -> int:
    """Estimated shared memory (LDS) of one kind of program: pipelined K and V tiles plus one operand staging
    buffer (the query tile, or P on its way from the accumulator layout to the operand layout)."""
    bd = block_d(head_dim)
    b = DTYPE_BYTES[dtype]
    kv = 2 * tiles.block_n * bd * b * target.smem_buffers(num_stages)
    staging = tiles.block_m * max(bd, tiles.block_n) * b
    return kv + staging


# ---------------------------------------------------------------------------------------------------------------
# Spaces and prune
# ---------------------------------------------------------------------------------------------------------------

def launch_space(target: Target) -> list[LaunchOptions]:
    """Every launch option combination ``target`` takes (HIP knobs only on HIP, gfx950 only kpack=1)."""
    if not target.is_hip:
        return [LaunchOptions(num_warps=w, num_stages=s) for w in NUM_WARPS for s in NUM_STAGES_CUDA]
    k = target.hip_knobs
    return [LaunchOptions(num_warps=w, num_stages=s, waves_per_eu=wpe, matrix_instr_nonkdim=nk, kpack=kp)
            for w in NUM_WARPS for s in NUM_STAGES_HIP for wpe in k["waves_per_eu"]
            for nk in k["matrix_instr_nonkdim"] for kp in k["kpack"]]


def attention_space(target: Target) -> list[AttentionConfig]:
    """The unpruned space: every tile of each kind crossed with every launch option of ``target``."""
    shared = [Tiles(m, n) for m in SHARED_BLOCK_M for n in SHARED_BLOCK_N]
    suffix = [Tiles(m, n) for m in SUFFIX_BLOCK_M for n in SUFFIX_BLOCK_N]
    return [AttentionConfig(s, f, lo) for s, f, lo in itertools.product(shared, suffix, launch_space(target))]


def _knob_reason(lo: LaunchOptions, target: Target, tiles: list[Tiles]) -> str | None:
    """Launch options ``target`` does not take, or that do not suit ``tiles``."""
    if target.is_hip:
        if lo.num_stages not in NUM_STAGES_HIP:
            return f"num_stages {lo.num_stages} not used on HIP"
        if lo.kpack not in target.hip_knobs["kpack"]:
            return f"kpack {lo.kpack} not accepted by {target.name}"
        if lo.matrix_instr_nonkdim == 32 and min(min(t.block_m, t.block_n) for t in tiles) < 32:
            return "matrix_instr_nonkdim 32 needs every M and N tile >= 32"
        if lo.kpack == 2 and min(t.block_n for t in tiles) < 32:
            return "kpack 2 needs every KV tile >= 32 (K of the P @ V dot)"
    elif lo.waves_per_eu or lo.matrix_instr_nonkdim or lo.kpack != 1:
        return "HIP knobs set on a CUDA target"
    threads = lo.num_warps * target.warp_size
    for t in tiles:
        if t.block_m * t.block_n < threads * _MIN_ELEMS_PER_THREAD:
            return f"tile {t.block_m}x{t.block_n} too small for {lo.num_warps} warps"
    return None


def register_limit(num_warps: int, target: Target) -> int:
    """Registers one thread may use with ``num_warps`` warps per program: the per-thread maximum, or less when the
    program's threads together would exceed the register file (CDNA: 8 waves share 4 SIMDs, so 256 VGPRs each)."""
    return min(target.max_regs_per_thread, target.regs_per_sm // (num_warps * target.warp_size))


def _resource_reason(regs: int, smem: float, lo: LaunchOptions, target: Target) -> str | None:
    limit = register_limit(lo.num_warps, target)
    if regs > _REG_HEADROOM * limit:
        return f"~{regs} registers/thread > {_REG_HEADROOM:.0%} of {limit}"
    if target.is_hip and lo.waves_per_eu and regs > target.max_regs_per_thread // lo.waves_per_eu:
        return f"waves_per_eu {lo.waves_per_eu} caps registers below the ~{regs} needed (would spill)"
    if smem > target.max_shared_bytes:
        return f"~{int(smem)} B shared memory > {target.max_shared_bytes}"
    return None


def prune_reason(cfg: AttentionConfig, target: Target, *, head_dim: int, dtype: str, group: int = 1,
                 q_rows: int | None = None, max_q_len: int | None = None, kv_len: int | None = None,
                 resources: bool = True, smem_factor: float = 1.0) -> str | None:
    """Why ``cfg`` cannot (or should not) run on ``target`` for this shape, or None when it survives.

    Shape arguments bound the tiles: an M tile holds at least one query row with all of its GQA heads
    (``block_m >= group``) and need not exceed the rows there are (``q_rows`` tokens per shared node,
    ``max_q_len`` tokens per request, times ``group``); a KV tile need not exceed ``kv_len``.
    ``resources=False`` skips the register/shared-memory estimates: for configs whose resources were measured
    (shipped tables are compile-checked, user caches were timed on the device). ``cfg.suffix_launch`` is checked
    against the suffix tiles alone (the shared branch is compiled out of those launches). ``smem_factor`` scales
    the shared-memory estimate (compiled kernels use 0.4-1.1x of it).
    """
    if dtype not in DTYPE_BYTES:
        return f"dtype {dtype!r} not in {tuple(DTYPE_BYTES)}"
    why = _knob_reason(cfg.launch, target, [cfg.shared, cfg.suffix])
    if why:
        return why
    if cfg.suffix_launch is not None:
        why = _knob_reason(cfg.suffix_launch, target, [cfg.suffix])
        if why:
            return f"suffix_launch: {why}"
    g = pow2_at_least(group)
    for part, tiles, rows in (("shared", cfg.shared, q_rows), ("suffix", cfg.suffix, max_q_len)):
        if tiles.block_m < g:
            return f"{part} block_m {tiles.block_m} < GQA group {group}"
        if rows is not None and tiles.block_m > max(MIN_DOT_DIM, g, pow2_at_least(rows * group)):
            return f"{part} block_m {tiles.block_m} exceeds {rows} rows x group {group}"
        if kv_len is not None and tiles.block_n > max(MIN_DOT_DIM, pow2_at_least(kv_len)):
            return f"{part} block_n {tiles.block_n} exceeds kv_len {kv_len}"
    if not resources:
        return None
    # One binary per work class: the shared tiles under the launch, the suffix tiles under the suffix launch.
    for part, tiles, lo in (("shared", cfg.shared, cfg.launch), ("suffix", cfg.suffix, cfg.launch_for(False))):
        why = _resource_reason(part_registers(tiles, head_dim, dtype, lo.num_warps, target),
                               smem_factor * part_shared_bytes(tiles, head_dim, dtype, lo.num_stages, target), lo,
                               target)
        if why:
            return f"{part}: {why}"
    return None


def prune(configs, target: Target, **shape) -> list[AttentionConfig]:
    """The configs of ``configs`` that survive :func:`prune_reason` for this target and shape."""
    return [c for c in configs if prune_reason(c, target, **shape) is None]
