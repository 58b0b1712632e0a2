"""The one SGLang release this integration is written and tested against, and the check that enforces it.

SGLang's attention-backend base class, forward-batch fields, pool layouts and scheduler internals change between
releases without deprecation; a backend written for one release can silently compute on the wrong rows under
another. So the plugin refuses any other version instead of guessing.
"""

from __future__ import annotations

from importlib import metadata

#: The SGLang release the backend, the pools it reads and the schedule-policy hooks were checked against.
SUPPORTED_SGLANG_VERSION = "0.5.23"


class UnsupportedSGLangVersion(RuntimeError):
    """The installed SGLang is not the release this integration supports."""


def installed_sglang_version() -> str | None:
    """Version string of the installed ``sglang`` distribution, or None when it is not installed (never imports it)."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_sglang_version(version: str | None = None) -> str:
    """Raise :class:`UnsupportedSGLangVersion` unless ``version`` (default: the installed one) is supported.

    Parameters
    ----------
    version : str, optional
        Version to check; defaults to the installed ``sglang`` distribution's version.

    Returns
    -------
    str
        The checked version.

    Examples
    --------
    >>> check_sglang_version("0.5.23")
    '0.5.23'
    """
    found = installed_sglang_version() if version is None else version
    if found is None:
        raise UnsupportedSGLangVersion(
            f"sglang: expected sglang=={SUPPORTED_SGLANG_VERSION} to be installed, got none "
            f"(pip install 'prefixattn[sglang]')"
        )
    if found != SUPPORTED_SGLANG_VERSION:
        raise UnsupportedSGLangVersion(
            f"sglang: expected version {SUPPORTED_SGLANG_VERSION} (the release prefixattn's SGLang backend and "
            f"schedule policy are tested against), got {found}; install sglang=={SUPPORTED_SGLANG_VERSION} or "
            "remove prefixattn from SGLANG_PLUGINS"
        )
    return found
