"""The policy interface: what an emulated system decides each iteration."""

from __future__ import annotations


#: ``steady_steps`` answer meaning "as many as the engine finds safe" (it still stops at the first finish and at the
#: memory limit).
UNBOUNDED_STEPS = 2 ** 62


class Policy:
    """Decisions of one serving system; :class:`prefixattn.sim.engine.Engine` does the mechanics.

    Class attributes describe the system: ``kernel`` (``paged``/``cascade``/``fused``), ``split_k``, ``backend``
    (``sequential``/``overlap``), ``cache_mode`` (``lru``/``radix``/``None``, see :mod:`prefixattn.sim.kvpool`) and
    ``prefix_sharing`` (whether prompts may reuse cached or held KV at all).
    """

    name = "policy"
    kernel = "paged"
    split_k = False
    backend = "sequential"
    cache_mode: str | None = "lru"
    prefix_sharing = True
    #: True when ``steady_steps`` returns steps the policy has already planned (the engine must run exactly those)
    commits_steady_steps = False
    #: Memory-centric admission projection (:data:`prefixattn.scheduling.admission.PROJECTIONS`) of a policy that
    #: admits with prefixattn's admission rule; None for a system that admits by its own rules (vLLM, SGLang)
    projection: str | None = None

    def use_projection(self, projection: str) -> None:
        """Admit with ``projection`` (policies with a :attr:`projection` only)."""
        raise ValueError(f"projection: policy {self.name} admits by its own rules, not prefixattn's; got "
                         f"{projection!r}")

    def block_size(self, calib) -> int:
        return int(calib.block_size)

    def kv_capacity_tokens(self, cost) -> int:
        """KV pool size for this system's memory rules (override)."""
        raise NotImplementedError

    def prepare(self, engine) -> None:
        """Offline work before the first step (ordering, grouping)."""

    def schedule(self, engine) -> list:
        """The next step as ``[(seq, new_tokens), ...]``; blocks for the new tokens must be allocated."""
        raise NotImplementedError

    def steady_steps(self, engine, plan) -> int:
        """How many identical pure-decode steps ``plan`` may repeat without this policy deciding differently
        (admission impossible until something finishes). 1 = no promise."""
        return 1

    def decode_reserve_blocks(self, engine) -> int:
        """Blocks a decode stretch must leave free."""
        return 0

    def on_step_done(self, engine, finished: list) -> None:
        """Requests in ``finished`` completed in the step just executed (their KV is already released)."""

    def describe(self) -> dict:
        return dict(name=self.name, kernel=self.kernel, split_k=self.split_k, backend=self.backend,
                    cache=self.cache_mode, prefix_sharing=self.prefix_sharing)
