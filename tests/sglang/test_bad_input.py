"""Hostile input in SGLang: a KV pool the kernel cannot read (quantized other than fp8 e4m3/e5m2, or a float pool not in
the model's dtype) is refused when the backend is built, not at the first forward; the engine path's block ids are
checked against the pool."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from prefixattn.integrations.sglang.backend import PrefixAttnBackend
from tests.sglang.engine import MiniEngine

pytestmark = pytest.mark.sglang


def _pool(eng: MiniEngine, dtype: torch.dtype) -> MHATokenToKVPool:
    return MHATokenToKVPool(eng.pool_size, eng.page_size, dtype, eng.num_kv_heads, eng.head_dim, layer_num=1,
                            device="cpu", enable_memory_saver=False, enable_alt_stream=False)


def test_fp8_kv_pools_are_accepted_and_other_quantized_pools_refused_at_construction():
    """fp8 e4m3/e5m2 pools run in the kernel (tests/sglang/test_e2e_models.py); ROCm's e4m3fnuz does not."""
    eng = MiniEngine()
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        runner = eng.runner(_pool(eng, dtype))
        runner.dtype = torch.bfloat16  # any model dtype: the kernel upcasts fp8 on load
        PrefixAttnBackend(runner)
    with pytest.raises(ValueError, match="token_to_kv_pool: expected a float16/bfloat16/float32 or fp8 "
                                         "\\(float8_e4m3fn/float8_e5m2\\) KV cache, got float8_e4m3fnuz"):
        PrefixAttnBackend(eng.runner(_pool(eng, torch.float8_e4m3fnuz)))
    pool = _pool(eng, torch.float8_e4m3fn)
    pool.quant_method = object()  # stands in for an FP4 pool's quant method: is_quantized_kv_cache is then True
    with pytest.raises(ValueError, match="token_to_kv_pool: expected .* no block-scaled KV\\), got a quantized"):
        PrefixAttnBackend(eng.runner(pool))


def test_kv_pool_in_another_dtype_than_the_model_is_refused_at_construction():
    eng = MiniEngine(dtype=torch.bfloat16)
    runner = eng.runner(_pool(eng, torch.float16))
    runner.dtype = torch.bfloat16  # SGLang's ModelRunner.dtype: the model's dtype
    with pytest.raises(ValueError, match="kv_cache_dtype: expected the model dtype bfloat16 .* got float16"):
        PrefixAttnBackend(runner)
    runner = eng.runner(_pool(eng, torch.bfloat16))
    runner.dtype = torch.bfloat16
    PrefixAttnBackend(runner)


@pytest.mark.parametrize("page_size", [1, 4])
def test_block_ids_outside_the_pool_are_refused(page_size):
    eng = MiniEngine(page_size=page_size, num_pages=16)
    backend = PrefixAttnBackend(eng.runner(eng.make_pool()))
    r = eng.add_request(list(range(100, 108)))
    fb = eng.batch({r: 8}, ForwardMode.EXTEND)
    row = eng.requests[r].row
    pool_pages = eng.make_pool().get_key_buffer(0).shape[0] // page_size  # SGLang adds a padding page
    eng.req_to_token_pool.req_to_token[row, 0] = pool_pages * page_size  # the first slot past the pool
    backend.init_forward_metadata(fb)
    q, k, v = eng.qkv(8)
    with pytest.raises(ValueError, match=f"block_table: expected block ids in \\[0, {pool_pages}\\) .* "
                                         f"got block_table\\[0, 0\\]={pool_pages}"):
        backend.forward(q, k, v, eng.layer, fb, save_kv_cache=False)


@pytest.mark.parametrize("pool_class", ["UnifiedMHATokenToKVPool", "PageMajorMHATokenToKVPool"])
def test_pools_that_are_not_the_plain_mha_pool_are_refused_at_construction(pool_class):
    # The unified-memory pool (--enable-unified-memory) subclasses MHATokenToKVPool but its req_to_token holds
    # virtual slot ids that SGLang's own backends translate before reading: read as physical pages, they would be
    # silently wrong output. Every subclass (other id spaces, other buffer layouts) is refused by name. The pool is
    # SGLang's own class, made without its constructor (its virtual-memory machinery needs a GPU): the backend
    # refuses it by type before reading anything of it.
    import importlib

    module = {"UnifiedMHATokenToKVPool": "sglang.srt.mem_cache.unified_memory_pool",
              "PageMajorMHATokenToKVPool": "sglang.srt.mem_cache.memory_pool"}[pool_class]
    cls = getattr(importlib.import_module(module), pool_class)
    assert issubclass(cls, MHATokenToKVPool)
    eng = MiniEngine()
    with pytest.raises(ValueError, match=f"token_to_kv_pool: expected SGLang's plain MHATokenToKVPool .* got its "
                                         f"subclass {pool_class}"):
        PrefixAttnBackend(eng.runner(cls.__new__(cls)))
