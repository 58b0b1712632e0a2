"""Triton kernels (``@triton.jit`` only). Launch them through the checked wrappers in :mod:`prefixattn`."""
