"""A CPU tensor standing in for a device tensor: it records every call that would synchronize with the device.

On a GPU, reading a device tensor's values on the host (``.cpu()``, ``.to("cpu")``, ``.item()``, ``.tolist()``,
``.numpy()``, ``int()``/``float()``/``bool()``, a copy into a non-pinned host tensor) waits for every kernel queued
before it. The stand-in shares its storage with an ordinary CPU tensor (so vLLM's buffers can be wrapped in place)
and logs each such call with the tensor's name; a test asserts the log stays empty over the code path it guards.
Shapes, strides, dtypes, storage addresses and slicing are host metadata and are not recorded.
"""

from __future__ import annotations

import torch

#: Methods whose result is the tensor's values on the host.
_HOST_READS = {"cpu", "item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "__array__",
               "__format__", "__repr__", "__str__"}


def _to_host(args, kwargs) -> bool:
    """Whether a ``Tensor.to(...)`` call moves the tensor to the host."""
    targets = list(args[1:]) + [kwargs.get("device")]
    for t in targets:
        if isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu":
            return True
    return False


class DeviceStandIn(torch.Tensor):
    """``DeviceStandIn.wrap(t, name, log)``: ``t``'s storage, recording host reads into ``log``."""

    @staticmethod
    def wrap(t: torch.Tensor, name: str, log: list) -> "DeviceStandIn":
        out = torch.Tensor._make_subclass(DeviceStandIn, t)
        out._standin = (name, log)
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        owner = next((a for a in args if isinstance(a, DeviceStandIn)), None)
        tag = getattr(owner, "_standin", None)
        if tag is not None:
            what, log = tag
            if name in _HOST_READS or (name == "to" and _to_host(args, kwargs)):
                log.append(f"{what}.{name}")
            elif name == "copy_" and not isinstance(args[0], DeviceStandIn) and not args[0].is_pinned():
                log.append(f"{what} copied into a non-pinned host tensor")
        out = super().__torch_function__(func, types, args, kwargs)
        if tag is not None and isinstance(out, DeviceStandIn) and not hasattr(out, "_standin"):
            out._standin = tag  # views and results of the stand-in stay stand-ins with the same name
        return out
