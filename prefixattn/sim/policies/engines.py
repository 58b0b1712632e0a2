"""Registry entries of the engine emulations (vLLM, SGLang): their default configuration and the variants the
papers compare against."""

from __future__ import annotations

from prefixattn.sim.policies.registry import register
from prefixattn.sim.policies.sglang import SGLangPolicy
from prefixattn.sim.policies.vllm import VLLMPolicy

register("vllm", lambda **kw: VLLMPolicy(True, True, name="vllm", **kw),
         "vLLM + prefix caching + chunked prefill (BatchLLM Table 1 '+pc +cp'): FCFS, hash-block LRU cache, 2048 "
         "tokens, 256 seqs")
register("vllm-nopc", lambda **kw: VLLMPolicy(False, True, name="vllm-nopc", **kw),
         "vLLM + chunked prefill, prefix caching off (Table 1 '+cp')")
register("vllm-nocp", lambda **kw: VLLMPolicy(True, False, name="vllm-nocp", **kw),
         "vLLM + prefix caching, chunked prefill off (Table 1 '+pc')")
register("vllm-plain", lambda **kw: VLLMPolicy(False, False, name="vllm-plain", **kw),
         "vLLM with neither (Table 1 'vLLM')")
register("vllm-dfs", lambda **kw: VLLMPolicy(True, True, order="dfs", name="vllm-dfs", **kw),
         "vLLM with the requests fed in prefix-tree DFS order (BlendServe's vLLM-DFS baseline)")
register("sglang", lambda **kw: SGLangPolicy("lpm", name="sglang", **kw),
         "SGLang: radix cache + LRU, LPM order (FCFS when > 128 wait), prefill/decode steps, chunk 8192")
register("sglang-dfs", lambda **kw: SGLangPolicy("dfs-weight", name="sglang-dfs", **kw),
         "SGLang with schedule_policy dfs-weight (BlendServe's SGLang-DFS baseline)")
