"""Run-time choice of the fused kernel's config: fixed -> tuned on this GPU -> shipped -> cost model -> heuristic.

:func:`select_config` is called by ``plan()`` (on the host, once per step) and memoizes per (target, bucket): no
tuning, no file access and no device query happens after the first call for a bucket, so nothing here sits in a
timed hot path. The chain, first match wins:

1. **fixed**: :func:`fixed_config` / :func:`set_fixed_config`, or ``PREFIXATTN_TILE_CONFIG`` (a config as JSON, or
   a path to one; read at every :func:`prefixattn.plan`, by a :class:`~prefixattn.PrefixSharedAttention` when it
   checks its options). For deterministic tests and for reproducing a report.
2. no known GPU (CPU interpreter, no device, a device missing from :mod:`~prefixattn.autotune.targets`):
   the **heuristic** (:func:`heuristic_config`), with a one-time warning for an unknown GPU.
3. **user-cache**: measured on this very device by ``prefixattn tune`` (beats anything shipped), nearest bucket
   among entries of the same head size, dtype, GQA group and mode (decode: one query token per request, or not).
   ``plan()`` knows neither the rows per shared node nor the shared KV length before it builds its tree, so exact
   buckets would rarely match.
4. **shipped**: the rows of the package's tile table ``configs/<target>.json`` with its GPU-measured overrides
   (``configs/<target>.measured.json``, where a target has them; :mod:`~prefixattn.autotune.tables`), nearest
   bucket (same head size and dtype, or another head size with the same padded ``BLOCK_D``, or, for a head size no
   table lists, the nearest larger ``BLOCK_D``; bf16 and fp16 stand in for each other).
5. **user-cache** nearest bucket (a device family without a shipped table).
6. **cost-model**: the analytic model's best survivor of the pruned space (:mod:`~prefixattn.autotune.cost_model`).
7. **heuristic**, if nothing survives.

A config from a table or the cache is used only if it fits the shape (``block_m`` at least the GQA group, and so
on); otherwise the next candidate is tried.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import importlib.resources
import json
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from prefixattn.autotune import cost_model
from prefixattn.autotune.buckets import Bucket, distance, make_bucket
from prefixattn.autotune.config_space import (HEAD_DIMS, MIN_DOT_DIM, AttentionConfig, LaunchOptions, MergeConfig, Tiles,
                                              attention_space, block_d, pow2_at_least, prune, prune_reason)
from prefixattn.autotune.tables import read_table
from prefixattn.autotune.targets import Target, detect_target, get_target
from prefixattn.autotune.tuning_cache import TuningCache, cache_path

#: Environment variable holding a fixed config (JSON text or a path to a JSON file).
FIXED_ENV = "PREFIXATTN_TILE_CONFIG"

# Heuristic tiles (the documented default when no table applies). Shared tiles: 128 (row x head) lanes per program,
# the FlashAttention-2 forward M tile, so each KV tile read from HBM feeds a full tensor-core matmul; 64 keys per step
# keeps the 128 x 64 fp32 score tile and the 128 x head_dim accumulator in registers for head_dim <= 128.
HEURISTIC_BLOCK_M_SHARED = 128
HEURISTIC_BLOCK_N = 64
#: head_dim above this doubles the accumulator: halve the KV tile to keep the register budget.
HEURISTIC_LARGE_HEAD_DIM = 128
HEURISTIC_BLOCK_N_LARGE_HEAD = 32
#: Suffix tiles: 16 lanes (the smallest tensor-core M) for decode, where a request rarely has more rows than its
#: GQA group; 64 lanes for prefill chunks (reuse of each KV tile vs. number of programs).
HEURISTIC_BLOCK_M_DECODE = 16
HEURISTIC_BLOCK_M_PREFILL = 64
#: fp32 inputs take IEEE fp32 dots (no tensor cores; each product is FMAs in registers): halve the tiles.
HEURISTIC_BLOCK_M_SHARED_FP32 = 64
HEURISTIC_BLOCK_N_FP32 = 32
#: Launches with shared items need 8 warps for the 128 x head_dim accumulator and the gathered KV pointer tiles
#: (sm_90, head_dim 128, fp16: spills at 4 warps); suffix-only launches take 4 (several programs per SM).
HEURISTIC_LAUNCH = LaunchOptions(num_warps=8, num_stages=3)
HEURISTIC_SUFFIX_LAUNCH = LaunchOptions(num_warps=4, num_stages=3)
#: Merge kernels: fp32 accumulator elements per program (BLOCK_H x BLOCK_D). 4096 fp32 values over 4 warps is 32
#: registers per thread, which leaves room for the two loaded tiles without spilling; a whole 32-head x 128 tile of a
#: Llama-sized model fits in one program.
MERGE_TILE_ELEMS = 4096

SOURCES = ("fixed", "user-cache", "shipped", "user-cache-nearest", "cost-model", "heuristic")


@dataclass(frozen=True)
class Selection:
    """The chosen config, where it came from, the bucket asked for and the bucket whose entry was used."""

    config: AttentionConfig
    source: str
    bucket: Bucket
    matched: Bucket | None = None
    target: str | None = None


# ---------------------------------------------------------------------------------------------------------------
# Fixed-config mode
# ---------------------------------------------------------------------------------------------------------------

_state = threading.local()
#: Bumped by every change of the selection state (fixed configs, planning targets, cleared caches): a memo of
#: selections keyed by :func:`selection_state` never outlives what it was chosen under.
_generation = itertools.count()
_current_generation = [next(_generation)]


def _state_changed() -> None:
    _current_generation[0] = next(_generation)


#: :func:`selection_state`'s, :func:`select_config`'s and ``choose_tiles``' default ``fixed_env``: read
#: ``PREFIXATTN_TILE_CONFIG`` at that call.
READ_FIXED_ENV = object()


def read_fixed_env() -> str | None:
    """``PREFIXATTN_TILE_CONFIG`` now. A caller that plans every step may read it once and pass it as ``fixed_env``
    (an ``os.environ`` read: ~0.7 us; :class:`~prefixattn.PrefixSharedAttention` reads it when it checks its
    options)."""
    return os.environ.get(FIXED_ENV)


def selection_state(fixed_env=READ_FIXED_ENV) -> tuple:
    """What :func:`select_config`'s answer depends on besides its arguments, as a hashable token: this thread's
    fixed config and planning target (by identity), ``PREFIXATTN_TILE_CONFIG`` (``fixed_env``: its value as the
    caller read it, by default read now), and the generation of the selection state. Equal tokens: the same
    selections (used to memoize :func:`~prefixattn.planner.tiles.choose_tiles`, which plan() calls every
    step)."""
    fixed = getattr(_state, "stack", None)
    targets = getattr(_state, "targets", None)
    if not fixed and fixed_env is READ_FIXED_ENV:
        fixed_env = os.environ.get(FIXED_ENV)
    return (_current_generation[0], id(fixed[-1]) if fixed else fixed_env, id(targets[-1]) if targets else None)


def _fixed_stack() -> list:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def set_fixed_config(config: AttentionConfig | dict | None) -> None:
    """Use ``config`` for every selection in this thread from now on (``None`` returns to the chain)."""
    stack = _fixed_stack()
    stack.clear()
    _state_changed()
    if config is not None:
        stack.append(config if isinstance(config, AttentionConfig) else AttentionConfig.from_dict(config))


@contextlib.contextmanager
def fixed_config(config: AttentionConfig | dict):
    """Context manager: every selection inside returns ``config`` (source ``"fixed"``); nests."""
    stack = _fixed_stack()
    stack.append(config if isinstance(config, AttentionConfig) else AttentionConfig.from_dict(config))
    _state_changed()
    try:
        yield stack[-1]
    finally:
        stack.pop()
        _state_changed()


@functools.lru_cache(maxsize=8)
def _parse_fixed_env(value: str) -> AttentionConfig:
    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = Path(value).expanduser().read_text()
        except OSError as e:
            raise ValueError(f"{FIXED_ENV}: expected a config as JSON or a path to a JSON file, got {value!r} "
                             f"({e})") from None
    try:
        return AttentionConfig.from_dict(json.loads(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"{FIXED_ENV}: expected a config as JSON, got unparsable text ({e})") from None


def _current_fixed(fixed_env=READ_FIXED_ENV) -> AttentionConfig | None:
    stack = _fixed_stack()
    if stack:
        return stack[-1]
    env = os.environ.get(FIXED_ENV) if fixed_env is READ_FIXED_ENV else fixed_env
    return _parse_fixed_env(env) if env else None


# ---------------------------------------------------------------------------------------------------------------
# Heuristic and tables
# ---------------------------------------------------------------------------------------------------------------

def heuristic_config(bucket: Bucket, group: int | None = None, max_q_len: int | None = None) -> AttentionConfig:
    """The documented default: FlashAttention-2-like shared tiles, decode- or prefill-shaped suffix tiles.

    Every M tile holds at least one query row with all of its GQA heads. ``group``/``max_q_len``: the real values
    (the bucket rounds them), so decode vs prefill tiles switch exactly where ``group * max_q_len`` passes 16.
    """
    group = group if group is not None else bucket.group
    max_q_len = max_q_len if max_q_len is not None else bucket.max_q_len
    g = pow2_at_least(group)
    fp32 = bucket.dtype == "fp32"
    block_n = HEURISTIC_BLOCK_N_LARGE_HEAD if bucket.head_dim > HEURISTIC_LARGE_HEAD_DIM else HEURISTIC_BLOCK_N
    if fp32:
        block_n = min(block_n, HEURISTIC_BLOCK_N_FP32)
    decode = group * max_q_len <= HEURISTIC_BLOCK_M_DECODE
    suffix_m = HEURISTIC_BLOCK_M_DECODE if decode else HEURISTIC_BLOCK_M_PREFILL
    shared_m = HEURISTIC_BLOCK_M_SHARED_FP32 if fp32 else HEURISTIC_BLOCK_M_SHARED
    return AttentionConfig(shared=Tiles(max(shared_m, g), block_n),
                           suffix=Tiles(max(suffix_m, g, MIN_DOT_DIM), block_n), launch=HEURISTIC_LAUNCH,
                           suffix_launch=HEURISTIC_SUFFIX_LAUNCH)


def heuristic_merge_config(head_dim: int, num_heads: int) -> MergeConfig:
    """Tiles of the merge kernels: all heads of a token in one program while the tile stays within 4096 elements."""
    return MergeConfig(block_h=max(1, min(pow2_at_least(num_heads), MERGE_TILE_ELEMS // block_d(head_dim))),
                       num_warps=4)


def shipped_path(target_name: str, measured: bool = False):
    """The analytic table of ``target_name`` (``configs/<target>.json``, rebuilt by ``prefixattn tune
    --write-shipped``), or with ``measured`` its GPU-measured overrides (``configs/<target>.measured.json``, written
    from a sweep's results by hand and never by the builder)."""
    name = f"{target_name}.measured.json" if measured else f"{target_name}.json"
    return importlib.resources.files("prefixattn.autotune").joinpath("configs", name)


def load_shipped(target_name: str) -> dict[Bucket, AttentionConfig]:
    """The shipped rows of ``target_name`` (:func:`~prefixattn.autotune.tables.read_table`): the analytic table's
    with the measured ones over them, bucket by bucket (empty when the package has neither). A broken shipped file is
    a packaging bug, so it raises (a ValueError naming the file) instead of warning."""
    return _load_shipped(target_name)


@functools.lru_cache(maxsize=None)
def _load_shipped(target_name: str) -> dict[Bucket, AttentionConfig]:
    table: dict[Bucket, AttentionConfig] = {}
    for path in (shipped_path(target_name), shipped_path(target_name, measured=True)):
        if path.is_file():
            table.update(read_table(path, target_name))
    return table


@functools.lru_cache(maxsize=None)
def _user_cache(path: str) -> TuningCache:
    return TuningCache(Path(path))


def _fits(cfg: AttentionConfig, bucket: Bucket, target: Target | None, group: int | None = None) -> bool:
    """Shape checks only (table and cache configs had their resources measured). ``group``: the real GQA group
    (the bucket clamps it)."""
    if target is None:
        return True
    return prune_reason(cfg, target, head_dim=bucket.head_dim, dtype=bucket.dtype,
                        group=group if group is not None else bucket.group, resources=False) is None


def _stand_ins(bucket: Bucket) -> list[tuple[int, str]]:
    """(head_dim, dtype) pairs whose entries may serve ``bucket``, best first: itself, then the other 16-bit dtype,
    then other head sizes with the same padded BLOCK_D (same registers and shared memory)."""
    dtypes = [bucket.dtype] + ([{"fp16": "bf16", "bf16": "fp16"}[bucket.dtype]] if bucket.dtype != "fp32" else [])
    pairs = [(bucket.head_dim, dt) for dt in dtypes]
    same_bd = sorted((h for h in HEAD_DIMS if h != bucket.head_dim and block_d(h) == block_d(bucket.head_dim)),
                     key=lambda h: (abs(h - bucket.head_dim), h))
    pairs += [(h, dt) for h in same_bd for dt in dtypes]
    if bucket.head_dim not in HEAD_DIMS:
        pairs += [(h, dt) for h in _padded_rows(bucket.head_dim) for dt in dtypes]
    return pairs


def _padded_rows(head_dim: int) -> list[int]:
    """Tabled head sizes with a larger padded ``BLOCK_D``, smallest ``BLOCK_D`` and then nearest first: the rows a
    head size without a row of its own falls back to (any multiple of 8 from 32 runs; 32 pads to a 32-wide tile no
    table has). A config that fits the larger tile fits the smaller one (fewer registers and less shared memory)."""
    return sorted((h for h in HEAD_DIMS if block_d(h) > block_d(head_dim)),
                  key=lambda h: (block_d(h), abs(h - head_dim), h))


def nearest_entry(bucket: Bucket, table: dict, target: Target | None, group: int | None = None,
                  stand_ins: bool = True) -> tuple[Bucket, object] | None:
    """The entry of ``table`` (Bucket -> config or cache entry) nearest to ``bucket`` that fits its shape
    (``stand_ins=False``: only entries of the same head size and dtype)."""
    for head_dim, dtype in (_stand_ins(bucket) if stand_ins else [(bucket.head_dim, bucket.dtype)]):
        probe = Bucket(head_dim=head_dim, dtype=dtype, group=bucket.group, q_rows=bucket.q_rows,
                       max_q_len=bucket.max_q_len, kv_len=bucket.kv_len)
        ranked = sorted((distance(probe, b), b) for b in table if b.head_dim == head_dim and b.dtype == dtype)
        for _, b in ranked:
            value = table[b]
            cfg = value if isinstance(value, AttentionConfig) else value.config
            if _fits(cfg, bucket, target, group):
                return b, value
    return None


def cost_model_config(bucket: Bucket, target: Target, group: int | None = None) -> AttentionConfig | None:
    """The analytic model's best config among the survivors of the pruned space, or None if nothing survives."""
    space = attention_space(target)
    survivors = prune(space, target, head_dim=bucket.head_dim, dtype=bucket.dtype,
                      group=group if group is not None else bucket.group, q_rows=bucket.q_rows, max_q_len=bucket.max_q_len, kv_len=bucket.kv_len)
    ranked = cost_model.rank(survivors, bucket, target)
    return ranked[0][1] if ranked and ranked[0][0] != float("inf") else None


# ---------------------------------------------------------------------------------------------------------------
# The chain
# ---------------------------------------------------------------------------------------------------------------

_memo: dict = {}
_memo_lock = threading.Lock()
_warned_devices: set = set()


def clear_caches() -> None:
    """Forget memoized selections and loaded tables (after ``prefixattn tune`` wrote new entries, or in tests)."""
    with _memo_lock:
        _memo.clear()
    _state_changed()
    _load_shipped.cache_clear()
    _user_cache.cache_clear()
    _detect.cache_clear()


@functools.lru_cache(maxsize=None)
def _detect() -> Target | None:
    target = detect_target()
    if target is None:
        _warn_unknown_device()
    return target


def _warn_unknown_device() -> None:
    from prefixattn.runtime import interpreter_enabled

    if interpreter_enabled():
        return
    try:
        import torch

        if not torch.cuda.is_available():
            return
        name = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - a failing device query only means there is no device to warn about
        return
    if name not in _warned_devices:
        _warned_devices.add(name)
        warnings.warn(f"prefixattn: no tile table for device {name!r}; using the heuristic configs "
                      "(see prefixattn/autotune/targets.py to add its target)", stacklevel=4)


def _target_stack() -> list:
    if not hasattr(_state, "targets"):
        _state.targets = []
    return _state.targets


@contextlib.contextmanager
def planning_target(target):
    """Context manager: selections with ``target="auto"`` inside (every ``plan()``) use ``target``, a target name
    or :class:`Target`, instead of the device found here; nests, per thread.

    For planning on a host without that GPU: the full-size benchmark reports the work lists an H100 would run
    (``planning_target("sm90")``), where on a CPU host ``"auto"`` finds no device and uses the heuristic.
    """
    stack = _target_stack()
    stack.append(_resolve_target(target))
    _state_changed()
    try:
        yield stack[-1]
    finally:
        stack.pop()
        _state_changed()


def current_target() -> Target | None:
    """The target selections with ``target="auto"`` use now: the innermost :func:`planning_target`, else this
    process's GPU (None: no known GPU)."""
    stack = _target_stack()
    return stack[-1] if stack else _detect()


def _resolve_target(target) -> Target | None:
    if target == "auto":
        stack = _target_stack()
        return stack[-1] if stack else _detect()
    if target is None or isinstance(target, Target):
        return target
    return get_target(target)


def select_config(*, head_dim: int, dtype, group: int = 1, q_rows: int = 1, max_q_len: int = 1,
                  kv_len: int = 1024, target="auto", cache_dir: Path | None = None,
                  fixed_env=READ_FIXED_ENV) -> Selection:
    """Choose the fused kernel's config for one step (see the module docstring for the chain).

    Parameters
    ----------
    head_dim : int
    dtype : torch.dtype or str (``fp16``/``bf16``/``fp32``)
    group : int
        GQA group size ``num_qo_heads // num_kv_heads``.
    q_rows : int
        Query tokens under one shared prefix node (typical of the step).
    max_q_len : int
        Longest query chunk of any request in the step (1 for pure decode).
    kv_len : int
        KV length of a shared node (typical of the step).
    target : ``"auto"`` (the current device), a target name, a :class:`Target`, or None (no device: heuristic).
    cache_dir : Path, optional
        Directory of the user tuning cache (default: :func:`~prefixattn.autotune.tuning_cache.default_cache_dir`).
    fixed_env : str or None, optional
        ``PREFIXATTN_TILE_CONFIG``'s value as the caller read it (:func:`read_fixed_env`); by default read now.

    Returns
    -------
    Selection

    Examples
    --------
    >>> sel = select_config(head_dim=128, dtype="fp16", group=4, q_rows=256, max_q_len=1, kv_len=2048,
    ...                     target="sm90")
    >>> sel.config.shared.block_m, sel.source
    """
    bucket = make_bucket(head_dim=head_dim, dtype=dtype, group=group, q_rows=q_rows, max_q_len=max_q_len,
                         kv_len=kv_len)
    fixed = _current_fixed(fixed_env)
    if fixed is not None:
        return Selection(fixed, "fixed", bucket)
    tgt = _resolve_target(target)
    key = (tgt.name if tgt else None, bucket, group, max_q_len, str(cache_dir) if cache_dir else None)
    with _memo_lock:
        hit = _memo.get(key)
    if hit is not None:
        return hit
    sel = _select(bucket, tgt, cache_dir, group, max_q_len)
    with _memo_lock:
        _memo[key] = sel
    return sel


def _select(bucket: Bucket, target: Target | None, cache_dir: Path | None, group: int,
            max_q_len: int) -> Selection:
    if target is None:
        return Selection(heuristic_config(bucket, group, max_q_len), "heuristic", bucket)
    name = target.name
    user = _user_cache(str(cache_path(name, cache_dir)))
    same_kind = {b: e for b, e in user.entries.items()
                 if (b.group, b.max_q_len == 1) == (bucket.group, bucket.max_q_len == 1)}
    found = nearest_entry(bucket, same_kind, target, group, stand_ins=False)
    if found is not None:
        return Selection(found[1].config, "user-cache", bucket, found[0], name)
    found = nearest_entry(bucket, load_shipped(name), target, group)
    if found is not None:
        return Selection(found[1], "shipped", bucket, found[0], name)
    found = nearest_entry(bucket, user.entries, target, group)
    if found is not None:
        return Selection(found[1].config, "user-cache-nearest", bucket, found[0], name)
    cfg = cost_model_config(bucket, target, group)
    if cfg is not None:
        return Selection(cfg, "cost-model", bucket, None, name)
    return Selection(heuristic_config(bucket, group, max_q_len), "heuristic", bucket, None, name)
