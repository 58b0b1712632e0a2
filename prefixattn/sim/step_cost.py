"""Per-step GPU cost model: the time of one engine iteration from what it computes and reads.

One step runs every decoder layer over the step's batched tokens, then the LM head and the sampler on the sequences
that produce a token. Each operator costs ``max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency))`` plus
a launch overhead; GEMMs pay wave quantization over 128x128 output tiles; attention kernels are costed from their
CTAs (work units), so a kernel with one long CTA pays its tail. Attention comes in three kernel kinds:

``paged``
    every sequence reads its whole KV (prefix included); one launch for the prefill part and one for the decode
    part (FlashAttention-2 varlen + paged decode, as vLLM 0.5 runs them);
``cascade``
    FlashInfer-style: one launch per shared level (all queries of a node against its KV once), one for the unique
    suffixes, one merge per level;
``fused``
    prefixattn/BatchLLM: shared-node tiles and suffix tiles in one launch, merged in-kernel; with ``split_k`` the KV
    runs are split when the grid would leave SMs idle (prefixattn's rule, ``split_k_min_tokens`` at least), so no
    single CTA holds the step. Nodes are shared only where prefixattn's cost rule says it pays
    (:meth:`CostModel.sharing_pays_off`).

L2 reuse of prefix groups (:mod:`prefixattn.sim.l2_reuse`): a step's groups (``StepShape.group_lens`` /
``group_runs``, what the batch shares, whether or not the kernel shares it) let rows of one group re-read their
prefix from L2 instead of HBM where the launch issues them close together. The issue order is a property of the
kernel kind (:data:`KERNEL_ROW_ORDER`): ``paged`` and the ``cascade``'s suffix launch walk the batch in its order
(rows held sorted by group: members adjacent); the ``fused`` kernel issues its unshared items longest first with a
group's rows together (the planner's prefix runs); the ``fused`` and ``cascade`` kernels' shared nodes read the prefix
once by construction. Re-read bytes cost L2 bandwidth (``l2_bandwidth x l2_bw_efficiency``): a CTA
takes the longest of its compute, its HBM bytes and the bytes L2 delivers to it (HBM fills plus group re-reads; the
re-reads of a KV head by further query tiles stay outside both, as assumed throughout). Without groups the L2 term
does not bind while the L2 rate is at least the attention HBM rate (the defaults and the fit's bounds keep it so), so
such a step is costed by its HBM bytes alone.

A ``cascade`` without ``split_k`` is one whose backend does not split KV (FlashInfer's fa3 prefill wrappers, what its
multi-level cascade picks on Hopper): its launches stream at ``cascade_attention_factor`` times the paged kernels'
byte rates (1 by default; a fitted value where that backend streams decode-shaped levels slower). Its FLOP rate is
the paged kernels' (fa3 is a fast prefill kernel). With ``split_k`` (the fa2 wrappers) it streams at the paged rates.

Every constant comes from :class:`prefixattn.sim.calibration.Calibration`; the only literals below are unit facts
(2 FLOPs per multiply-add, K and V, 4-byte fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from prefixattn.planner.cost_rule import sharing_pays_off
from prefixattn.sim.calibration import Calibration
from prefixattn.sim.l2_reuse import group_ids_from_lens, issue_order, l2_reuse_tokens
from prefixattn.sim.presets import GIB, HardwarePreset, ModelPreset, get_hardware, get_model

KERNEL_KINDS = ("paged", "cascade", "fused")
#: The order each kernel kind issues its per-sequence work in (:mod:`prefixattn.sim.l2_reuse`): FlashInfer's and
#: vLLM's paged kernels (and the cascade's suffix launch) walk the batch as given; prefixattn's planner issues the
#: items of a work class longest first, a prefix run's items together (``prefixattn.planner.work_list``).
KERNEL_ROW_ORDER = {"paged": "batch", "cascade": "batch", "fused": "runs-longest-first"}
BACKENDS = ("sequential", "overlap")

_FLOPS_PER_MAC = 2
_K_AND_V = 2
_FP32_BYTES = 4
#: GEMM tile shapes considered, as multiples of (gemm_tile_m, gemm_tile_n): the square base tile, its two
#: rectangular doublings and a half-height tile, the usual CUTLASS/cuBLAS candidates for bf16.
_TILE_SHAPES = ((1, 1), (2, 1), (1, 2), (0.5, 1))
#: Row granularity of a tensor-core MMA (m16nXkY): fewer rows still occupy a whole instruction.
_MMA_ROWS = 16


@dataclass
class SharedRun:
    """A KV run read once for several queries in one step (a prefix-tree node with >= 2 members present).

    Attributes
    ----------
    kv_len : int
        Tokens of KV in the node.
    num_queries : int
        New tokens (over all member sequences) attending to it this step.
    level : int
        Depth of the node (1 = first-level prefix); cascade launches one kernel per level.
    """

    kv_len: int
    num_queries: int
    level: int = 1


@dataclass
class StepShape:
    """What one iteration computes.

    Attributes
    ----------
    q_lens : np.ndarray
        ``[num_seqs]`` new tokens per sequence this step (1 for a decode).
    kv_lens : np.ndarray
        ``[num_seqs]`` context length after the step (cached + new tokens).
    num_sampled : int
        Sequences that produce a token this step (decodes + prefills that finish their prompt).
    shared_lens : np.ndarray, optional
        ``[num_seqs]`` tokens of each sequence's KV read through ``shared_nodes`` (0 where none).
    shared_nodes : list of SharedRun
        Nodes read once for their members (cascade / fused kernels only).
    group_lens : np.ndarray, optional
        ``[num_seqs]`` tokens of each sequence's KV inside its prefix group's shared prefix (0 where it is in no group
        of >= 2 sequences this step), whatever the kernel shares: the groups the batch holds. Drives L2 reuse.
    group_runs : list of SharedRun
        The groups of >= 2 sequences: prefix tokens and query rows (a record of the step; the cost reads
        ``group_lens`` and ``group_ids``).
    group_ids : np.ndarray, optional
        ``[num_seqs]`` int group of each sequence (-1: none). Without it, each run of equal nonzero ``group_lens``
        in batch order is one group (:func:`prefixattn.sim.l2_reuse.group_ids_from_lens`).
    """

    q_lens: np.ndarray
    kv_lens: np.ndarray
    num_sampled: int
    shared_lens: np.ndarray | None = None
    shared_nodes: list = field(default_factory=list)
    group_lens: np.ndarray | None = None
    group_runs: list = field(default_factory=list)
    group_ids: np.ndarray | None = None

    def groups(self) -> np.ndarray | None:
        """``[num_seqs]`` int64 group of each sequence (-1: none), or None when the step records no groups."""
        if self.group_lens is None or not np.any(np.asarray(self.group_lens) > 0):
            return None
        if self.group_ids is not None:
            return np.asarray(self.group_ids, dtype=np.int64)
        return group_ids_from_lens(self.group_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.q_lens.sum())

    @property
    def num_seqs(self) -> int:
        return int(self.q_lens.shape[0])


@dataclass
class StepCost:
    """Modeled time of one step, seconds, by part. ``total`` is what the simulated clock advances by;
    ``overlap`` (<= 0) is the time the overlapped backend hides, so the parts add up to ``total``."""

    total: float
    gpu: float
    linear: float
    attention: float
    other: float
    host: float
    launches: int
    launch: float
    overlap: float
    compute_s: float
    memory_s: float


@dataclass
class _Units:
    """Attention work units (CTAs) in count-weighted form: ``count[i]`` CTAs each doing ``flops[i]``, reading
    ``bytes[i]`` from HBM and taking ``l2[i]`` from L2 (its HBM fills plus group re-reads served by L2)."""

    count: list = field(default_factory=list)
    flops: list = field(default_factory=list)
    bytes: list = field(default_factory=list)
    l2: list = field(default_factory=list)

    def add(self, count, flops, nbytes, l2_bytes=None) -> None:
        self.count.append(np.asarray(count, dtype=np.float64).ravel())
        self.flops.append(np.asarray(flops, dtype=np.float64).ravel())
        self.bytes.append(np.asarray(nbytes, dtype=np.float64).ravel())
        self.l2.append(self.bytes[-1] if l2_bytes is None else np.asarray(l2_bytes, dtype=np.float64).ravel())

    def extend(self, other: "_Units") -> None:
        self.count += other.count
        self.flops += other.flops
        self.bytes += other.bytes
        self.l2 += other.l2

    def empty(self) -> bool:
        return not self.count or all(c.size == 0 for c in self.count)


class CostModel:
    """Per-step time and memory model for one (hardware, model) pair.

    Parameters
    ----------
    hardware : str or HardwarePreset
        e.g. ``"a100"``.
    model : str or ModelPreset
        e.g. ``"mistral-7b"``.
    calibration : Calibration, optional
        The constants table (defaults to :data:`prefixattn.sim.calibration.TABLE`).

    Examples
    --------
    >>> import numpy as np
    >>> cm = CostModel("a100", "mistral-7b")
    >>> decode = StepShape(q_lens=np.ones(64, dtype=np.int64), kv_lens=np.full(64, 1500), num_sampled=64)
    >>> 0 < cm.step_cost(decode, kernel="paged").total < 1.0
    True
    """

    def __init__(self, hardware, model, calibration: Calibration | None = None) -> None:
        self.hw: HardwarePreset = get_hardware(hardware)
        self.model: ModelPreset = get_model(model)
        self.calib = calibration or Calibration()
        c, hw = self.calib, self.hw
        self._gemm_flops = hw.peak_flops * c.gemm_efficiency
        self._bw = hw.hbm_bandwidth * c.hbm_efficiency
        self._attn_flops = hw.peak_flops * c.attn_prefill_efficiency
        self._attn_bw = hw.hbm_bandwidth * c.attn_decode_bw_efficiency
        self._l2_bw = hw.l2_bandwidth * c.l2_bw_efficiency
        self._l2_capacity = hw.l2_bytes * c.l2_usable_fraction
        self._slots = hw.num_sms * c.attn_ctas_per_sm
        m = self.model
        geometry = m.attention_geometry()
        self._group, self._kv_heads = geometry.group, geometry.kv_heads
        self._cost_head_dim, self._state_dim = geometry.cost_head_dim, geometry.state_dim
        #: bytes of one KV head of one token in one layer (K and V; MLA: the latent row, both in one)
        self._kv_head_bytes = _K_AND_V * self._cost_head_dim * m.dtype_bytes
        #: bytes of one token in one layer over all KV heads (what a row streams through L2 per token)
        self._kv_token_bytes = m.kv_width * m.dtype_bytes
        self._attn_flops_per_pair = _FLOPS_PER_MAC * geometry.macs_per_pair * m.num_heads
        # elementwise traffic per token per layer: 2x(add+RMSNorm: read x and residual, write both), rotary on q and
        # k (read+write), KV-cache write, SiLU-and-mul (read 2I, write I)
        h, inter = m.hidden_size, m.mlp_active_intermediate
        self._elementwise_bytes_per_token = m.dtype_bytes * (
            2 * (4 * h) + 2 * (m.q_size + m.kv_size) + m.kv_width + 3 * inter)

    # ------------------------------------------------------------------ memory
    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def activation_bytes(self, max_batched_tokens: int) -> int:
        """Peak activation memory of a forward pass over ``max_batched_tokens`` tokens."""
        m = self.model
        dense_mlp = m.intermediate_size if not m.num_experts or m.dense_layers else 0
        widest = max(m.q_size + 2 * m.kv_size, 2 * max(dense_mlp, m.mlp_active_intermediate), m.hidden_size)
        return int(self.calib.activation_copies * max_batched_tokens * widest * m.dtype_bytes)

    def sampler_bytes(self, max_sampled: int) -> int:
        """Peak sampler memory: fp32 logits (and copies) for ``max_sampled`` sequences over the vocabulary."""
        return int(self.calib.sampler_logit_copies * max_sampled * self.model.vocab_size * _FP32_BYTES)

    def kv_pool_tokens(self, memory_fraction: float, max_batched_tokens: int, max_sampled: int,
                       reserved_bytes: int | None = None) -> int:
        """KV-cache capacity in tokens once weights, activations and sampler buffers are placed.

        ``memory_fraction`` of device memory is the engine's budget (vLLM ``gpu_memory_utilization``, SGLang
        ``mem_fraction_static``). ``reserved_bytes`` replaces weights+activations+sampler where a paper states its
        own reservation (BlendServe: 20 GB).
        """
        budget = self.hw.memory_bytes * memory_fraction
        if reserved_bytes is None:
            reserved_bytes = self.weight_bytes + self.activation_bytes(max_batched_tokens) + \
                self.sampler_bytes(max_sampled)
        free = budget - reserved_bytes
        if free <= 0:
            raise ValueError(f"model: {self.model.name} does not fit {self.hw.name} with memory_fraction "
                             f"{memory_fraction}: {reserved_bytes / GIB:.1f} GiB needed before any KV cache")
        return int(free // self.kv_bytes_per_token)

    # ------------------------------------------------------------------ linear layers
    def _gemm(self, m_rows: int, k: int, n: int) -> tuple[float, float]:
        """(compute_s, memory_s) of one [m, k] x [k, n] GEMM.

        Rows are padded to the MMA granularity. When the output has at least one tile per SM the compute pays wave
        quantization (a partial last wave costs a full one), over the best of the tile shapes in
        :data:`_TILE_SHAPES` (scaled from ``gemm_tile_m x gemm_tile_n``), as a GEMM library's heuristic would pick.
        With fewer tiles than SMs the libraries switch to split-K / smaller tiles: no quantization is charged.
        """
        if m_rows <= 0:
            return 0.0, 0.0
        c, hw = self.calib, self.hw
        padded = math.ceil(m_rows / _MMA_ROWS) * _MMA_ROWS
        compute = _FLOPS_PER_MAC * padded * k * n / self._gemm_flops
        best = math.inf
        for fm, fn in _TILE_SHAPES:
            tm, tn = c.gemm_tile_m * fm, c.gemm_tile_n * fn
            tiles = math.ceil(m_rows / tm) * math.ceil(n / tn)
            if tiles < hw.num_sms:
                best = min(best, 1.0)
            else:
                # padded work of the full waves relative to the useful work
                best = min(best, math.ceil(tiles / hw.num_sms) * hw.num_sms * tm * tn / (padded * n))
        compute *= max(best, 1.0)
        memory = (k * n + m_rows * k + m_rows * n) * self.model.dtype_bytes / self._bw
        return compute, memory

    def _expert_gemms(self, num_tokens: int, k: int, n: int, experts: int) -> tuple[float, float]:
        """(compute_s, memory_s) of one grouped GEMM over ``experts`` routed experts: each touched expert multiplies
        its share of the tokens (``experts_per_token / experts`` of them) by its weights. Routing is taken as uniform
        (an assumption): a step of ``T`` tokens touches ``experts x (1 - (1 - top_k / experts)^T)`` experts."""
        top_k = self.model.experts_per_token
        rows = math.ceil(num_tokens * top_k / experts)
        touched = experts * (1.0 - (1.0 - top_k / experts) ** num_tokens)
        compute, memory = self._gemm(rows, k, n)
        return compute * touched, memory * touched

    def linear_time(self, num_tokens: int, num_sampled: int) -> tuple[float, float, float, int]:
        """Decoder GEMMs over all layers + LM head: (time, compute_s, memory_s, launches)."""
        m = self.model
        t = comp = mem = 0.0
        launches = 0
        for layers, gemms in m.layer_kinds():
            lt = lc = lm = 0.0  # one layer of this kind
            for _, k, n, experts in gemms:
                cpt, mm = self._expert_gemms(num_tokens, k, n, experts) if experts else self._gemm(num_tokens, k, n)
                lt, lc, lm = lt + max(cpt, mm), lc + cpt, lm + mm
            t, comp, mem = t + lt * layers, comp + lc * layers, mem + lm * layers
            launches += len(gemms) * layers
        if num_sampled > 0:
            cpt, mm = self._gemm(num_sampled, m.hidden_size, m.vocab_size)
            t, comp, mem, launches = t + max(cpt, mm), comp + cpt, mem + mm, launches + 1
        return t, comp, mem, launches

    def other_time(self, num_tokens: int, num_sampled: int) -> tuple[float, int]:
        """Elementwise kernels of every layer, embedding gather and sampler: (time, launches)."""
        m, c = self.model, self.calib
        per_layer = num_tokens * self._elementwise_bytes_per_token / self._bw
        embed = num_tokens * m.hidden_size * m.dtype_bytes / self._bw
        sampler = c.sampler_passes * num_sampled * m.vocab_size * _FP32_BYTES / self._bw
        launches = int(c.elementwise_kernels_per_layer) * m.num_layers + (1 if num_sampled else 0) + 1
        return per_layer * m.num_layers + embed + sampler, launches

    # ------------------------------------------------------------------ attention
    def sharing_pays_off(self, num_requests, num_rows, kv_tokens) -> bool:
        """The fused kernel's cost rule, the planner's own (:func:`prefixattn.planner.cost_rule.sharing_pays_off`,
        numpy only): share a node when the KV bytes it saves beat the partial-state bytes it adds. The simulator's
        tiles pack ``attn_block_m`` (row x head) pairs; its nodes keep their members' summed rows only, so the rule's
        ``extra_reads`` (members cut into several chunk tiles) stays 0, as the simulator's recorded results assume."""
        m = self.model
        m_tiles = math.ceil(num_rows * self._group / self.calib.attn_block_m)
        return bool(sharing_pays_off(num_requests=num_requests, num_rows=num_rows, num_m_tiles=m_tiles,
                                     num_tokens=kv_tokens, group=self._group, head_dim=self._cost_head_dim,
                                     elt_bytes=m.dtype_bytes))

    def _split_chunk(self, lengths: np.ndarray, counts: np.ndarray) -> int | None:
        """A program-count split-k rule: split only when the unsplit programs leave SMs idle, into chunks of equal KV
        work per SM, never below ``split_k_min_tokens``. This was prefixattn's rule before the critical-path rule of
        :mod:`prefixattn.planner.split_rule`; the simulator keeps it so its calibrated tables stay reproducible (a known
        difference from the library, listed in the README's status)."""
        n_units = float(counts.sum())
        if n_units == 0 or n_units >= self.hw.num_sms:
            return None
        total = float((lengths * counts).sum())
        return int(max(self.calib.split_k_min_tokens, math.ceil(total / self.hw.num_sms)))

    def _seq_units(self, q: np.ndarray, kv: np.ndarray, skip: np.ndarray, split: int | None,
                   reuse: np.ndarray | None = None) -> _Units:
        """CTAs of per-sequence attention: query rows ``q`` against KV positions ``[skip, kv)`` (causal in-chunk);
        ``reuse`` (``[rows]``, optional) tokens of each row's reads that L2 serves instead of HBM."""
        units = _Units()
        if q.size == 0:
            return units
        q = q.astype(np.float64)
        kv = kv.astype(np.float64)
        own = kv - skip
        keep = own > 0
        q, kv, own = q[keep], kv[keep], own[keep]
        if q.size == 0:
            return units
        # (query, key) pairs: earlier context fully, the chunk itself causally
        before = np.maximum(own - q, 0.0)
        pairs = q * before + q * (q + 1) / 2
        m_tiles = np.ceil(q * self._group / self.calib.attn_block_m)
        k_parts = np.ceil(own / split) if split else np.ones_like(own)
        count = self._kv_heads * m_tiles * k_parts
        flops = pairs * self._attn_flops_per_pair / count
        # DRAM traffic: each KV head is streamed once; further query tiles of the same head re-read it from L2
        # (counted in neither level); group re-reads served by L2 leave HBM and stay on L2's side
        through_l2 = (own / k_parts) * self._kv_head_bytes / m_tiles
        if reuse is None:
            units.add(count, flops, through_l2)
        else:
            units.add(count, flops, ((own - reuse[keep]) / k_parts) * self._kv_head_bytes / m_tiles, through_l2)
        return units

    def _reuse(self, step: StepShape, mask: np.ndarray, skip: np.ndarray, kernel: str) -> np.ndarray | None:
        """``[rows in mask]`` tokens of each row's reads that L2 serves in a launch over the ``mask`` rows (their
        group prefix re-read after a nearby member, :mod:`prefixattn.sim.l2_reuse`); None without groups."""
        ids = step.groups()
        if ids is None:
            return None
        kv = step.kv_lens[mask].astype(np.float64)
        own = np.maximum(kv - skip[mask], 0.0)
        in_group = np.clip(np.minimum(np.asarray(step.group_lens, dtype=np.float64)[mask], kv) - skip[mask], 0.0,
                           None)
        order = issue_order(own, KERNEL_ROW_ORDER[kernel], ids[mask])
        return l2_reuse_tokens(own, in_group, ids[mask], order, self._kv_token_bytes, self._l2_capacity)

    def _node_units(self, nodes: list, split: int | None) -> _Units:
        """CTAs of shared nodes: all member queries against the node's KV, read once per query tile."""
        units = _Units()
        if not nodes:
            return units
        p = np.array([n.kv_len for n in nodes], dtype=np.float64)
        nq = np.array([n.num_queries for n in nodes], dtype=np.float64)
        m_tiles = np.ceil(nq * self._group / self.calib.attn_block_m)
        k_parts = np.ceil(p / split) if split else np.ones_like(p)
        count = self._kv_heads * m_tiles * k_parts
        flops = nq * p * self._attn_flops_per_pair / count
        units.add(count, flops, (p / k_parts) * self._kv_head_bytes / m_tiles)
        return units

    def _kernel_time(self, units: _Units, flop_factor: float, bw_factor: float = 1.0) -> tuple[float, float, float]:
        """(time, compute_s, memory_s) of one launch over ``units``: max of the busy waves and the longest CTA.

        ``flop_factor`` scales the attainable FLOP rate only (Triton's attention gap is in the tensor-core pipeline,
        BatchLLM sec. 6.3.3; streaming KV is bandwidth-bound either way); ``bw_factor`` scales the byte rates (HBM
        and L2) of a kernel that streams below the paged kernels' rate (the cascade's ``cascade_attention_factor``).
        """
        if units.empty():
            return 0.0, 0.0, 0.0
        count = np.concatenate(units.count)
        flops = np.concatenate(units.flops)
        nbytes = np.concatenate(units.bytes)
        l2 = np.concatenate(units.l2)
        f_rate, b_rate, l_rate = self._attn_flops * flop_factor, self._attn_bw * bw_factor, self._l2_bw * bw_factor
        # one CTA's time when every slot is busy (it gets 1/slots of the machine): compute, HBM or L2, the slowest
        slot_t = np.maximum(np.maximum(flops / (f_rate / self._slots), nbytes / (b_rate / self._slots)),
                            l2 / (l_rate / self._slots))
        n_units = float(count.sum())
        busy = float((slot_t * count).sum()) / self._slots
        if n_units >= self._slots:
            # a partial last wave costs as long as a full one (units treated as equal-sized for quantization)
            busy *= math.ceil(n_units / self._slots) * self._slots / n_units
        # the longest CTA alone: one SM's compute, a boosted share of bandwidth
        sms = self.hw.num_sms
        boost = self.calib.sm_bandwidth_boost
        alone = np.maximum(np.maximum(flops / (f_rate / sms), nbytes / (b_rate * boost / sms)),
                           l2 / (l_rate * boost / sms))
        total = max(busy, float(alone.max()))
        return total, float((flops * count).sum()) / f_rate, float((nbytes * count).sum()) / b_rate

    def _merge_time(self, partial_rows: float, out_rows: float) -> float:
        """Merge kernel: read fp32 partial states, write the output (memory-bound)."""
        m = self.model
        nbytes = partial_rows * m.num_heads * (self._state_dim + 1) * _FP32_BYTES + \
            out_rows * m.num_heads * self._state_dim * m.dtype_bytes
        return nbytes / self._bw

    def attention_time(self, step: StepShape, kernel: str, split_k: bool = False) -> tuple[float, float, float, int]:
        """Attention over all layers: (time, compute_s, memory_s, launches)."""
        if kernel not in KERNEL_KINDS:
            raise ValueError(f"kernel: expected one of {KERNEL_KINDS}, got {kernel!r}")
        q, kv = step.q_lens, step.kv_lens
        if q.size == 0:
            return 0.0, 0.0, 0.0, 0
        n_layers = self.model.num_layers
        is_decode = q == 1
        zeros = np.zeros_like(kv)
        c = self.calib
        # a cascade that does not split KV (FlashInfer's fa3 backend) may stream below the paged kernels' byte rates
        factor = c.cascade_attention_factor if kernel == "cascade" and not split_k else 1.0
        if kernel == "paged" or (kernel == "cascade" and not step.shared_nodes):
            t = cpt = mem = 0.0
            launches = 0
            for mask in (~is_decode, is_decode):
                if mask.any():
                    units = self._seq_units(q[mask], kv[mask], zeros[mask], None,
                                            self._reuse(step, mask, zeros, kernel))
                    tt, cc, mm = self._kernel_time(units, 1.0, factor)
                    t, cpt, mem, launches = t + tt, cpt + cc, mem + mm, launches + 1
            return t * n_layers, cpt * n_layers, mem * n_layers, launches * n_layers
        shared = step.shared_lens if step.shared_lens is not None and step.shared_nodes else zeros
        rows_shared = float(q[shared > 0].sum())
        nodes = step.shared_nodes
        if kernel == "cascade":
            # FlashInfer: one launch + one merge per level, the suffixes as paged attention; its kernels split KV
            # when the grid is small, like prefixattn's (same rule)
            levels = sorted({n.level for n in nodes})
            t = cpt = mem = 0.0
            for lvl in levels:
                units = self._node_units([n for n in nodes if n.level == lvl], None)
                units = self._maybe_split(units, lambda sp, lv=lvl: self._node_units(
                    [n for n in nodes if n.level == lv], sp))
                tt, cc, mm = self._kernel_time(units, 1.0, factor)
                t, cpt, mem = t + tt + self._merge_time(2 * rows_shared, rows_shared), cpt + cc, mem + mm
            for mask in (~is_decode, is_decode):
                if mask.any():
                    units = self._seq_units(q[mask], kv[mask], shared[mask], None,
                                            self._reuse(step, mask, shared, kernel))
                    tt, cc, mm = self._kernel_time(units, 1.0, factor)
                    t, cpt, mem = t + tt, cpt + cc, mem + mm
            launches = 2 * len(levels) + int((~is_decode).any()) + int(is_decode.any())
            return t * n_layers, cpt * n_layers, mem * n_layers, launches * n_layers
        # fused: shared-node tiles and suffix tiles (prefill and decode) in one launch, merged in-kernel by the last
        # arriving program (no merge launch); the partial states cost traffic. Groups the kernel does not share are
        # read per member, in its longest-first order
        everything = np.ones_like(is_decode)
        reuse = self._reuse(step, everything, shared, kernel)

        def build(sp):
            units = self._node_units(nodes, sp)
            units.extend(self._seq_units(q, kv, shared, sp, reuse))
            return units

        units = build(None)
        split = None
        if split_k:
            units, split = self._maybe_split(units, build, with_chunk=True)
        t, cpt, mem = self._kernel_time(units, c.triton_attention_factor)
        partial_rows = rows_shared * (1 + max((n.level for n in nodes), default=0))
        if split is not None:
            partial_rows += float(q[kv - shared > split].sum())
        if partial_rows:
            t += self._merge_time(partial_rows, 0.0)
        return t * n_layers, cpt * n_layers, mem * n_layers, n_layers

    def _maybe_split(self, units: _Units, build, with_chunk: bool = False):
        """Rebuild ``units`` with split-k chunks when the split rule fires."""
        if units.empty():
            return (units, None) if with_chunk else units
        counts = np.concatenate(units.count)
        # KV tokens of each unit (bytes through L2 / per-token bytes: what it reads, wherever from)
        lengths = np.concatenate(units.l2) / self._kv_head_bytes
        chunk = self._split_chunk(lengths, counts)
        if chunk is None:
            return (units, None) if with_chunk else units
        out = build(chunk)
        return (out, chunk) if with_chunk else out

    # ------------------------------------------------------------------ whole step
    def step_cost(self, step: StepShape, kernel: str = "paged", split_k: bool = False,
                  backend: str = "sequential") -> StepCost:
        """Modeled time of one iteration.

        Parameters
        ----------
        step : StepShape
            The step's sequences, their new tokens and KV lengths, and the shared nodes.
        kernel : {"paged", "cascade", "fused"}
            Attention kernel kind.
        split_k : bool
            Split long KV runs (fused/cascade kernels).
        backend : {"sequential", "overlap"}
            ``overlap`` is a NanoFlow-style engine that runs compute- and memory-bound operators concurrently.

        Returns
        -------
        StepCost
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        n_tok, n_samp, n_seqs = step.num_tokens, step.num_sampled, step.num_seqs
        lin, lin_c, lin_m, lin_launch = self.linear_time(n_tok, n_samp)
        att, att_c, att_m, att_launch = self.attention_time(step, kernel, split_k)
        oth, oth_launch = self.other_time(n_tok, n_samp)
        launches = lin_launch + att_launch + oth_launch
        launch_t = launches * self.hw.launch_overhead_s
        gpu = lin + att + oth + launch_t
        compute_s = lin_c + att_c
        memory_s = lin_m + att_m + oth
        overlap = 0.0
        if backend == "overlap":
            overlapped = min(gpu, max(compute_s, memory_s) / self.calib.overlap_efficiency + launch_t)
            overlap, gpu = overlapped - gpu, overlapped
        host = self.calib.host_step_overhead_s + self.calib.host_per_seq_overhead_s * n_seqs
        return StepCost(total=gpu + host, gpu=gpu, linear=lin, attention=att, other=oth, host=host,
                        launches=launches, launch=launch_t, overlap=overlap, compute_s=compute_s, memory_s=memory_s)


def measured_kernel_time(hardware, *, bytes_moved: float, flops: float, launches: int,
                         calibration: Calibration | None = None) -> float:
    """Modeled time of attention kernels from their measured traffic: the simulator's attention roofline.

    ``max(flops / (peak x attn_prefill_efficiency), bytes_moved / (HBM bandwidth x attn_decode_bw_efficiency))``
    plus ``launches`` x the hardware's launch overhead: the rates :class:`CostModel` uses for attention, applied to
    bytes and FLOPs counted elsewhere (the bench's Triton-interpreter traffic counter). No tail or wave term: those
    need the CTA shapes, which a traffic count does not have.

    Parameters
    ----------
    hardware : str or HardwarePreset
        e.g. ``"a100"``.
    bytes_moved : float
        Bytes loaded and stored by the kernels (>= 0).
    flops : float
        FLOPs they perform (>= 0).
    launches : int
        Kernel launches (>= 0).
    calibration : Calibration, optional

    Returns
    -------
    float
        Seconds (modeled).

    Examples
    --------
    >>> round(measured_kernel_time("a100", bytes_moved=1.427e9, flops=0.0, launches=1) * 1e3, 3)  # 1 GB/ms at 70%
    1.004
    """
    for name, value in (("bytes_moved", bytes_moved), ("flops", flops), ("launches", launches)):
        if not isinstance(value, (int, float, np.integer, np.floating)) or value < 0:
            raise ValueError(f"{name}: expected a number >= 0, got {value!r}")
    hw = get_hardware(hardware)
    c = calibration or Calibration()
    compute = flops / (hw.peak_flops * c.attn_prefill_efficiency)
    memory = bytes_moved / (hw.hbm_bandwidth * c.attn_decode_bw_efficiency)
    return max(compute, memory) + launches * hw.launch_overhead_s
