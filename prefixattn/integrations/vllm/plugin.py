"""vLLM plugin entry point: makes prefixattn's attention backend selectable under the name ``PREFIXATTN``.

vLLM calls :func:`register` (entry point group ``vllm.general_plugins``) in every process it starts, so it is
idempotent, cheap (it imports only vLLM's backend registry, never torch kernels or prefixattn) and never breaks vLLM:
on an unsupported vLLM the backend is still registered by name, and selecting it fails with a message saying which
versions are supported (see :mod:`prefixattn.integrations.vllm.version`).

Users select the backend with ``--attention-backend PREFIXATTN`` or ``LLM(..., attention_backend="PREFIXATTN")``.

Spawned processes: vLLM pickles its config (the selected ``AttentionBackendEnum`` member included) into the
engine-core and worker processes, and loads plugins there only after unpickling it. An enum member pickles by value,
so a member added at run time cannot be unpickled in a fresh interpreter (``ValueError: '...' is not a valid
AttentionBackendEnum``); vLLM spawns instead of forking whenever CUDA was initialised in the parent, under Ray, on
WSL or with ``VLLM_WORKER_MULTIPROC_METHOD=spawn``. So ``PREFIXATTN`` is registered as an *alias* of vLLM's built-in
``CUSTOM`` member (whose value every process knows), and ``CUSTOM`` resolves to prefixattn's class in every process
the plugin loads in. If another plugin already claimed ``CUSTOM`` for its own class, ``PREFIXATTN`` falls back to a
member of its own (works wherever vLLM forks or runs in-process) and a warning says so.

Platforms that resolve a fixed backend whatever the user selects (vLLM's CPU platform always resolves ``CPU_ATTN``)
honour the registry's overrides: ``PREFIXATTN_VLLM_OVERRIDE=CPU_ATTN`` (comma-separated names) makes those names
resolve to prefixattn too, in every process vLLM starts.

MLA models (DeepSeek-V2/V3/R1, Kimi-K2) need a backend whose ``is_mla()`` is true: ``PREFIXATTN_MLA`` selects
prefixattn's MLA backend (:mod:`prefixattn.integrations.vllm.mla_backend`). ``CUSTOM`` is ``PREFIXATTN``'s, so
``PREFIXATTN_MLA`` is a member of its own (in-process or forked engines); overriding a built-in MLA name
(``PREFIXATTN_VLLM_OVERRIDE=TRITON_MLA``, or ``CPU_MLA`` on vLLM's CPU platform) is the spawn-safe way. An overridden
name whose vLLM backend is an MLA one (its name says ``MLA``) resolves to the MLA backend, any other to ``PREFIXATTN``.
"""

from __future__ import annotations

import logging
import os

#: The name users select; ``PrefixAttnBackend.get_name()`` returns exactly this.
BACKEND_NAME = "PREFIXATTN"
#: Import path vLLM resolves lazily when the backend is selected.
BACKEND_CLASS_PATH = "prefixattn.integrations.vllm.backend.PrefixAttnBackend"
#: The MLA backend's name and class (vLLM refuses a backend whose ``is_mla()`` differs from the model's).
MLA_BACKEND_NAME = "PREFIXATTN_MLA"
MLA_BACKEND_CLASS_PATH = "prefixattn.integrations.vllm.mla_backend.PrefixAttnMLABackend"
#: vLLM's built-in placeholder member for third-party backends: ``PREFIXATTN`` is an alias of it (pickle-safe).
CUSTOM_MEMBER = "CUSTOM"
#: Comma-separated names of vLLM backends to resolve to prefixattn as well (e.g. ``CPU_ATTN`` on the CPU platform).
OVERRIDE_ENV = "PREFIXATTN_VLLM_OVERRIDE"

logger = logging.getLogger(__name__)


def _registry():
    """vLLM's backend registry module, or None (with a warning) when this vLLM has no such registry."""
    try:
        from vllm.v1.attention.backends import registry
    except ImportError as e:
        from prefixattn.integrations.vllm.version import installed_vllm_version, supported_range

        logger.warning("prefixattn: not registering the %s attention backend: vLLM %s has no backend registry "
                       "(%s); prefixattn supports vLLM %s", BACKEND_NAME, installed_vllm_version(), e,
                       supported_range())
        return None
    return registry


def _custom_member(registry):
    """vLLM's ``CUSTOM`` member when prefixattn may claim it (free, or already prefixattn's), else None."""
    custom = registry.AttentionBackendEnum.__members__.get(CUSTOM_MEMBER)
    if custom is None:
        return None
    if custom.is_overridden() and custom.get_path() != BACKEND_CLASS_PATH:
        return None  # another plugin's backend: never taken over
    return custom


def _ensure_name(registry) -> None:
    """``PREFIXATTN`` resolves to prefixattn's class: as an alias of ``CUSTOM`` where possible."""
    enum = registry.AttentionBackendEnum
    custom = _custom_member(registry)
    if custom is not None:
        if not custom.is_overridden():
            registry.register_backend(custom, BACKEND_CLASS_PATH)
        if enum.__members__.get(BACKEND_NAME) is not custom:
            # An enum alias: the name maps to the CUSTOM member, which pickles as CUSTOM (its value, None).
            enum._member_map_[BACKEND_NAME] = custom
        return
    if BACKEND_NAME not in enum.__members__:
        logger.warning("prefixattn: vLLM's %s attention backend is registered to %s, so %s is registered as a "
                       "backend of its own, which does not survive a spawned engine process (vLLM spawns when CUDA "
                       "was initialised in the parent, under Ray, on WSL or with "
                       "VLLM_WORKER_MULTIPROC_METHOD=spawn)", CUSTOM_MEMBER,
                       enum[CUSTOM_MEMBER].get_path(), BACKEND_NAME)
        registry.register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
    elif enum[BACKEND_NAME].get_path() != BACKEND_CLASS_PATH:
        # A stale registration of the name survives: ours wins, as a registry override.
        registry.register_backend(enum[BACKEND_NAME], BACKEND_CLASS_PATH)


def _ensure_mla_name(registry) -> None:
    """``PREFIXATTN_MLA`` resolves to prefixattn's MLA backend class: a member of its own."""
    enum = registry.AttentionBackendEnum
    if MLA_BACKEND_NAME not in enum.__members__:
        registry.register_backend(MLA_BACKEND_NAME, MLA_BACKEND_CLASS_PATH)
    elif enum[MLA_BACKEND_NAME].get_path() != MLA_BACKEND_CLASS_PATH:
        registry.register_backend(enum[MLA_BACKEND_NAME], MLA_BACKEND_CLASS_PATH)


def class_path_for(name: str) -> str:
    """The class an overridden vLLM backend ``name`` resolves to: the MLA backend for vLLM's MLA backends (every one
    has ``MLA`` in its name: ``TRITON_MLA``, ``FLASHMLA``, ``CPU_MLA``, ...), else the fused one."""
    return MLA_BACKEND_CLASS_PATH if "MLA" in name else BACKEND_CLASS_PATH


def register() -> None:
    """Make ``PREFIXATTN`` and ``PREFIXATTN_MLA`` select prefixattn's backends in this process (the
    ``vllm.general_plugins`` entry point).

    Idempotent: a second call (vLLM may load plugins more than once per process) changes nothing. Also applies the
    overrides named in ``PREFIXATTN_VLLM_OVERRIDE``.

    Examples
    --------
    >>> from prefixattn.integrations.vllm.plugin import register
    >>> register()
    >>> LLM(model, attention_backend="PREFIXATTN")
    """
    registry = _registry()
    if registry is None:
        return
    _ensure_name(registry)
    _ensure_mla_name(registry)
    for name in filter(None, (s.strip() for s in os.environ.get(OVERRIDE_ENV, "").split(","))):
        override_backend(name)


def override_backend(name: str) -> None:
    """Make vLLM's backend ``name`` (e.g. ``"CPU_ATTN"``) resolve to prefixattn's backend in this process: the MLA
    backend for an MLA name (``"CPU_MLA"``, ``"TRITON_MLA"``: :func:`class_path_for`).

    For platforms that ignore the selected backend, and spawn-safe MLA selection. Undo with :func:`clear_override`.

    Raises
    ------
    ValueError
        ``name`` is not a backend vLLM knows (the message lists the valid names).
    """
    registry = _registry()
    if registry is None:
        return
    _ensure_name(registry)
    _ensure_mla_name(registry)
    enum = registry.AttentionBackendEnum
    member = enum[name]  # vLLM's own error for an unknown name lists the valid ones
    if member is enum[BACKEND_NAME] or member is enum[MLA_BACKEND_NAME]:
        return
    path = class_path_for(name)
    if not (member.is_overridden() and member.get_path() == path):
        registry.register_backend(member, path)
        logger.info("prefixattn: vLLM attention backend %s now resolves to %s", name, path)


def clear_override(name: str) -> None:
    """Undo :func:`override_backend` for ``name`` (vLLM's own class is resolved again)."""
    registry = _registry()
    if registry is not None:
        registry.AttentionBackendEnum[name].clear_override()
