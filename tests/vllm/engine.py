"""Run :mod:`tests.vllm.engine_run` in a subprocess and read its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: A tiny model's KV cache needs a few MB; vLLM's CPU default reserves a fraction of the whole machine's memory.
KV_CACHE_BYTES = 64 << 20
#: Generous: a run takes ~10-40 s on 2 cores; only a hang should ever reach this.
RUN_TIMEOUT_S = 600


def run_engine(tmp_path, name: str, **cfg) -> dict:
    cfg.setdefault("llm", {})
    cfg["llm"].setdefault("kv_cache_memory_bytes", KV_CACHE_BYTES)
    in_path, out_path = tmp_path / f"{name}.in.json", tmp_path / f"{name}.out.json"
    in_path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.engine_run", str(in_path), str(out_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        from tests.vllm.engine_run import STAGE_MARK

        stages = [line[len(STAGE_MARK):] for line in proc.stderr.splitlines() if line.startswith(STAGE_MARK)]
        raise AssertionError(f"engine run {name} failed at stage {stages[-1] if stages else 'import'!r} "
                             f"(rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out_path.read_text())
