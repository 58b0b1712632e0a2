"""Attention providers measured side by side: prefixattn and the engines' own Triton kernels (plus GPU-only peers).

Each provider module exposes ``prepare(batch) -> Prepared``: host-side work (plans, metadata, scratch buffers) done
*before* measuring, and a ``run()`` that launches exactly what the engine launches per layer. Providers whose package
is missing in this interpreter run in their engine's venv (:mod:`peers.remote`), or are skipped with a reason.
"""

from peers.base import CPU_PROVIDERS, ENGINE_OF, Prepared

__all__ = ["CPU_PROVIDERS", "ENGINE_OF", "Prepared"]
