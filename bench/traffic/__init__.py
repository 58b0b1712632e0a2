"""Measured global-memory traffic of Triton kernels run in the CPU interpreter.

:func:`count_traffic` patches the interpreter's memory ops and launches while it is active and attributes every
unmasked element loaded or stored to the tensor its address falls in. See :mod:`traffic.counter`.
"""

from traffic.counter import Launch, Traffic, count_traffic

__all__ = ["Launch", "Traffic", "count_traffic"]
