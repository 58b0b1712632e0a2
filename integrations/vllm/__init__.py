"""prefixattn inside vLLM (0.32 - 0.33): attention backend ``PREFIXATTN``, prefix-group scheduler, offline helper.

Importing this package imports neither vLLM nor prefixattn's kernels; each submodule imports what it needs:

- :mod:`integrations.vllm.plugin`: ``register()``, the ``vllm.general_plugins`` entry point.
- :mod:`integrations.vllm.backend`: the attention backend, its metadata builder and impl, which use
  :mod:`~integrations.vllm.refusals` (what is refused, capability-aware), :mod:`~integrations.vllm.layer_geometry`
  (each builder's geometry from its layers), :mod:`~integrations.vllm.host_tables` (block ids from vLLM's host
  data), :mod:`~integrations.vllm.workspace_pool` (workspaces inside vLLM's memory profile) and
  :mod:`~integrations.vllm.wrappers` (the builders' capacity-sized wrappers).
- :mod:`integrations.vllm.scheduler`: ``PrefixGroupScheduler`` for ``scheduler_cls=...``.
- :mod:`integrations.vllm.offline`: ``generate(llm, prompts, sampling_params)``.
- :mod:`integrations.vllm.version`: the supported-version check.
"""
