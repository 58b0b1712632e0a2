"""Facts about the Triton runtime this process runs under."""

from __future__ import annotations

import functools
import os
import re

#: Triton's interpreter holds every scalar as a 1-element numpy array and turns it into a loop bound with
#: ``int(array)`` (``for start in range(kv_lo, kv_hi, BLOCK_N)``). NumPy 2.4 made ``int()`` of an array with
#: ``ndim > 0`` a TypeError (deprecated since 1.25); Triton's interpreter squeezes the array first from 3.7.0 on
#: (checked in the 3.6.0, 3.7.0, 3.7.1 and 3.8.0 wheels' ``triton/runtime/interpreter.py``). Compiled kernels are not
#: affected: only the interpreter of Triton < 3.7 with NumPy >= 2.4 fails, at the first launch.
INTERPRETER_SQUEEZES_SCALARS_FROM_TRITON = (3, 7)
NUMPY_ARRAY_INT_ERROR_FROM = (2, 4)


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when a kernel module is imported, so it must be set before ``import prefixattn``.
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _major_minor(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"version: expected a 'MAJOR.MINOR...' string, got {version!r}")
    return int(m.group(1)), int(m.group(2))


def interpreter_incompatibility(triton_version: str, numpy_version: str) -> str | None:
    """Why the Triton interpreter of ``triton_version`` cannot run our kernels with ``numpy_version``, or None."""
    if (_major_minor(triton_version) < INTERPRETER_SQUEEZES_SCALARS_FROM_TRITON
            and _major_minor(numpy_version) >= NUMPY_ARRAY_INT_ERROR_FROM):
        return (f"the Triton {triton_version} interpreter cannot run these kernels with NumPy {numpy_version}: it "
                "converts loop bounds with int() of a 1-element array, a TypeError from NumPy 2.4 on; install "
                "'numpy<2.4' or Triton >= 3.7 (compiled GPU kernels are not affected)")
    return None


@functools.cache
def check_interpreter_runtime() -> None:
    """Raise RuntimeError, naming the fix, when the installed Triton interpreter and NumPy cannot work together.

    Cached: the installed versions do not change while the process runs (one check per process, no per-launch cost).
    """
    import numpy
    import triton

    reason = interpreter_incompatibility(triton.__version__, numpy.__version__)
    if reason is not None:
        raise RuntimeError(f"TRITON_INTERPRET=1: {reason}")


#: A 1.0 fp32 tensor per device: the pointer a launch passes for a per-tensor scale given as a float (the kernels
#: multiply a float scale by a pointed-to one). Allocated once per device, on the first launch that needs it; never
#: per call.
_ONES: dict = {}


def device_one(device):
    """The 1-element fp32 tensor ``[1.0]`` on ``device`` (cached per device; do not write to it)."""
    one = _ONES.get(device)
    if one is None:
        import torch  # lazily: nothing else in this module needs torch

        one = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one
