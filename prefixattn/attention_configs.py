"""Default tile sizes of the fused prefix-shared attention kernel, in one place.

The autotune issue replaces the body of :func:`choose_tiles` with a lookup; every caller goes through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixattn.autotune.lookup import select_config

#: tl.dot needs M, N and K >= 16 on NVIDIA tensor cores (mma m16n8k16), so no tile dimension goes below this.
MIN_DOT_DIM = 16
#: Shared tiles pack (query row x GQA head) of many requests into M: 128 rows per program is the FlashAttention-2
#: forward tile on A100/H100, large enough that each KV tile loaded from HBM feeds a full tensor-core matmul.
BLOCK_M_SHARED = 128
#: KV tile of shared programs: 64 keys keeps the 128 x 64 fp32 score tile plus a 128 x head_dim accumulator within the
#: register file for head_dim <= 128 (the FA2 forward choice).
BLOCK_N_SHARED = 64
#: For head_dim 256 the accumulator doubles; halving the KV tile keeps the register budget (and avoids spills).
BLOCK_N_SHARED_LARGE_HEAD = 32
#: Suffix (decode-shaped) tiles pack the GQA group of a few query rows into M, as vLLM's unified attention does: 16
#: is the smallest M tensor cores accept, and decode rarely has more rows to fill it.
BLOCK_M_SUFFIX_DECODE = 16
#: Chunked-prefill suffixes have many rows per request: 64 (row x head) lanes per program balances reuse of each KV
#: tile against the number of programs (a 512-token chunk of a GQA-4 model is 32 programs per KV head).
BLOCK_M_SUFFIX_PREFILL = 64
#: Decode programs are memory-bound on KV: 64 keys per step gives 16-byte vector loads over head_dim and a short
#: serial loop; 32 for head_dim 256 for the same register reason as above.
BLOCK_N_SUFFIX = 64
BLOCK_N_SUFFIX_LARGE_HEAD = 32
#: Head sizes above this use the *_LARGE_HEAD KV tiles.
LARGE_HEAD_DIM = 128
#: fp32 inputs take IEEE fp32 dots (tf32 would miss the 1e-4 tolerance): no tensor cores, each product is FMAs held in
#: registers, so the tiles halve (a 128 x 128 fp32 shared tile also took ~75 s to compile for sm_90 here).
BLOCK_M_SHARED_FP32 = 64
BLOCK_N_FP32 = 32


#: Warps of a launch that holds shared items: the 128 x head_dim fp32 accumulator plus gathered 64-bit KV pointer
#: tiles need 8 warps (sm_90, head_dim 128, fp16: 255 registers and spills at 4 warps, 247 and no spill at 8).
NUM_WARPS_SHARED = 8
#: Warps of a launch with suffix items only (HAS_SHARED=False): decode-shaped tiles are small, and 4 warps leave room
#: for several programs per SM to hide KV load latency (vLLM's unified attention uses 4 as well).
NUM_WARPS_SUFFIX = 4


def _next_power_of_2(n: int) -> int:
    # Plain Python: triton.next_power_of_2 is a jit-dispatched call, ~20 us of plan() time each.
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class AttentionTiles:
    """Compile-time tile sizes of one launch (constexprs of the kernel)."""

    block_m_shared: int
    block_n_shared: int
    block_m_suffix: int
    block_n_suffix: int
    block_d: int
    num_warps_shared: int = NUM_WARPS_SHARED
    num_warps_suffix: int = NUM_WARPS_SUFFIX

    def num_warps(self, has_shared: bool) -> int:
        """One launch, one warp count: the shared branch's needs win when the launch has shared items."""
        return self.num_warps_shared if has_shared else self.num_warps_suffix

    def rows_per_shared_tile(self, group: int) -> int:
        """Query rows one shared program packs: M holds (row x GQA head) pairs."""
        return self.block_m_shared // group

    def rows_per_suffix_tile(self, group: int) -> int:
        return self.block_m_suffix // group


def choose_tiles(*, head_dim: int, group: int, max_q_len: int, dtype=None) -> AttentionTiles:
    """Tile sizes for one plan: every tile choice goes through here.

    The config comes from :func:`prefixattn.autotune.lookup.select_config` (fixed config, the user's tuning cache,
    the shipped table of the current GPU, the cost model, or the heuristic built from the constants above on the CPU
    interpreter and unknown GPUs); it is memoized per shape bucket.

    Parameters
    ----------
    head_dim : int
    group : int
        GQA group size (``num_qo_heads // num_kv_heads``), 1..16.
    max_q_len : int
        Longest query chunk of any request in the step (1 for pure decode).
    dtype : torch.dtype, optional
        Input dtype (fp16 when not given); fp32 gets smaller tiles.

    Returns
    -------
    AttentionTiles, with every M tile at least ``group`` (one query row with all its heads).
    """
    cfg = select_config(head_dim=head_dim, dtype=dtype if dtype is not None else "fp16", group=group,
                        max_q_len=max_q_len).config
    return AttentionTiles(
        block_m_shared=cfg.shared.block_m,
        block_n_shared=cfg.shared.block_n,
        block_m_suffix=cfg.suffix.block_m,
        block_n_suffix=cfg.suffix.block_n,
        block_d=max(_next_power_of_2(head_dim), MIN_DOT_DIM),
        num_warps_shared=cfg.launch_for(True).num_warps,
        num_warps_suffix=cfg.launch_for(False).num_warps,
    )
