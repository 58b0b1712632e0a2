"""Global prefix scheduler (numpy only): prefix tree, grouping, ordering, token batching.

Offline batch flow (BatchLLM sec. 4.2-4.3)::

    groups = group_prompts(prompts)                        # prefix-sharing groups (Algorithm 1)
    groups = order_groups(groups, "batchllm")             # or "fcfs", "dfs", "blendserve"
    batcher = TokenBatcher(token_budget=2048, kv_blocks=4096, block_size=16)
    batcher.add_groups(groups)
    while not batcher.done:
        plan = batcher.step()                              # what to compute this step, per request
        ...run the model..., then batcher.finish(request_id) for requests that ended
"""

from prefixattn.scheduling.blendserve import DensityModel, blendserve_order, memory_classes
from prefixattn.scheduling.grouping import PrefixGroup, group_prompts, optimal_saving_ratio, saving_ratio
from prefixattn.scheduling.ordering import DEFAULT_ORDERING, ORDERINGS, OrderingPolicy, order_groups, register_ordering
from prefixattn.scheduling.output_lengths import estimate_output_lens, sample_requests
from prefixattn.scheduling.partition import (Partition, ResourceCost, partition_groups, shard_requests,
                                             sharded_saving_ratio, token_cost)
from prefixattn.scheduling.prefix_tree import PrefixTree, prefix_tree, sort_and_lcp
from prefixattn.scheduling.sequences import PackedSequences, pack_sequences
from prefixattn.scheduling.step_batch import Chunk, ChunkKind, PrefixNode, StepBatch
from prefixattn.scheduling.token_batching import TokenBatcher

__all__ = [
    "Chunk", "ChunkKind", "PrefixNode", "StepBatch", "TokenBatcher",
    "DensityModel", "DEFAULT_ORDERING", "ORDERINGS", "OrderingPolicy", "PackedSequences", "PrefixGroup", "PrefixTree",
    "blendserve_order", "estimate_output_lens", "group_prompts", "memory_classes", "optimal_saving_ratio",
    "order_groups", "pack_sequences", "prefix_tree", "register_ordering", "sample_requests", "saving_ratio",
    "sort_and_lcp",
    "Partition", "ResourceCost", "partition_groups", "shard_requests", "sharded_saving_ratio", "token_cost",
]
