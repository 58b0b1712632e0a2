"""The policy interface: what an emulated system decides each iteration, and the registry of named policies."""

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


_REGISTRY: dict = {}
#: Policies built on prefixattn.scheduling; listed even when that API is missing, so the error can say why.
SCHEDULED_POLICIES = ("batchllm", "blendserve", "nanoflow-dfs", "prefixattn", "prefixattn-2k",
                      "prefixattn-overlap")
_missing: dict = {}


def register(name: str, factory, help_text: str) -> None:
    """Register a policy factory ``factory(**options) -> Policy`` under ``name``."""
    _REGISTRY[name] = (factory, help_text)


def policy_names() -> list:
    _load_builtin()
    return sorted(set(_REGISTRY) | set(SCHEDULED_POLICIES))


def policy_help() -> dict:
    _load_builtin()
    out = {name: text for name, (_, text) in _REGISTRY.items()}
    for name in SCHEDULED_POLICIES:
        out.setdefault(name, f"unavailable: {_missing.get('error', 'not registered')}")
    return dict(sorted(out.items()))


def make_policy(name: str, **options) -> Policy:
    """Build a registered policy by name.

    Examples
    --------
    >>> make_policy("vllm").name
    'vllm'
    """
    _load_builtin()
    if name not in _REGISTRY:
        if name in SCHEDULED_POLICIES:
            raise ValueError(f"policy: {name!r} needs prefixattn.scheduling, which failed to import: "
                             f"{_missing.get('error')}")
        raise ValueError(f"policy: expected one of {policy_names()}, got {name!r}")
    return _REGISTRY[name][0](**options)


def _load_builtin() -> None:
    # imported for their register() side effects; lazy so that base has no import cycle
    from prefixattn.sim.policies import engines  # noqa: F401
    if "error" in _missing or all(n in _REGISTRY for n in SCHEDULED_POLICIES):
        return
    try:
        from prefixattn.sim.policies import scheduled  # noqa: F401
    except ImportError as e:
        _missing["error"] = f"{type(e).__name__}: {e}"
