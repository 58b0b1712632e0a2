"""One call to simulate several policies on one workload: :func:`simulate`."""

from __future__ import annotations

from prefixattn.scheduling.admission import PROJECTIONS
from prefixattn.sim.calibration import Calibration
from prefixattn.sim.step_cost import CostModel
from prefixattn.sim.engine import Engine
from prefixattn.sim.policies import make_policy
from prefixattn.sim.workloads import Workload, get_workload


def simulate(workload, policies, model: str = "mistral-7b", gpu: str = "a100", *, num_requests: int | None = None,
             seed: int = 0, calibration: Calibration | None = None, backend: str | None = None,
             projection: str | None = None, progress=None) -> list:
    """Run each policy on the workload and return their :class:`prefixattn.sim.metrics.SimResult` (modeled).

    Parameters
    ----------
    workload : str or Workload
        A name from :data:`prefixattn.sim.workloads.WORKLOADS`, a ``.jsonl`` path, or a built workload.
    policies : list of str
        Names from :func:`prefixattn.sim.policies.policy_names`.
    model, gpu : str
        Presets (:mod:`prefixattn.sim.presets`).
    num_requests : int, optional
        Truncate / size the workload.
    calibration : Calibration, optional
        Constants table with overrides (what-if); the same for every policy.
    backend : {"sequential", "overlap"}, optional
        Force every policy onto one engine backend (default: each system's own).
    projection : {"ends", "peak"}, optional
        Memory-centric admission projection of the policies that admit with prefixattn's admission rule
        (:mod:`prefixattn.scheduling.admission`; their names get ``-peak``); the engine emulations (vLLM, SGLang)
        keep their own admission. Default: each policy's own (``ends``).
    progress : callable, optional
        ``progress(policy_name, num_requests)`` returns a callback ``update(n_finished)`` (e.g. a tqdm bar's).

    Examples
    --------
    >>> rows = simulate("batchllm-case1", ["vllm"], num_requests=30)
    >>> rows[0].policy, rows[0].modeled
    ('vllm', True)
    """
    if isinstance(policies, str):
        policies = [p for p in policies.split(",") if p]
    if not policies:
        raise ValueError("policies: expected at least one policy name, got none")
    built = [make_policy(name) for name in policies]  # fail on a bad name before any work
    if projection is not None:
        if projection not in PROJECTIONS:
            raise ValueError(f"projection: expected one of {PROJECTIONS}, got {projection!r}")
        for policy in built:
            if policy.projection is not None:
                policy.use_projection(projection)
    if not isinstance(workload, Workload):
        workload = get_workload(workload, num_requests=num_requests, seed=seed)
    elif num_requests is not None:  # head() refuses n < 1 (0 must not mean "all", -2 must not slice)
        workload = workload.head(num_requests)
    cost = CostModel(gpu, model, calibration)
    results = []
    for policy in built:
        if backend is not None:
            policy.backend = backend
        update = progress(policy.name, len(workload)) if progress else None
        results.append(Engine(workload, cost, policy).run(progress=update))
    return results
