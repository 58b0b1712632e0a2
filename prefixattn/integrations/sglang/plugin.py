"""SGLang plugin entry point: registers the ``prefixattn`` attention backend and the prefix-group schedule policy.

SGLang runs every function in the ``sglang.srt.plugins`` entry-point group in each of its processes
(``sglang.srt.plugins.load_plugins``), then applies the hooks the plugins registered. prefixattn's ``pyproject.toml``
points that group at :func:`load`, so after ``pip install prefixattn`` (with sglang==0.5.23)::

    python -m sglang.launch_server --model-path ... --attention-backend prefixattn \\
        --schedule-policy prefixattn

:func:`load` is idempotent and lazy: it checks the SGLang version, registers a backend *factory* (the backend
module, which needs triton and the kernels, is imported only when SGLang builds the backend) and registers the
schedule-policy hooks with SGLang's ``HookRegistry`` (SGLang applies them right after the plugins ran).
"""

from __future__ import annotations

import threading

from prefixattn.integrations.sglang.version import check_sglang_version

#: Name of the attention backend (``--attention-backend prefixattn``).
ATTENTION_BACKEND_NAME = "prefixattn"

_lock = threading.Lock()
_loaded = False


def create_prefixattn_backend(runner):
    """Attention-backend factory SGLang calls with its ModelRunner (registered under ``prefixattn``)."""
    if getattr(runner, "use_mla_backend", False):  # DeepSeek-V2/V3/R1, Kimi-K2: the latent pool
        from prefixattn.integrations.sglang.mla_backend import PrefixAttnMLABackend, force_absorbed_mla

        force_absorbed_mla(ATTENTION_BACKEND_NAME)
        return PrefixAttnMLABackend(runner)
    from prefixattn.integrations.sglang.backend import PrefixAttnBackend

    return PrefixAttnBackend(runner)


def load() -> None:
    """Register the backend, its CLI choice and the schedule-policy hooks with SGLang (idempotent).

    Called by SGLang's plugin loader (entry point ``prefixattn`` in group ``sglang.srt.plugins``). Raises
    :class:`~prefixattn.integrations.sglang.version.UnsupportedSGLangVersion` for any SGLang release but the supported
    one.
    """
    global _loaded
    with _lock:
        if _loaded:
            return
        check_sglang_version()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

        from prefixattn.integrations.sglang import schedule_policy

        if ATTENTION_BACKEND_NAME not in ATTENTION_BACKENDS:
            register_attention_backend(ATTENTION_BACKEND_NAME)(create_prefixattn_backend)
        if ATTENTION_BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
            add_attention_backend_choices([ATTENTION_BACKEND_NAME])
        schedule_policy.register_hooks()
        _loaded = True


def enable() -> None:
    """:func:`load`, then apply the registered hooks now: for using prefixattn in a process where SGLang's plugin
    loader does not run (tests, notebooks driving SGLang's components directly).

    Inside SGLang do not call this from another plugin: SGLang applies all plugins' hooks together once they are
    all registered.
    """
    load()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
