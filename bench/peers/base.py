"""What every provider hands back, and which engine (venv) each provider needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

#: Provider -> the package it needs (None: only prefixattn/triton). Measured in the CPU interpreter, in this order.
ENGINE_OF = {
    "prefixattn": None,
    "prefixattn-nosharing": None,
    "sglang-triton": "sglang",
    "cascade-sglang": "sglang",
    "vllm-triton": "vllm",
}
CPU_PROVIDERS = list(ENGINE_OF)
#: Module implementing each provider (imported lazily: it may import the engine).
MODULE_OF = {
    "prefixattn": "peers.ours",
    "prefixattn-nosharing": "peers.ours",
    "sglang-triton": "peers.sglang_triton",
    "cascade-sglang": "peers.sglang_triton",
    "vllm-triton": "peers.vllm_triton",
}


class Unavailable(Exception):
    """The peer's package, a feature it needs or the batch's kind is missing: skip, with this message as the reason."""


@dataclass
class Prepared:
    """A provider ready to run one batch: ``run()`` returns ``out [num_tokens, num_qo_heads, head_dim]``.

    ``labels`` names extra memory the kernels read or write (``k_new``: a copy of the new tokens' KV an engine keeps
    beside its cache, ``out``, scratch), so bytes are attributed by meaning rather than by parameter name.
    """

    run: Callable
    labels: dict = field(default_factory=dict)
    notes: str = ""
    extra: dict = field(default_factory=dict)  # provider-specific numbers reported as rows (e.g. planned bytes)
    #: Turns ``run()``'s result into ``out`` where it is something else (a peer returning (out, lse) or two halves).
    output: Callable | None = None
    #: Parts of the provider's work, each run alone (prefixattn: one per work class), timed beside the whole.
    parts: dict = field(default_factory=dict)
    #: Run before each timed run of a part (state a part consumes, such as merge counters); None: nothing.
    reset: Callable | None = None

    def result(self, value):
        return value if self.output is None else self.output(value)
