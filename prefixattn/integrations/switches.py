"""Switches the engine backends read from the environment: an engine's own options never reach an attention
backend, and the environment reaches vLLM's and SGLang's worker processes."""

from __future__ import annotations

import os

#: ``1``: the backends plan with ``overlap=True`` (:func:`prefixattn.plan`: a step's decode launch beside its shared
#: and chunk launches). Off by default until a GPU run measures it (the GPU check's ``prefixattn-overlap`` rows).
OVERLAP_ENV = "PREFIXATTN_OVERLAP"
_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")


def overlap_enabled() -> bool:
    """Whether ``$PREFIXATTN_OVERLAP`` turns overlapped work classes on (unset: off); a value that is neither on nor
    off is a ``ValueError`` naming it."""
    value = os.environ.get(OVERLAP_ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{OVERLAP_ENV}: expected 1 or 0, got {value!r}")
