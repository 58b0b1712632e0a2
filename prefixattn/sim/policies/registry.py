"""The registry of named policies: :func:`register` (called by the modules that define them), :func:`make_policy`.

The built-in policies register themselves when :mod:`prefixattn.sim.policies` is imported (its ``__init__`` imports
``engines`` and ``scheduled``), so this module imports none of them.
"""

from __future__ import annotations

_REGISTRY: dict = {}


def register(name: str, factory, help_text: str) -> None:
    """Register a policy factory ``factory(**options) -> Policy`` under ``name``."""
    _REGISTRY[name] = (factory, help_text)


def policy_names() -> list:
    return sorted(_REGISTRY)


def policy_help() -> dict:
    return {name: text for name, (_, text) in sorted(_REGISTRY.items())}


def make_policy(name: str, **options):
    """Build a registered policy by name.

    Examples
    --------
    >>> make_policy("vllm").name
    'vllm'
    """
    if name not in _REGISTRY:
        raise ValueError(f"policy: expected one of {policy_names()}, got {name!r}")
    return _REGISTRY[name][0](**options)
