"""prefixattn inside vLLM (0.32 - 0.33): attention backend ``PREFIXATTN``, prefix-group scheduler, offline helper.

Importing this package imports neither vLLM nor prefixattn's kernels; each submodule imports what it needs:

- :mod:`prefixattn.integrations.vllm.plugin`: ``register()``, the ``vllm.general_plugins`` entry point.
- :mod:`prefixattn.integrations.vllm.backend`: the attention backend, its metadata builder and impl, which use
  :mod:`~prefixattn.integrations.vllm.refusals` (what is refused, capability-aware),
  :mod:`~prefixattn.integrations.vllm.layer_geometry` (each builder's geometry from its layers),
  :mod:`~prefixattn.integrations.vllm.host_tables` (block ids from vLLM's host data),
  :mod:`~prefixattn.integrations.vllm.workspace_pool` (workspaces inside vLLM's memory profile) and
  :mod:`~prefixattn.integrations.vllm.wrappers` (the builders' capacity-sized wrappers).
- :mod:`prefixattn.integrations.vllm.mla_backend`: the MLA backend ``PREFIXATTN_MLA`` (decode on
  :func:`prefixattn.mla_attention`), with :mod:`~prefixattn.integrations.vllm.mla_prefill` (prefills' cached contexts
  up-projected once per step).
- :mod:`prefixattn.integrations.vllm.scheduler`: ``PrefixGroupScheduler`` for ``scheduler_cls=...``.
- :mod:`prefixattn.integrations.vllm.offline`: ``generate(llm, prompts, sampling_params)``.
- :mod:`prefixattn.integrations.vllm.version`: the supported-version check.
"""
