"""The simulator's cost model as a per-group cost for :func:`prefixattn.scheduling.partition.partition_groups`.

The partitioner lives in :mod:`prefixattn.scheduling` (numpy only, no simulator); this module is the glue the
design allows (sim imports scheduling, never the reverse). A group's cost is its modeled seconds on one replica
running at steady state, from three terms, each priced by :class:`prefixattn.sim.step_cost.CostModel`:

* prefill tokens after sharing (``group.processed_tokens``) x the per-token time of a full prefill chunk;
* decode tokens x the per-token time of a decode step of a full batch, without attention;
* KV tokens read by decode attention (the KV footprint over the decode): with a prefix-sharing kernel the group's
  shared prefix is read once per step while any member decodes, each member's own context per step; with a paged
  kernel every member reads its whole context.

It ignores what the engine does across groups (batch composition, preemption), which is why the benchmark also runs
the engine per replica; it is monotone in the requests, which is what splitting needs.

:meth:`GroupCostModel.resources` gives the same terms as a :class:`prefixattn.scheduling.partition.ResourceCost`
for the partitioner's two-resource model: ``compute`` (prefill and decode tokens through the GEMMs), ``memory``
(the decode attention's KV reads) and ``critical``, the serial floor of the group's longest decode (one token per
step, every step paying at least a one-sequence step's weight read: no batch makes it shorter). Replicas balanced on
the sum alone can still differ by 25% in simulated time: the one holding the long decodes pays their floor on top
(long decode tails at small batches). Pass ``model.resources`` as the cost: the partitioner then balances
``compute + memory + the largest floor`` per replica and spreads the groups above a fair share of either resource.
"""

from __future__ import annotations

import numpy as np

from prefixattn.scheduling.grouping import PrefixGroup
from prefixattn.scheduling.partition import ResourceCost
from prefixattn.sim.step_cost import KERNEL_KINDS, CostModel, StepShape

#: Context length of the probe decode steps whose difference prices one KV token read (a typical prompt; the
#: attention term is linear in it, so the choice moves only the host-overhead share).
_PROBE_KV_LEN = 2048
#: Tokens generated per request when no output lengths are given (BatchLLM assumes a constant; this is vLLM's
#: default ``max_tokens`` order of magnitude for offline jobs).
DEFAULT_OUTPUT_LEN = 128


class GroupCostModel:
    """``cost(group) -> float``: modeled seconds of a prefix group on one replica.

    Parameters
    ----------
    cost : CostModel
        e.g. ``CostModel("a100", "mistral-7b")``.
    output_lens : array-like of int, optional
        ``[num_requests]`` expected output tokens per request id; :data:`DEFAULT_OUTPUT_LEN` each when None.
    kernel : {"fused", "cascade", "paged"}
        Attention kernel: prefix-sharing kernels (fused, cascade) read a group's shared prefix once per step.
    prefill_chunk : int, optional
        Tokens of the prefill chunk that prices a prompt token (default: the calibration's BatchLLM chunk).
    decode_batch : int, optional
        Sequences of the decode step that prices a decode token (default: vLLM's request cap).

    Examples
    --------
    >>> from prefixattn.scheduling import PrefixGroup
    >>> model = GroupCostModel(CostModel("a100", "mistral-7b"), output_lens=[100, 100])
    >>> g = PrefixGroup(prefix_len=1000, request_ids=[0, 1], prompt_lens=[1400, 1400])
    >>> model(g) < model(PrefixGroup(prefix_len=0, request_ids=[0], prompt_lens=[1400])) * 2
    True
    """

    def __init__(self, cost: CostModel, output_lens=None, *, kernel: str = "fused", prefill_chunk: int | None = None,
                 decode_batch: int | None = None) -> None:
        if not isinstance(cost, CostModel):
            raise ValueError(f"cost: expected a prefixattn.sim.step_cost.CostModel, got {type(cost).__name__}")
        if kernel not in KERNEL_KINDS:
            raise ValueError(f"kernel: expected one of {KERNEL_KINDS}, got {kernel!r}")
        self.outs = None
        if output_lens is not None:
            self.outs = np.asarray(output_lens, dtype=np.float64)
            if self.outs.ndim != 1 or (self.outs < 0).any():
                raise ValueError(f"output_lens: expected a 1-D array of token counts >= 0, got shape "
                                 f"{self.outs.shape}")
        self.shared_reads = kernel != "paged"
        c = cost.calib
        chunk = int(prefill_chunk or c.batchllm_chunk_tokens)
        batch = int(decode_batch or c.vllm_max_num_seqs)
        prefill = cost.step_cost(StepShape(q_lens=np.array([chunk]), kv_lens=np.array([chunk]), num_sampled=1),
                                 kernel="paged")
        ones = np.ones(batch, dtype=np.int64)
        short = cost.step_cost(StepShape(q_lens=ones, kv_lens=ones, num_sampled=batch), kernel="paged")
        long = cost.step_cost(StepShape(q_lens=ones, kv_lens=ones * _PROBE_KV_LEN, num_sampled=batch),
                              kernel="paged")
        #: seconds per prompt token computed, per decode token, per KV token read by one decode query
        self.prefill_s = prefill.total / chunk
        self.decode_s = short.total / batch
        self.kv_read_s = (long.total - short.total) / (batch * (_PROBE_KV_LEN - 1))
        one = np.ones(1, dtype=np.int64)
        #: seconds of a decode step of one sequence (weights read for one token), its KV reads apart
        self.solo_step_s = cost.step_cost(StepShape(q_lens=one, kv_lens=one, num_sampled=1), kernel="paged").total

    def _outputs(self, ids: np.ndarray) -> np.ndarray:
        if self.outs is None:
            return np.full(ids.shape[0], float(DEFAULT_OUTPUT_LEN))
        return self.outs[ids]

    def terms(self, group: PrefixGroup) -> dict:
        """The three token counts behind the cost: prefill tokens, decode tokens, decode KV tokens read."""
        ids = np.asarray(group.request_ids, dtype=np.int64)
        outs = self._outputs(ids)
        plens = np.asarray(group.prompt_lens, dtype=np.float64)
        # a decode step t of a member reads its context: prompt + t generated tokens
        own = plens * outs + outs * (outs - 1) / 2
        if self.shared_reads and group.num_requests > 1 and group.prefix_len > 0:
            # the shared prefix once per step while any member decodes, instead of once per member
            kv = float(own.sum() - group.prefix_len * outs.sum() + group.prefix_len * outs.max())
        else:
            kv = float(own.sum())
        return dict(prefill_tokens=float(group.processed_tokens), decode_tokens=float(outs.sum()), kv_read_tokens=kv)

    def __call__(self, group: PrefixGroup) -> float:
        compute, memory = self._compute_memory(self.terms(group))
        return compute + memory

    def _compute_memory(self, terms: dict) -> tuple[float, float]:
        return (terms["prefill_tokens"] * self.prefill_s + terms["decode_tokens"] * self.decode_s,
                terms["kv_read_tokens"] * self.kv_read_s)

    def resources(self, group: PrefixGroup) -> ResourceCost:
        """The group's cost on the partitioner's two resources, plus its serial lower bound (modeled seconds).

        ``compute``: prefill tokens and decode tokens at the per-token GEMM time of full steps; ``memory``: the
        decode KV reads; ``critical``: the longest member's output tokens x a one-sequence decode step (its KV
        reads are in ``memory``). ``compute + memory`` is :meth:`__call__`.

        Examples
        --------
        >>> from prefixattn.scheduling import PrefixGroup
        >>> model = GroupCostModel(CostModel("a100", "mistral-7b"), output_lens=[10, 2000])
        >>> r = model.resources(PrefixGroup(prefix_len=100, request_ids=[0, 1], prompt_lens=[300, 300]))
        >>> r.critical > r.compute > 0
        True
        """
        compute, memory = self._compute_memory(self.terms(group))
        outs = self._outputs(np.asarray(group.request_ids, dtype=np.int64))
        return ResourceCost(compute=compute, memory=memory, critical=float(outs.max()) * self.solo_step_s)
