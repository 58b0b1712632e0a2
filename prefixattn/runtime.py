"""Facts about the Triton runtime this process runs under."""

from __future__ import annotations

import os


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when a kernel module is imported, so it must be set before ``import prefixattn``.
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
