"""prefixattn on Ray Data: prefix-affinity data parallelism for offline batches (one engine actor per replica).

Importing this package imports neither ray nor vLLM; each submodule imports what it needs, when it needs it:

- :mod:`prefixattn.integrations.ray.pipeline`: ``run_batch(data, engine, num_replicas=N)``: groups on the driver, whole
  prefix groups per replica (:func:`prefixattn.scheduling.partition_groups`), one block per replica, ``map_batches``
  with a stateful actor per replica, results joined back to the input rows in input order, per-replica stats, retries.
- :mod:`prefixattn.integrations.ray.engines`: what an actor runs: ``VLLMEngine`` (vLLM with prefixattn's attention
  backend and prefix-group scheduler), ``SimulatedEngine`` (prefixattn's simulator: modeled times, no tokens), or any
  callable ``fn(prompts) -> outputs``.
- :mod:`prefixattn.integrations.ray.prepass`: ``group_prompts_distributed``, the grouping pre-pass on Ray workers
  (buckets by a hash of the first k tokens, ``group_prompts`` per bucket, merged on the driver; ``run_batch(grouping=
  "distributed")``).
- :mod:`prefixattn.integrations.ray.faults`: ``FailOnce``, fault injection for testing the retry path.
"""
