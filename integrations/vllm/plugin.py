"""vLLM plugin entry point: registers prefixattn's attention backend under the name ``PREFIXATTN``.

vLLM calls :func:`register` (entry point group ``vllm.general_plugins``) in every process it starts, so it is
idempotent, cheap (it imports only vLLM's backend registry, never torch kernels or prefixattn) and never breaks vLLM:
on an unsupported vLLM the backend is still registered by name, and selecting it fails with a message saying which
versions are supported (see :mod:`integrations.vllm.version`).

Users select the backend with ``--attention-backend PREFIXATTN`` or ``LLM(..., attention_backend="PREFIXATTN")``.

Platforms that resolve a fixed backend whatever the user selects (vLLM's CPU platform always resolves ``CPU_ATTN``)
honour the registry's overrides: ``PREFIXATTN_VLLM_OVERRIDE=CPU_ATTN`` (comma-separated names) makes those names
resolve to prefixattn too, in every process vLLM starts.
"""

from __future__ import annotations

import logging
import os

#: The name users select; ``PrefixAttnBackend.get_name()`` returns exactly this.
BACKEND_NAME = "PREFIXATTN"
#: Import path vLLM resolves lazily when the backend is selected.
BACKEND_CLASS_PATH = "integrations.vllm.backend.PrefixAttnBackend"
#: Comma-separated names of vLLM backends to resolve to prefixattn as well (e.g. ``CPU_ATTN`` on the CPU platform).
OVERRIDE_ENV = "PREFIXATTN_VLLM_OVERRIDE"

logger = logging.getLogger(__name__)


def _registry():
    """vLLM's backend registry module, or None (with a warning) when this vLLM has no such registry."""
    try:
        from vllm.v1.attention.backends import registry
    except ImportError as e:
        from integrations.vllm.version import installed_vllm_version, supported_range

        logger.warning("prefixattn: not registering the %s attention backend: vLLM %s has no backend registry "
                       "(%s); prefixattn supports vLLM %s", BACKEND_NAME, installed_vllm_version(), e,
                       supported_range())
        return None
    return registry


def register() -> None:
    """Register ``PREFIXATTN`` in vLLM's attention-backend registry (the ``vllm.general_plugins`` entry point).

    Idempotent: a second call (vLLM may load plugins more than once per process) changes nothing. Also applies the
    overrides named in ``PREFIXATTN_VLLM_OVERRIDE``.

    Examples
    --------
    >>> from integrations.vllm.plugin import register
    >>> register()
    >>> LLM(model, attention_backend="PREFIXATTN")
    """
    registry = _registry()
    if registry is None:
        return
    enum = registry.AttentionBackendEnum
    if BACKEND_NAME not in enum.__members__:
        registry.register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
    elif enum[BACKEND_NAME].get_path() != BACKEND_CLASS_PATH:
        # Someone registered the name first (or a stale registration survives): ours wins, as a registry override.
        registry.register_backend(enum[BACKEND_NAME], BACKEND_CLASS_PATH)
    for name in filter(None, (s.strip() for s in os.environ.get(OVERRIDE_ENV, "").split(","))):
        override_backend(name)


def override_backend(name: str) -> None:
    """Make vLLM's backend ``name`` (e.g. ``"CPU_ATTN"``) resolve to prefixattn's backend in this process.

    For platforms that ignore the selected backend. Undo with :func:`clear_override`.

    Raises
    ------
    ValueError
        ``name`` is not a backend vLLM knows (the message lists the valid names).
    """
    registry = _registry()
    if registry is None:
        return
    if BACKEND_NAME not in registry.AttentionBackendEnum.__members__:
        registry.register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
    member = registry.AttentionBackendEnum[name]  # vLLM's own error for an unknown name lists the valid ones
    if member.name == BACKEND_NAME:
        return
    if not (member.is_overridden() and member.get_path() == BACKEND_CLASS_PATH):
        registry.register_backend(member, BACKEND_CLASS_PATH)
        logger.info("prefixattn: vLLM attention backend %s now resolves to %s", name, BACKEND_CLASS_PATH)


def clear_override(name: str) -> None:
    """Undo :func:`override_backend` for ``name`` (vLLM's own class is resolved again)."""
    registry = _registry()
    if registry is not None:
        registry.AttentionBackendEnum[name].clear_override()
