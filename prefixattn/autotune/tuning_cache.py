"""The persistent on-disk cache of configs tuned on the user's own GPU (written by ``prefixattn tune``).

One JSON file per target under the cache directory::

    $PREFIXATTN_TUNING_DIR            if set, else
    $XDG_CACHE_HOME/prefixattn/tuning if XDG_CACHE_HOME is set, else
    ~/.cache/prefixattn/tuning
        sm90.json, gfx942.json, ...

Each file records the device it was measured on, the Triton version and a fingerprint of the kernel source; entries
map a bucket key to the winning config and its time. A file that cannot be read or parsed, or entries tuned for
another kernel source, are skipped with a :class:`TuningCacheWarning` and the lookup falls back to the shipped table
or the heuristic: a stale cache must never break or silently slow down inference.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from prefixattn.autotune.buckets import Bucket
from prefixattn.autotune.config_space import AttentionConfig

#: Bump when the file layout changes; files of another format are ignored with a warning.
CACHE_FORMAT = 1
#: The kernel whose source fingerprint tags every tuned entry.
KERNEL_MODULE = "prefixattn.kernels.prefix_attention_kernel"


class TuningCacheWarning(UserWarning):
    """A tuning cache file was unreadable or stale and was ignored."""


def default_cache_dir() -> Path:
    env = os.environ.get("PREFIXATTN_TUNING_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "prefixattn" / "tuning"


def cache_path(target_name: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir if cache_dir is not None else default_cache_dir()) / f"{target_name}.json"


def kernel_fingerprint(module: str = KERNEL_MODULE) -> str:
    """First 16 hex digits of the SHA-256 of the kernel's source file ("missing" when it is not installed).

    Read from the file, not from an import: importing the kernel module would decorate its JIT functions.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not os.path.exists(spec.origin):
        return "missing"
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:16]


@dataclass(frozen=True)
class CacheEntry:
    bucket: Bucket
    config: AttentionConfig
    seconds: float
    kernel: str

    def to_dict(self) -> dict:
        return {"bucket": self.bucket.to_dict(), "config": self.config.to_dict(), "seconds": self.seconds,
                "kernel": self.kernel}


class TuningCache:
    """Entries of one target's cache file. Load errors warn and leave the cache empty; :meth:`save` is atomic."""

    def __init__(self, path: Path, *, fingerprint: str | None = None) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint if fingerprint is not None else kernel_fingerprint()
        self.device_name: str | None = None
        self.entries: dict[Bucket, CacheEntry] = {}
        self._load()

    def _warn(self, why: str) -> None:
        warnings.warn(f"prefixattn: ignoring tuning cache {self.path}: {why}; falling back to the shipped configs "
                      "or the heuristic (re-run `prefixattn tune` to rebuild it)", TuningCacheWarning, stacklevel=3)

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            self._warn(f"cannot read it ({type(e).__name__}: {e})")
            return
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"),
                                                                                               dict):
            self._warn(f"expected a format-{CACHE_FORMAT} object with 'entries'")
            return
        self.device_name = data.get("device_name")
        stale = 0
        for key, raw in data["entries"].items():
            try:
                entry = CacheEntry(bucket=Bucket.from_dict(raw["bucket"]),
                                   config=AttentionConfig.from_dict(raw["config"]),
                                   seconds=float(raw["seconds"]), kernel=str(raw.get("kernel", "")))
            except (KeyError, TypeError, ValueError) as e:
                self._warn(f"entry {key!r} is malformed ({e})")
                self.entries.clear()
                return
            if entry.kernel != self.fingerprint:
                stale += 1
                continue
            self.entries[entry.bucket] = entry
        if stale:
            self._warn(f"{stale} entries were tuned for another version of the kernel source")

    def get(self, bucket: Bucket) -> CacheEntry | None:
        return self.entries.get(bucket)

    def put(self, bucket: Bucket, config: AttentionConfig, seconds: float) -> None:
        self.entries[bucket] = CacheEntry(bucket=bucket, config=config, seconds=float(seconds),
                                          kernel=self.fingerprint)

    def save(self, *, target_name: str, device_name: str | None = None, triton_version: str | None = None) -> None:
        """Write every entry (atomically: a crash mid-write leaves the old file, never a torn one)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": CACHE_FORMAT, "target": target_name, "device_name": device_name or self.device_name,
                "triton": triton_version, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "entries": {e.bucket.key(): e.to_dict() for e in sorted(self.entries.values(),
                                                                        key=lambda e: e.bucket)}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
