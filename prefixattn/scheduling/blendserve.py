"""BlendServe's resource-aware order: compute density per node and the dual scanner (BlendServe sec. 2.3, 3.2-3.4).

Per request with prompt length ``p`` and output length ``d`` (BlendServe sec. 2.3):

* ``Comp(r) = ((p + d) * P_model * 2 + p**2 * H * L * 4) / compute``  (GEMMs + prefill attention)
* ``Mem(r) = (p * d + d**2 / 2) * H_kv * L * 4 / bandwidth``          (KV reads while decoding, fp16 K and V)

A node (a group) computes its shared prefix once, so its compute is ``(1 - s) * T_comp`` with ``s`` the saved
share; its density is ``rho = (1 - s) * T_comp / T_mem``. Nodes are sorted by ``rho`` (compute-heavy left,
memory-heavy right) and the dual scanner walks in from both ends, splitting memory between the two cursors so the
blend runs at the root's density: ``M_L + M_R = M`` and ``M_L * rho_L + M_R * rho_R = M * rho_root``.

Simplifications, said plainly: the sort is over the top-level groups (the units the token batcher admits; members
inside a group keep their prefix-tree order), a group larger than ``split_requests`` is split into pieces of
requests sorted by density (each piece recomputes the group's prefix, BlendServe's node splitting with the
threshold expressed as a piece size), and the scanner's memory split becomes an interleaved admission order (the
side that has used less than its share of memory goes next) rather than two runtime partitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from prefixattn.scheduling.grouping import PrefixGroup
from prefixattn.scheduling.group_arrays import first_request, group_arrays, processed_tokens

#: Output length assumed when none is given (BlendServe normalizes chat outputs to a few hundred tokens).
DEFAULT_OUTPUT_LEN = 256
#: Largest piece of one group kept as a unit: BlendServe's batch scheduler works in multiples of 128 requests,
#: and two such batches keep a piece's prefix recomputation (once per piece) negligible.
DEFAULT_SPLIT_REQUESTS = 256
#: Densities are capped here: a request with no output has no memory-bound time (infinite density).
_MAX_DENSITY = 1e9
#: Below this density a request is memory-intensive: its KV reads take longer than its compute (BlendServe sec. 2.3,
#: Fig. 3: outputs beyond ~4K tokens on an 8B model).
MEMORY_INTENSIVE_DENSITY = 1.0


@dataclass(frozen=True)
class DensityModel:
    """Model and GPU constants of BlendServe's cost model (defaults: Llama-3.1-8B on an A100 80GB, fp16).

    Attributes
    ----------
    params : float
        ``P_model``, parameters.
    hidden : int
        ``H``, model width.
    num_layers : int
        ``L``, decoder layers.
    kv_dim : int
        ``H_kv``, K (or V) features per token per layer: ``num_kv_heads * head_dim``.
    compute : float
        Peak fp16 FLOP/s.
    bandwidth : float
        HBM bytes/s.
    """

    params: float = 8.0e9
    hidden: int = 4096
    num_layers: int = 32
    kv_dim: int = 1024
    compute: float = 312e12
    bandwidth: float = 2.0e12

    def comp_time(self, gemm_tokens, prompt_sq):
        """Compute-bound seconds for ``gemm_tokens`` tokens through the GEMMs and ``prompt_sq = sum p**2``."""
        return (np.asarray(gemm_tokens, dtype=np.float64) * self.params * 2
                + np.asarray(prompt_sq, dtype=np.float64) * self.hidden * self.num_layers * 4) / self.compute

    def mem_time(self, prompt_len, output_len):
        """Memory-bound seconds of decoding ``output_len`` tokens after a ``prompt_len`` prompt."""
        p = np.asarray(prompt_len, dtype=np.float64)
        d = np.asarray(output_len, dtype=np.float64)
        return (p * d + d * d / 2) * self.kv_dim * self.num_layers * 4 / self.bandwidth


def densities(groups: Sequence[PrefixGroup], output_lens: np.ndarray, cost_model: DensityModel
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group: ``(rho, comp_seconds, mem_seconds)``, the prefix computed once."""
    owner, ids, lens = group_arrays(groups)
    g = len(groups)
    out = output_lens[ids]
    gemm = processed_tokens(groups) + np.bincount(owner, weights=out, minlength=g)
    comp = cost_model.comp_time(gemm, np.bincount(owner, weights=lens.astype(np.float64) ** 2, minlength=g))
    mem = np.bincount(owner, weights=cost_model.mem_time(lens, out), minlength=g)
    rho = np.where(mem > 0, comp / np.maximum(mem, 1e-300), _MAX_DENSITY)
    return np.minimum(rho, _MAX_DENSITY), comp, mem


def _split(groups: Sequence[PrefixGroup], output_lens: np.ndarray, cost_model: DensityModel,
           split_requests: int) -> list[PrefixGroup]:
    out = []
    for g in groups:
        if g.children or len(g.request_ids) <= split_requests:
            out.append(g)
            continue
        ids = np.asarray(g.request_ids, dtype=np.int64)
        lens = np.asarray(g.prompt_lens, dtype=np.int64)
        d = output_lens[ids]
        mem = cost_model.mem_time(lens, d)
        comp = cost_model.comp_time(lens - g.prefix_len + d, lens.astype(np.float64) ** 2)
        rho = np.minimum(np.where(mem > 0, comp / np.maximum(mem, 1e-300), _MAX_DENSITY), _MAX_DENSITY)
        order = np.lexsort((ids, -rho))
        for start in range(0, ids.size, split_requests):
            part = order[start:start + split_requests]
            out.append(PrefixGroup(prefix_len=g.prefix_len if part.size > 1 else 0,
                                   request_ids=ids[part].tolist(), prompt_lens=lens[part].tolist(),
                                   parent_prefix_len=g.parent_prefix_len, dfs_rank=g.dfs_rank))
    return out


def dual_scan(rho: np.ndarray, memory: np.ndarray, root_rho: float) -> list[int]:
    """Interleave units sorted by descending density from both ends (BlendServe's dual scanner).

    Parameters
    ----------
    rho : np.ndarray
        ``[U]`` densities, sorted descending.
    memory : np.ndarray
        ``[U]`` KV footprint of each unit (any unit; tokens here).
    root_rho : float
        Density the blend should run at (the whole batch's).

    Returns
    -------
    list[int]
        Unit indices in admission order. At each pick the left (compute-heavy) cursor's memory share is
        ``f_L = (rho_root - rho_R) / (rho_L - rho_R)`` (clipped to [0, 1]); the side that has used less than its
        share goes next.

    Examples
    --------
    >>> dual_scan(np.array([4.0, 3.0, 0.5, 0.1]), np.ones(4), 1.0)
    [0, 3, 2, 1]
    """
    left, right = 0, rho.shape[0] - 1
    used_left = used_right = 0.0
    out = []
    while left <= right:
        if left == right:
            out.append(left)
            break
        rl, rr = float(rho[left]), float(rho[right])
        share = 1.0 if rl <= rr else min(1.0, max(0.0, (root_rho - rr) / (rl - rr)))
        if used_left * (1.0 - share) <= used_right * share and share > 0.0:
            out.append(left)
            used_left += float(memory[left])
            left += 1
        else:
            out.append(right)
            used_right += float(memory[right])
            right -= 1
    return out


def blendserve_order(groups: Sequence[PrefixGroup], output_lens: np.ndarray | None = None, *,
                     cost_model: DensityModel | None = None, split_requests: int | None = DEFAULT_SPLIT_REQUESTS,
                     default_output_len: float = DEFAULT_OUTPUT_LEN) -> list[PrefixGroup]:
    """BlendServe order: density-sorted groups interleaved by the dual scanner.

    Parameters
    ----------
    groups : Sequence[PrefixGroup]
        Groups to order.
    output_lens : np.ndarray, optional
        Output length per request id (e.g. estimated by sampling); ``default_output_len`` for all when None.
    cost_model : DensityModel, optional
        Model/GPU constants (default Llama-3.1-8B on A100).
    split_requests : int or None
        Split groups (without nested groups) larger than this into density-sorted pieces; None never splits.
    default_output_len : float
        Output length used when ``output_lens`` is None.

    Returns
    -------
    list[PrefixGroup]
    """
    cost_model = cost_model or DensityModel()
    if split_requests is not None and (isinstance(split_requests, bool) or not isinstance(split_requests, int)
                                       or split_requests < 1):
        raise ValueError(f"split_requests: expected a positive int or None, got {split_requests!r}")
    if output_lens is None:
        n = 1 + max(max(g.request_ids) for g in groups)
        output_lens = np.full(n, float(default_output_len))
    units = _split(groups, output_lens, cost_model, split_requests) if split_requests else list(groups)
    rho, comp, mem = densities(units, output_lens, cost_model)
    order = np.lexsort((first_request(units), -rho))
    root_rho = float(comp.sum() / mem.sum()) if mem.sum() > 0 else _MAX_DENSITY
    owner, ids, _ = group_arrays(units)
    memory = processed_tokens(units) + np.bincount(owner, weights=output_lens[ids], minlength=len(units))
    picks = dual_scan(rho[order], memory[order], root_rho)
    return [units[order[i]] for i in picks]


def memory_classes(groups: Sequence[PrefixGroup], output_lens: np.ndarray, cost_model: DensityModel | None = None, *,
                   threshold: float = MEMORY_INTENSIVE_DENSITY) -> tuple[np.ndarray, np.ndarray]:
    """Split requests into compute-intensive (class 0) and memory-intensive (class 1) and share the KV memory.

    The share is the dual scanner's partition (sec. 3.4) with the two classes' aggregate densities as ``rho_L`` and
    ``rho_R``: solving ``M_L + M_R = M`` and ``M_L rho_L + M_R rho_R = M rho_root`` gives
    ``M_R / M = Mem_R / (Mem_L + Mem_R)``, each class's share of the memory-bound time (of the KV it keeps resident
    over the run), so both classes drain at the same pace. Pass the result to :class:`TokenBatcher`
    (``memory_classes``, ``class_shares``).

    Parameters
    ----------
    groups : Sequence[PrefixGroup]
        The requests (any grouping).
    output_lens : np.ndarray
        Estimated output length per request id.
    cost_model : DensityModel, optional
        Model/GPU constants (default Llama-3.1-8B on A100).
    threshold : float
        Requests with density ``Comp(r) / Mem(r)`` below this are memory-intensive.

    Returns
    -------
    tuple[np.ndarray, np.ndarray]
        ``[num_requests]`` int64 class per request id, and ``[2]`` float64 shares (summing to 1; ``[1, 0]`` when
        nothing is memory-intensive).

    Examples
    --------
    >>> from prefixattn.scheduling import group_prompts
    >>> groups = group_prompts([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    >>> classes, shares = memory_classes(groups, np.array([200.0, 200.0, 16384.0]))
    >>> classes.tolist(), bool(shares[1] > 0.9)
    ([0, 0, 1], True)
    """
    cost_model = cost_model or DensityModel()
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"threshold: expected a density > 0, got {threshold!r}")
    _, ids, lens = group_arrays(groups)
    n = 1 + int(ids.max())
    if output_lens.shape[0] < n:
        raise ValueError(f"output_lens: expected one length per request ({n}), got {output_lens.shape[0]}")
    d = output_lens[ids]
    comp = cost_model.comp_time(lens + d, lens.astype(np.float64) ** 2)
    mem = cost_model.mem_time(lens, d)
    heavy = comp < threshold * mem
    classes = np.zeros(n, np.int64)
    classes[ids[heavy]] = 1
    total = float(mem.sum())
    share = float(mem[heavy].sum()) / total if total > 0 else 0.0
    return classes, np.array([1.0 - share, share])
