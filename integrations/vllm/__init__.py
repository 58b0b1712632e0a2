"""prefixattn inside vLLM (0.32 - 0.33): attention backend ``PREFIXATTN``, prefix-group scheduler, offline helper.

Importing this package imports neither vLLM nor prefixattn's kernels; each submodule imports what it needs:

- :mod:`integrations.vllm.plugin`: ``register()``, the ``vllm.general_plugins`` entry point.
- :mod:`integrations.vllm.backend`: the attention backend, its metadata builder and impl.
- :mod:`integrations.vllm.scheduler`: ``PrefixGroupScheduler`` for ``scheduler_cls=...``.
- :mod:`integrations.vllm.offline`: ``generate(llm, prompts, sampling_params)``.
- :mod:`integrations.vllm.version`: the supported-version check.
"""
