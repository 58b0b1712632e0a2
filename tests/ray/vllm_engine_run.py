"""One run of :class:`prefixattn.integrations.ray.engines.VLLMEngine` in a fresh process (vLLM caches its attention
backend per process): ``python -m tests.ray.vllm_engine_run IN.json OUT.json``.

IN.json: ``{"model", "rows": [{"prompt_token_ids", "max_tokens"}], "use_prefixattn": bool}``. OUT.json: the engine's
outputs and the attention backend class vLLM's CPU platform resolved.
"""

import json
import os
import sys


def main(in_path: str, out_path: str) -> None:
    cfg = json.load(open(in_path))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if cfg["use_prefixattn"]:
        os.environ["PREFIXATTN_VLLM_OVERRIDE"] = "CPU_ATTN"  # the CPU platform always resolves CPU_ATTN
    else:
        os.environ.pop("PREFIXATTN_VLLM_OVERRIDE", None)
    from prefixattn.integrations.ray.engines import VLLMEngine

    # a tiny model on 2 cores: few request slots, a small KV cache, fp32, CPU block size (a multiple of 32)
    engine = VLLMEngine(cfg["model"], use_prefixattn=cfg["use_prefixattn"], skip_tokenizer_init=True, seed=0,
                        enforce_eager=True, dtype="float32", max_model_len=512, block_size=32, max_num_seqs=16,
                        kv_cache_memory_bytes=64 << 20)
    rows = cfg["rows"]
    outputs = engine.generate([r["prompt_token_ids"] for r in rows], rows)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    json.dump(dict(outputs=outputs, stats=engine.stats(), backend_class=AttentionBackendEnum.CPU_ATTN.get_path()),
              open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
