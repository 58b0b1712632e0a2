"""The fused kernel's compile-time choices for one plan: tiles, page-size specialization and launch options.

Every tile choice goes through :func:`choose_tiles`, which asks :func:`prefixattn.autotune.lookup.select_config`
(the default tiles and their reasons live there, next to the tables); this module turns the config into what the
launch passes, so that every tuned value (tiles, ``num_warps``, ``num_stages``, the HIP knobs) reaches the launch.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixattn.autotune.config_space import LaunchOptions, block_d
from prefixattn.autotune.lookup import READ_FIXED_ENV, select_config, selection_state
from prefixattn.autotune.targets import get_target
from prefixattn.memo import typed_memo

@dataclass(frozen=True)
class AttentionTiles:
    """Compile-time tile sizes of one launch (constexprs of the kernel) and the launch options of the config.

    ``launch_shared`` applies to launches with shared-node items, ``launch_suffix`` to suffix-only launches (the
    shared branch is compiled out there); ``is_hip`` adds the AMD knobs to the launch.
    """

    block_m_shared: int
    block_n_shared: int
    block_m_suffix: int
    block_n_suffix: int
    block_d: int
    launch_shared: LaunchOptions
    launch_suffix: LaunchOptions
    is_hip: bool = False

    def launch_options(self, has_shared: bool, kv_fp8: bool = False) -> dict:
        """``num_warps``, ``num_stages`` (and on AMD ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``) of the
        launch: one launch, one set of options, the shared branch's when the launch has shared items (``kv_fp8``:
        the K/V cache is fp8, :meth:`~prefixattn.autotune.config_space.LaunchOptions.for_kv`)."""
        lo = (self.launch_shared if has_shared else self.launch_suffix).for_kv(has_shared=has_shared, kv_fp8=kv_fp8,
                                                                                 is_hip=self.is_hip)
        opts = {"num_warps": lo.num_warps, "num_stages": lo.num_stages}
        if self.is_hip:
            opts.update(waves_per_eu=lo.waves_per_eu, matrix_instr_nonkdim=lo.matrix_instr_nonkdim, kpack=lo.kpack)
        return opts

    def rows_per_shared_tile(self, group: int) -> int:
        """Query rows one shared program packs: M holds (row x GQA head) pairs."""
        return self.block_m_shared // group

    def rows_per_suffix_tile(self, group: int) -> int:
        return self.block_m_suffix // group


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
    sel = select_config(head_dim=head_dim, dtype=dtype if dtype is not None else "fp16", group=group,
                        max_q_len=max_q_len, fixed_env=fixed_env)
    return _tiles(sel, head_dim)


def _tiles(sel, head_dim: int) -> AttentionTiles:
    cfg = sel.config
    # A config from a table names its target; otherwise (heuristic, fixed) the torch build tells AMD from NVIDIA.
    is_hip = get_target(sel.target).is_hip if sel.target else _torch_is_hip()
    return AttentionTiles(
        block_m_shared=cfg.shared.block_m,
        block_n_shared=cfg.shared.block_n,
        block_m_suffix=cfg.suffix.block_m,
        block_n_suffix=cfg.suffix.block_n,
        block_d=block_d(head_dim),
        launch_shared=cfg.launch_for(True),
        launch_suffix=cfg.launch_for(False),
        is_hip=is_hip,
    )


def _torch_is_hip() -> bool:
    import torch

    return torch.version.hip is not None
