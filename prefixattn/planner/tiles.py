"""The fused kernel's compile-time choices for one plan: the tiles and launch options of each work class.

Every tile choice goes through :func:`choose_tiles`, which asks :func:`prefixattn.autotune.lookup.select_config`
(the default tiles and their reasons live there, next to the tables); this module turns the configs into what the
class launches pass, so that every tuned value (tiles, ``num_warps``, ``num_stages``, the HIP knobs) reaches a launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from prefixattn.autotune.buckets import dtype_name
from prefixattn.autotune.config_space import (AttentionConfig, LaunchOptions, block_d, fitted_kv_heads, fp8_block_n,
                                              mla_class_tiles)
from prefixattn.autotune.lookup import READ_FIXED_ENV, select_config, selection_state
from prefixattn.autotune.targets import get_target
from prefixattn.kernels import layout as K
from prefixattn.memo import typed_memo


#: :meth:`AttentionTiles.decode_class_rows` when one binary serves the chunk and decode classes: any query length.
DECODE_CLASS_ALL_ROWS = 2**31 - 1


@dataclass(frozen=True)
class ClassTiles:
    """The binary of one work class (:data:`prefixattn.kernels.layout.WORK_CLASSES`): its tile (``BLOCK_M`` lanes of
    query row x GQA head, ``BLOCK_N`` K/V rows per step) and its launch options; ``kv_heads`` KV heads per program
    (the decode class's, :func:`fit_kv_heads`): its lanes pack (row x KV head x GQA head) and a step's K/V rows
    ``BLOCK_N // kv_heads`` positions of each head."""

    block_m: int
    block_n: int
    launch: LaunchOptions
    kv_heads: int = 1

    def rows(self, group: int) -> int:
        """Query rows one tile packs: M holds (row x KV head x GQA head) triples."""
        return self.block_m // (group * self.kv_heads)

    @property
    def positions_per_step(self) -> int:
        """KV positions of each head one step's K/V tile holds."""
        return self.block_n // self.kv_heads


@dataclass(frozen=True)
class AttentionTiles:
    """The tiles and launch options of one step's launches: one binary per work class (``shared``, ``chunk``,
    ``decode``: :data:`prefixattn.kernels.layout.WORK_CLASSES`), each launched alone, so each has its own registers,
    shared memory and occupancy. ``is_hip`` adds the AMD knobs to the launches.

    ``shared`` and ``decode`` come from the table's decode config (one query row per request), ``chunk`` from the
    config of the step's longest query chunk (its suffix tile and suffix-only launch options).
    """

    shared: ClassTiles
    chunk: ClassTiles
    decode: ClassTiles
    block_d: int
    is_hip: bool = False
    #: :meth:`tile_rows` per GQA group (every plan's stages read them: ~1 us per method call on a 2-core host).
    _rows: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def of(self, work_class: int) -> ClassTiles:
        """The tiles of ``work_class`` (a ``layout.CLASS_*`` index)."""
        return (self.shared, self.chunk, self.decode)[work_class]

    def launch_options(self, work_class: int, kv_fp8: bool = False, nan_guard: bool = False,
                       q_fp32: bool = False, model_switches: bool = False) -> dict:
        """``BLOCK_M``, ``BLOCK_N`` (KV positions per step), ``KV_HEADS``, ``num_warps``, ``num_stages`` (and on AMD
        ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``; on NVIDIA ``maxnreg`` where a rule set it) of the
        launch of ``work_class`` (``kv_fp8``: the K/V cache is fp8; ``nan_guard``: the plan's NaN guard; ``q_fp32``:
        q is fp32; ``model_switches``: the launch has soft-capping, a window or sinks:
        :meth:`~prefixattn.autotune.config_space.LaunchOptions.for_kv` and
        :func:`~prefixattn.autotune.config_space.fp8_block_n`)."""
        has_shared = work_class == K.CLASS_SHARED
        ct = self.of(work_class)
        lo = ct.launch.for_kv(has_shared=has_shared, kv_fp8=kv_fp8, is_hip=self.is_hip, block_d=self.block_d,
                              block_m=ct.block_m, block_n=ct.block_n, nan_guard=nan_guard, q_fp32=q_fp32,
                              model_switches=model_switches)
        block_n = fp8_block_n(ct.block_m, ct.block_n, kv_fp8=kv_fp8, block_d=self.block_d, has_shared=has_shared,
                              is_hip=self.is_hip, nan_guard=nan_guard, model_switches=model_switches)
        # The K/V tile's rows hold kv_heads heads' positions side by side (a narrower fp8 tile, fewer heads).
        heads = min(ct.kv_heads, block_n)
        opts = {"BLOCK_M": ct.block_m, "BLOCK_N": block_n // heads, "KV_HEADS": heads, "num_warps": lo.num_warps,
                "num_stages": lo.num_stages}
        if self.is_hip:
            opts.update(waves_per_eu=lo.waves_per_eu, matrix_instr_nonkdim=lo.matrix_instr_nonkdim, kpack=lo.kpack)
        elif lo.maxnreg:
            opts["maxnreg"] = lo.maxnreg
        return opts

    def rows_per_shared_tile(self, group: int) -> int:
        """Query rows one shared program packs."""
        return self.shared.rows(group)

    def rows_per_chunk_tile(self, group: int) -> int:
        """Query rows of one prefill-chunk tile (a request with more rows than a decode tile holds is cut into
        these); never fewer than a decode tile's."""
        return max(self.chunk.rows(group), self.decode.rows(group))

    def rows_per_decode_tile(self, group: int) -> int:
        """Query rows of one decode tile."""
        return self.decode.rows(group)

    def decode_class_rows(self, group: int) -> int:
        """The most query rows of a request whose suffix tiles belong to the decode class: those that fit one decode
        tile, or every request when the chunk and decode classes share one binary (then one launch serves both)."""
        return DECODE_CLASS_ALL_ROWS if self.chunk == self.decode else self.decode.rows(group)

    def tile_rows(self, group: int) -> "TileRows":
        """The rows per tile and KV tiles of the planner's stages for GQA ``group`` (computed once per group)."""
        rows = self._rows.get(group)
        if rows is None:
            rows = self._rows[group] = TileRows(self, group)
        return rows

    def without_chunk_class(self) -> "AttentionTiles":
        """These tiles with the chunk class run by the decode binary (every suffix tile one class, cut at the
        decode tile's rows): a CUDA-graph wrapper whose steps fit decode tiles launches no chunk class."""
        return replace(self, chunk=self.decode)


class TileRows:
    """What the planner's stages read of :class:`AttentionTiles` for one GQA group
    (:meth:`AttentionTiles.tile_rows`): the attributes are the methods' values, ``split_args`` the split stage's tile
    arguments (:func:`prefixattn.planner.split_rule.split_work`) and ``rule_args`` the request rule's
    (:func:`prefixattn.planner.cost_rule.request_sharing_pays_off`). Shared by every plan with these tiles: read,
    never write."""

    __slots__ = ("rows_per_shared_tile", "rows_per_chunk_tile", "rows_per_decode_tile", "decode_class_rows",
                 "split_args", "rule_args")

    def __init__(self, tiles: AttentionTiles, group: int) -> None:
        self.rows_per_shared_tile = tiles.rows_per_shared_tile(group)
        self.rows_per_chunk_tile = tiles.rows_per_chunk_tile(group)
        self.rows_per_decode_tile = tiles.rows_per_decode_tile(group)
        self.decode_class_rows = tiles.decode_class_rows(group)
        self.rule_args = dict(rows_per_shared=self.rows_per_shared_tile, rows_per_chunk=self.rows_per_chunk_tile,
                              rows_per_decode=self.decode_class_rows)
        self.split_args = dict(self.rule_args, block_n_shared=tiles.shared.block_n,
                               block_n_chunk=tiles.chunk.block_n, block_n_decode=tiles.decode.positions_per_step,
                               decode_kv_heads=tiles.decode.kv_heads)


def tile_head_dim(head_dim: int, v_head_dim: int) -> int:
    """The head size a plan's tiles are chosen for: the wider of K's and V's (the q tile and the accumulator are the
    registers a tile's fit is measured by, and the tables hold one head size for both). Keys 192 and values 128
    (DeepSeek's up-projected MLA prefill) take the head-size-256 tiles: the accumulator's half that V leaves free is
    spare registers, never a spill."""
    return max(head_dim, v_head_dim)


def choose_tiles(*, head_dim: int, group: int, max_q_len: int, dtype=None, fixed_env=READ_FIXED_ENV) -> AttentionTiles:
    """Tile sizes and launch options for one plan.

    The config comes from :func:`prefixattn.autotune.lookup.select_config` (fixed config, the user's tuning cache,
    the shipped table of the current GPU, the cost model, or the heuristic on the CPU interpreter and unknown GPUs);
    it and the tiles are memoized by the arguments and the selection state.

    Parameters
    ----------
    head_dim : int
    group : int
        GQA group size (``num_qo_heads // num_kv_heads``), 1..16.
    max_q_len : int
        Longest query chunk of any request in the step (1 for pure decode).
    dtype : torch.dtype, optional
        Input dtype (fp16 when not given); fp32 gets smaller tiles.
    fixed_env : str or None, optional
        ``PREFIXATTN_TILE_CONFIG`` as the caller read it (:func:`prefixattn.autotune.lookup.read_fixed_env`; a wrapper
        reads it once); by default read now.

    Returns
    -------
    AttentionTiles, with every M tile at least ``group`` (one query row with all its heads).
    """
    # Positional: the memo's key from keywords cost ~0.2 us more per step.
    return _choose_tiles(head_dim, group, max_q_len, dtype, fixed_env, selection_state(fixed_env))


@typed_memo(maxsize=1024)  # plan() asks every step; the lookup chain costs ~5 us a step on the 2-core host
def _choose_tiles(head_dim: int, group: int, max_q_len: int, dtype, fixed_env, state: tuple) -> AttentionTiles:
    """:func:`choose_tiles` under the selection ``state`` (:func:`~prefixattn.autotune.lookup.selection_state` of
    ``fixed_env``, which it holds)."""
    dtype = dtype if dtype is not None else "fp16"
    decode = select_config(head_dim=head_dim, dtype=dtype, group=group, max_q_len=1, fixed_env=fixed_env)
    chunk = decode if max_q_len <= 1 else select_config(head_dim=head_dim, dtype=dtype, group=group,
                                                        max_q_len=max_q_len, fixed_env=fixed_env)
    return tiles_from_configs(decode=decode.config, chunk=chunk.config, head_dim=head_dim,
                              is_hip=_is_hip(decode.target))


def tiles_from_configs(*, decode: AttentionConfig, chunk: AttentionConfig, head_dim: int,
                       is_hip: bool = False) -> AttentionTiles:
    """The class tiles of a step from its table configs: the shared and decode classes from ``decode`` (the config of
    one query row per request: its shared tile and launch, its suffix tile, with its KV heads per program, and
    suffix-only launch), the chunk class from ``chunk`` (the config of the step's longest chunk: its suffix tile and
    suffix-only launch; one KV head per program)."""
    return AttentionTiles(
        shared=ClassTiles(decode.shared.block_m, decode.shared.block_n, decode.launch_for(True)),
        chunk=ClassTiles(chunk.suffix.block_m, chunk.suffix.block_n, chunk.launch_for(False)),
        decode=ClassTiles(decode.suffix.block_m, decode.suffix.block_n, decode.launch_for(False),
                          kv_heads=decode.suffix.kv_heads),
        block_d=block_d(head_dim), is_hip=is_hip)


def fit_kv_heads(tiles: AttentionTiles, *, num_kv_heads: int, group: int, nan_guard: bool) -> AttentionTiles:
    """``tiles`` with the decode class's KV heads per program fitted to a plan: the largest power of two up to the
    table's that divides ``num_kv_heads`` and leaves the tile a query row, of what the binary takes
    (:func:`~prefixattn.autotune.config_space.fitted_kv_heads`). The same object when nothing changes (the planner's
    memos key on it)."""
    if tiles.decode.kv_heads == 1:
        return tiles
    return _fit_kv_heads(tiles, num_kv_heads, group, nan_guard)


@typed_memo(maxsize=256)
def _fit_kv_heads(tiles: AttentionTiles, num_kv_heads: int, group: int, nan_guard: bool) -> AttentionTiles:
    heads = fitted_kv_heads(tiles.decode.kv_heads, num_kv_heads=num_kv_heads, group=group,
                            block_m=tiles.decode.block_m, block_d=tiles.block_d, nan_guard=nan_guard)
    if heads == tiles.decode.kv_heads:
        return tiles
    fitted = replace(tiles.decode, kv_heads=heads)
    return replace(tiles, decode=fitted, chunk=fitted if tiles.chunk == tiles.decode else tiles.chunk)


@typed_memo(maxsize=64)  # one object per shape: the planner's tile-row and cost memos key on it
def mla_tiles(*, kv_lora_rank: int, dtype=None, kv_fp8: bool = False, is_hip: bool | None = None) -> AttentionTiles:
    """The class tiles of an MLA plan (:func:`~prefixattn.autotune.config_space.mla_class_tiles`): BLOCK_D is the
    padded latent width; the rotary lanes are the launch's (:func:`prefixattn.mla.mla_attention`)."""
    is_hip = _torch_is_hip() if is_hip is None else is_hip
    decode, chunk, shared = mla_class_tiles(fp32=dtype is not None and dtype_name(dtype) == "fp32", kv_fp8=kv_fp8,
                                            is_hip=is_hip)

    def cls(tile) -> ClassTiles:
        block_m, block_n, warps, stages = tile
        return ClassTiles(block_m, block_n, LaunchOptions(num_warps=warps, num_stages=stages))

    return AttentionTiles(shared=cls(shared), chunk=cls(chunk), decode=cls(decode), block_d=block_d(kv_lora_rank),
                          is_hip=is_hip)


def _is_hip(target_name: str | None) -> bool:
    """A config from a table names its target; otherwise (heuristic, fixed) the torch build tells AMD from NVIDIA."""
    return get_target(target_name).is_hip if target_name else _torch_is_hip()


def _torch_is_hip() -> bool:
    import torch

    return torch.version.hip is not None
