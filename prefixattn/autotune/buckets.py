"""Shape buckets: the key tuned configs are stored under, and the distance used for nearest-bucket lookup.

A step's attention shape is summarized by head size, GQA group, query rows per shared node, longest query chunk of
any request (1 for pure decode), the shared KV length and the dtype. Counts are rounded up to powers of two (a
config tuned for 1000 rows serves 700 as well as 1000), so a handful of buckets cover every step.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from prefixattn.autotune.config_space import DTYPE_BYTES, pow2_at_least
from prefixattn.memo import typed_memo

#: Clamp ranges of the power-of-two buckets. Beyond these the best tiles no longer change: a shared node with more
#: than 4096 query rows already fills every SM with full M tiles, and KV longer than 64K only lengthens the loop.
GROUP_RANGE = (1, 16)
Q_ROWS_RANGE = (1, 4096)
MAX_Q_LEN_RANGE = (1, 4096)
KV_LEN_RANGE = (16, 65536)

#: Fields compared by distance (log2 scale), and those that must match exactly.
_NUMERIC_FIELDS = ("group", "q_rows", "max_q_len", "kv_len")
_KEY_RE = re.compile(r"d(?P<d>\d+)-(?P<dtype>fp16|bf16|fp32)-g(?P<g>\d+)-q(?P<q>\d+)-l(?P<l>\d+)-kv(?P<kv>\d+)")


def _pow2_bucket(x: int, lo: int, hi: int) -> int:
    return pow2_at_least(min(max(int(x), lo), hi))


@dataclass(frozen=True, order=True)
class Bucket:
    """A bucketed shape. ``head_dim`` and ``dtype`` are exact; the counts are powers of two."""

    head_dim: int
    dtype: str
    group: int
    q_rows: int
    max_q_len: int
    kv_len: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Bucket":
        try:
            return cls(head_dim=int(d["head_dim"]), dtype=str(d["dtype"]), group=int(d["group"]),
                       q_rows=int(d["q_rows"]), max_q_len=int(d["max_q_len"]), kv_len=int(d["kv_len"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bucket: expected head_dim, dtype, group, q_rows, max_q_len, kv_len; got {d!r} ({e})") \
                from None

    def key(self) -> str:
        """Stable string key for JSON objects: ``d128-fp16-g4-q256-l1-kv4096``."""
        return (f"d{self.head_dim}-{self.dtype}-g{self.group}-q{self.q_rows}-l{self.max_q_len}-kv{self.kv_len}")

    @classmethod
    def from_key(cls, key: str) -> "Bucket":
        """Inverse of :meth:`key`; ValueError on anything else."""
        m = _KEY_RE.fullmatch(key)
        if m is None:
            raise ValueError(f"bucket key: expected the form d128-fp16-g4-q256-l1-kv4096, got {key!r}")
        return cls(head_dim=int(m["d"]), dtype=m["dtype"], group=int(m["g"]), q_rows=int(m["q"]),
                   max_q_len=int(m["l"]), kv_len=int(m["kv"]))


def dtype_name(dtype) -> str:
    """``torch.float16`` / ``"float16"`` / ``"fp16"`` -> ``"fp16"`` (no torch import needed)."""
    s = str(dtype).replace("torch.", "")
    s = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}.get(s, s)
    if s not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of fp16/bf16/fp32 (or the torch dtypes), got {dtype!r}")
    return s


@typed_memo(maxsize=4096)  # plan() buckets its shape every step (~4 us on the 2-core host)
def make_bucket(*, head_dim: int, dtype, group: int = 1, q_rows: int = 1, max_q_len: int = 1,
                kv_len: int = 1024) -> Bucket:
    """Bucket a raw shape. ``q_rows``: query tokens under one shared node (typical or largest of the step);
    ``max_q_len``: longest query chunk of a request; ``kv_len``: KV length of a shared node."""
    return _make_bucket(head_dim=head_dim, dtype=dtype, group=group, q_rows=q_rows, max_q_len=max_q_len,
                        kv_len=kv_len)


def _make_bucket(*, head_dim, dtype, group, q_rows, max_q_len, kv_len) -> Bucket:
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim: expected a positive int, got {head_dim!r}")
    if not isinstance(group, int) or group <= 0:
        raise ValueError(f"group: expected a positive int (num_qo_heads // num_kv_heads), got {group!r}")
    for name, v in (("q_rows", q_rows), ("max_q_len", max_q_len), ("kv_len", kv_len)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {v!r}")
    return Bucket(head_dim=head_dim, dtype=dtype_name(dtype), group=_pow2_bucket(group, *GROUP_RANGE),
                  q_rows=_pow2_bucket(q_rows, *Q_ROWS_RANGE), max_q_len=_pow2_bucket(max_q_len, *MAX_Q_LEN_RANGE),
                  kv_len=_pow2_bucket(kv_len, *KV_LEN_RANGE))


def distance(a: Bucket, b: Bucket) -> float:
    """L1 distance in log2 space over the counts; ``inf`` when head size or dtype differ.

    The decode/prefill axis (``max_q_len``) weighs double: suffix tiles for one-token decode and for prefill chunks
    differ most, so a decode step should rather take a decode config of another KV length than a prefill config.
    """
    if a.head_dim != b.head_dim or a.dtype != b.dtype:
        return math.inf
    d = 0.0
    for f in _NUMERIC_FIELDS:
        w = 2.0 if f == "max_q_len" else 1.0
        d += w * abs(math.log2(getattr(a, f)) - math.log2(getattr(b, f)))
    return d


def nearest(bucket: Bucket, candidates) -> Bucket | None:
    """The candidate bucket nearest to ``bucket`` (ties broken by bucket order, so the answer is deterministic)."""
    best, best_d = None, math.inf
    for c in sorted(candidates):
        d = distance(bucket, c)
        if d < best_d:
            best, best_d = c, d
    return best
