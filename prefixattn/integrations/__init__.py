"""Engine integrations (vLLM, SGLang). Importing this package never imports vllm or sglang."""
