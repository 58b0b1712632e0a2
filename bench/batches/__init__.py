"""The benchmarks' batches, built deterministically so every provider, process and step sees the same one.

- :mod:`~batches.shapes`: attention batches (paged KV caches, metadata, the prefix groups) from a :class:`Shape`:
  BatchLLM Fig. 8 at full size for a GPU and scaled down for the interpreter, FlashInfer's cascade grid. Used by the
  pytest benchmarks, the peers (in an engine's venv too) and the GPU check.
- :mod:`~batches.prompts`: token-id prompts with shared prefixes for the scheduler benchmarks (BatchLLM case 1, a
  BlendServe-style mix).
"""
