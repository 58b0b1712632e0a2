"""Prefix-affinity data parallelism on Ray Data: :func:`run_batch`.

Naive sharding (by row, or ``Dataset.split``) spreads every prefix group over the replicas, so each replica
recomputes each shared prefix. :func:`run_batch` keeps groups whole:

1. **Group on the driver**: :func:`prefixattn.scheduling.group_prompts` over all prompts, then
   :func:`prefixattn.scheduling.partition_groups` assigns whole groups to the N replicas, balancing their cost
   (splitting only a group that alone exceeds a replica's fair share).
2. **Repartition by replica**: one Ray Data block per replica, its rows in prefix-tree order.
3. **One stateful actor per replica**: ``map_batches`` over an actor pool of N actors, one block per call and one
   call in flight per actor; each actor builds its engine once (:mod:`prefixattn.integrations.ray.engines`: vLLM with
   prefixattn's backend and scheduler, the simulator, or any callable) and runs the replica's whole share in one
   ``generate`` call, so the engine sees every group complete.
4. **Join back**: outputs are joined to the input rows by request id (the row's input position) and returned in
   input order, with per-replica stats.

Failures: Ray restarts an actor that dies and retries its task (``max_restarts`` / ``max_task_retries`` =
``max_retries``); exceptions raised inside the actor are retried too (``retry_exceptions``). A replica's result is
a function of its rows only, so a retry recomputes the same outputs: the join keeps exactly one output per request
id (a duplicate is dropped and counted, a missing one is an error), and every replica whose work started more than
once is listed in :attr:`BatchResult.retried` with its prefix groups.

The grouping pre-pass runs on the driver by default. ``grouping="distributed"`` runs it on Ray workers instead
(:mod:`prefixattn.integrations.ray.prepass`: bucket by a hash of the first ``bucket_tokens`` tokens, ``group_prompts``
per bucket in parallel, merge on the driver); it is exact for sharing of at least ``bucket_tokens`` tokens and loses
shallower sharing (see there). Either way the rows themselves pass through the driver: a list or JSONL input is read
there, a Dataset input is collected there in order (``take_all``), and the results are joined there.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefixattn.integrations.ray.engines import as_engine
from prefixattn.scheduling import group_prompts, saving_ratio
from prefixattn.scheduling.partition import Partition, partition_groups, token_cost

#: Columns the pipeline adds to every row (input position = request id, and the replica that owns it).
ROW_COLUMN = "__row__"
REPLICA_COLUMN = "__replica__"
_OWN_COLUMNS = (ROW_COLUMN, REPLICA_COLUMN)
GROUPINGS = ("driver", "distributed")


@dataclass
class BatchResult:
    """What :func:`run_batch` returns.

    Attributes
    ----------
    rows : list[dict]
        One per input row, in input order: the input columns plus the engine's output columns.
    partition : Partition
        The group-to-replica assignment.
    replica_stats : list[dict]
        Per replica: requests, groups, prompt tokens, tokens computed after sharing, estimated cost, attempts,
        the actors that ran it, wall seconds of the engine call, and the engine's own ``stats()``.
    retried : list[dict]
        Replicas whose work started more than once (an actor died or raised): ``replica``, ``attempts``,
        ``groups`` (indices into the driver's groups), ``requests``.
    duplicates_dropped : int
        Outputs delivered twice for one request id and dropped by the join (0 when Ray delivered each once).
    saving_ratio, single_replica_saving_ratio : float
        BatchLLM Eq. 2 of the partition (recomputation of split groups included) and of one replica.
    """

    rows: list
    partition: Partition
    replica_stats: list
    retried: list = field(default_factory=list)
    duplicates_dropped: int = 0
    saving_ratio: float = 0.0
    single_replica_saving_ratio: float = 0.0

    def report(self) -> str:
        """A short text report: per-replica lines, balance, saving kept, retries."""
        p = self.partition
        lines = [f"{len(self.rows)} requests on {p.num_replicas} replicas, {len(p.groups)} groups "
                 f"({len(p.split)} split), load balance {p.balance:.4f}, saving ratio {self.saving_ratio:.4f} of "
                 f"{self.single_replica_saving_ratio:.4f} on one replica"]
        for s in self.replica_stats:
            lines.append(f"  replica {s['replica']}: {s['requests']} requests, {s['groups']} groups, "
                         f"{s['computed_tokens']}/{s['prompt_tokens']} prompt tokens computed, attempts "
                         f"{s['attempts']}, engine {s['wall_s']:.2f} s")
        for r in self.retried:
            lines.append(f"  retried: replica {r['replica']} ({r['attempts']} attempts; groups {r['groups']})")
        if self.duplicates_dropped:
            lines.append(f"  duplicates dropped: {self.duplicates_dropped}")
        return "\n".join(lines)


class _Collector:
    """Records, per replica, every attempt (which actor started it) and the stats of finished attempts."""

    def __init__(self) -> None:
        self.attempts: dict = {}
        self.finished: dict = {}

    def started(self, replica: int, actor: str) -> None:
        self.attempts.setdefault(replica, []).append(actor)

    def done(self, replica: int, stats: dict) -> None:
        self.finished[replica] = stats

    def snapshot(self) -> tuple:
        return self.attempts, self.finished


class ReplicaWorker:
    """The stateful ``map_batches`` callable: owns one engine, runs a replica's whole share per call."""

    def __init__(self, engine_factory, prompt_column: str, collector) -> None:
        self.engine = as_engine(engine_factory())
        self.prompt_column = prompt_column
        self.collector = collector
        self.actor = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch):
        import pandas as pd
        import ray.data

        parts = []
        for replica, part in batch.groupby(REPLICA_COLUMN, sort=True):
            replica = int(replica)
            ray.get(self.collector.started.remote(replica, self.actor))
            prompts = [[int(t) for t in p] for p in part[self.prompt_column]]
            rows = part.drop(columns=list(_OWN_COLUMNS)).to_dict("records")
            t0 = time.perf_counter()
            outputs = self.engine.generate(prompts, rows)
            wall = time.perf_counter() - t0
            if len(outputs) != len(prompts):
                raise RuntimeError(f"engine: expected {len(prompts)} outputs (one per prompt), got {len(outputs)}")
            out = part.reset_index(drop=True).copy()
            keys = list(dict.fromkeys(k for o in outputs for k in o))
            for k in keys:
                if k in out.columns:
                    raise RuntimeError(f"engine: output column {k!r} collides with an input column")
                out[k] = pd.Series([o.get(k) for o in outputs], dtype=object)
            stats_fn = getattr(self.engine, "stats", None)
            stats = dict(stats_fn()) if callable(stats_fn) else {}
            ray.get(self.collector.done.remote(replica, dict(wall_s=wall, actor=self.actor, engine=stats)))
            parts.append(out)
        return pd.concat(parts, ignore_index=True) if parts else batch


# ---------------------------------------------------------------------------------------------------- inputs
def _load_rows(data, prompt_column: str) -> list:
    """Rows (dicts) in input order from a Ray Dataset, a JSONL path, a list of dicts or a list of prompts."""
    if isinstance(data, (str, Path)):
        path = Path(data)
        rows = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"data: line {lineno} of {path} is not JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"data: line {lineno} of {path}: expected a JSON object, got "
                                     f"{type(obj).__name__}")
                rows.append(obj)
        return rows
    if type(data).__module__.startswith("ray.data"):
        from ray.data import DataContext

        ctx = DataContext.get_current()
        keep = ctx.execution_options.preserve_order
        ctx.execution_options.preserve_order = True  # input order is the order the rows are read in
        try:
            return [dict(r) for r in data.take_all()]
        finally:
            ctx.execution_options.preserve_order = keep
    if isinstance(data, (list, tuple)):
        if data and not isinstance(data[0], dict):
            return [{prompt_column: p} for p in data]
        return [dict(r) for r in data]
    raise ValueError(f"data: expected a ray.data.Dataset, a .jsonl path, a list of rows (dicts) or a list of "
                     f"prompts, got {type(data).__name__}")


def _prompts(rows: list, prompt_column: str) -> list:
    prompts = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"data[{i}]: expected a row (dict), got {type(row).__name__}")
        if prompt_column not in row:
            raise ValueError(f"data[{i}]: expected a {prompt_column!r} column (token ids), got columns "
                             f"{sorted(row)}")
        p = row[prompt_column]
        try:
            p = [int(t) for t in p]
        except (TypeError, ValueError):
            raise ValueError(f"data[{i}][{prompt_column!r}]: expected a list of token ids, got "
                             f"{type(row[prompt_column]).__name__}") from None
        if not p:
            raise ValueError(f"data[{i}][{prompt_column!r}]: expected at least one token, got none")
        for c in _OWN_COLUMNS:
            if c in row:
                raise ValueError(f"data[{i}]: the column {c!r} is reserved for the pipeline")
        prompts.append(p)
    if not prompts:
        raise ValueError("data: expected at least one row, got none")
    return prompts


def _output_lens(rows: list, column: str | None):
    for key in (column, "max_tokens", "output_len"):
        if key and all(row.get(key) is not None for row in rows):
            return [int(row[key]) for row in rows]
    return None


def _plain(v):
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


# ---------------------------------------------------------------------------------------------------- pipeline
def run_batch(data, engine, num_replicas: int, *, prompt_column: str = "prompt_token_ids",
              output_len_column: str | None = None, levels: int | None = 1, cost=None, allow_split: bool = True,
              num_cpus: float = 1.0, num_gpus: float = 0.0, max_retries: int = 3, retry_exceptions: bool = True,
              ray_remote_args: dict | None = None, grouping: str = "driver", bucket_tokens: int | None = None,
              num_buckets: int = 16) -> BatchResult:
    """Run an offline batch over ``num_replicas`` engine actors on Ray Data, prefix groups kept whole.

    Parameters
    ----------
    data : ray.data.Dataset | str | Path | list[dict] | list[list[int]]
        The requests: a Dataset, a JSONL file (one object per line) or rows, each with ``prompt_column`` (token
        ids); or bare prompts.
    engine : callable
        Zero-argument factory, called once in each actor: returns an engine (``generate(prompts, rows)``, see
        :mod:`prefixattn.integrations.ray.engines`) or a callable ``fn(prompts) -> list`` (output column ``output``). It
        is pickled to the actors: a class, a ``functools.partial`` or a module-level function.
    num_replicas : int
        Engine replicas N (actors; one GPU each with ``num_gpus=1``).
    prompt_column : str
        The column with each row's prompt token ids.
    output_len_column : str, optional
        Column with each request's expected output tokens, for the cost (then ``max_tokens``, ``output_len``).
    levels : int or None
        :func:`prefixattn.scheduling.group_prompts` nesting depth.
    cost : callable, optional
        ``cost(group) -> float`` for the partitioner (e.g. :class:`prefixattn.sim.group_cost.GroupCostModel`);
        default: :func:`prefixattn.scheduling.token_cost` (prefill after sharing + output tokens when known).
    allow_split : bool
        Let the partitioner split a group that alone exceeds a replica's fair share.
    num_cpus, num_gpus : float
        Resources of each actor.
    max_retries : int
        Actor restarts and task retries Ray may use (each replica's task is retried at most this often).
    retry_exceptions : bool
        Retry exceptions raised by the engine too (not only actor deaths).
    ray_remote_args : dict, optional
        More ``map_batches`` Ray arguments (e.g. ``runtime_env``, ``accelerator_type``).
    grouping : {"driver", "distributed"}
        Where the groups are computed: one ``group_prompts`` call on the driver, or the distributed pre-pass
        (:func:`prefixattn.integrations.ray.prepass.group_prompts_distributed`; sharing shorter than ``bucket_tokens``
        is lost).
    bucket_tokens : int, optional
        ``grouping="distributed"``: key length of the buckets (default
        :data:`prefixattn.integrations.ray.prepass.DEFAULT_BUCKET_TOKENS`).
    num_buckets : int
        ``grouping="distributed"``: buckets grouped in parallel.

    Returns
    -------
    BatchResult
        ``rows`` in input order, each with the engine's outputs; per-replica stats; retried replicas.

    Raises
    ------
    ValueError
        Bad ``data`` (no rows, a row without token ids, a reserved column), ``num_replicas``, ``max_retries``,
        ``grouping``.
    RuntimeError
        A request got no output (lost after the retries were spent).

    Examples
    --------
    >>> import ray
    >>> ray.init(num_cpus=2)
    >>> from prefixattn.integrations.ray.engines import SimulatedEngine
    >>> out = run_batch("prompts.jsonl", SimulatedEngine, num_replicas=2)
    >>> out.rows[0]["finish_time_s"], out.report()
    """
    _check_run_args(num_replicas=num_replicas, max_retries=max_retries, engine=engine, grouping=grouping)
    rows = _load_rows(data, prompt_column)
    prompts = _prompts(rows, prompt_column)
    groups = _group(prompts, grouping=grouping, prompt_column=prompt_column, levels=levels,
                    bucket_tokens=bucket_tokens, num_buckets=num_buckets, num_cpus=num_cpus)
    part = partition_groups(groups, int(num_replicas), cost or token_cost(_output_lens(rows, output_len_column)),
                            allow_split=allow_split)
    result, attempts, finished = _run_replicas(
        _replica_frames(rows, part), engine, prompt_column=prompt_column, num_cpus=num_cpus, num_gpus=num_gpus,
        max_retries=max_retries, retry_exceptions=retry_exceptions, ray_remote_args=ray_remote_args)
    return _batch_result(result, attempts, finished, part=part, prompts=prompts, groups=groups)


def _check_run_args(*, num_replicas, max_retries, engine, grouping) -> None:
    """The ray extra is installed, and :func:`run_batch`'s scalar arguments are valid."""
    import pandas  # noqa: F401  (fail before any work when the ray extra is missing)
    import ray.data  # noqa: F401

    if isinstance(num_replicas, bool) or not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
        raise ValueError(f"num_replicas: expected a positive int, got {num_replicas!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, (int, np.integer)) or max_retries < 0:
        raise ValueError(f"max_retries: expected an int >= 0, got {max_retries!r}")
    if not callable(engine):
        raise ValueError(f"engine: expected a zero-argument factory of the engine, got {type(engine).__name__}")
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping: expected one of {GROUPINGS}, got {grouping!r}")


def _group(prompts: list, *, grouping: str, prompt_column: str, levels, bucket_tokens, num_buckets: int,
           num_cpus: float) -> list:
    """Step 1: the prefix groups of all prompts, on the driver or by the distributed pre-pass."""
    if grouping == "distributed":
        import ray.data

        from prefixattn.integrations.ray.prepass import DEFAULT_BUCKET_TOKENS, group_prompts_distributed

        pre = ray.data.from_items([{ROW_COLUMN: i, prompt_column: p} for i, p in enumerate(prompts)])
        return group_prompts_distributed(pre, prompt_column=prompt_column,
                                         bucket_tokens=bucket_tokens or DEFAULT_BUCKET_TOKENS,
                                         num_buckets=num_buckets, levels=levels, num_cpus=num_cpus)
    return group_prompts(prompts, levels=levels)


def _replica_frames(rows: list, part: Partition) -> list:
    """Step 2: one DataFrame per replica with rows, its rows in prefix-tree order, tagged with their request id
    (input position) and replica."""
    import pandas as pd

    frames = []
    for r in range(part.num_replicas):
        ids = [i for g in part.replica_groups(r) for i in g.request_ids]  # prefix-tree order within the replica
        if ids:
            df = pd.DataFrame([rows[i] for i in ids])
            df[ROW_COLUMN] = np.asarray(ids, dtype=np.int64)
            df[REPLICA_COLUMN] = r
            frames.append(df)
    return frames


def _run_replicas(frames: list, engine, *, prompt_column: str, num_cpus: float, num_gpus: float, max_retries: int,
                  retry_exceptions: bool, ray_remote_args: dict | None) -> tuple:
    """Step 3: each frame as one Ray Data block, mapped by a pool of one :class:`ReplicaWorker` actor per frame.
    Returns the outputs (a DataFrame, one row per delivered output, any order) and the collector's
    ``(attempts, finished)``."""
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    collector = ray.remote(num_cpus=0)(_Collector).remote()
    ctx = DataContext.get_current()
    saved = (ctx.actor_task_retry_on_errors, ctx.execution_options.preserve_order)
    ctx.actor_task_retry_on_errors = bool(retry_exceptions)
    try:
        shards = [ray.data.from_pandas(df) for df in frames]  # one block per replica
        ds = shards[0].union(*shards[1:]) if len(shards) > 1 else shards[0]
        with warnings.catch_warnings():
            # Ray 2.60 takes max_restarts / max_task_retries only through **ray_remote_args, which it flags as
            # deprecated (named parameters come in later releases); the bounded retries need them.
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            out = ds.map_batches(
                ReplicaWorker, batch_size=None, batch_format="pandas",
                compute=ActorPoolStrategy(size=len(frames), max_tasks_in_flight_per_actor=1),
                fn_constructor_args=(engine, prompt_column, collector), num_cpus=num_cpus, num_gpus=num_gpus,
                max_restarts=int(max_retries), max_task_retries=int(max_retries), **(ray_remote_args or {}))
        result = out.to_pandas()
        attempts, finished = ray.get(collector.snapshot.remote())
    finally:
        ctx.actor_task_retry_on_errors, ctx.execution_options.preserve_order = saved
        ray.kill(collector)
    return result, attempts, finished


def _batch_result(result, attempts: dict, finished: dict, *, part: Partition, prompts: list,
                  groups: list) -> BatchResult:
    """Step 4: the outputs joined back to the requests (:func:`_join_outputs`), with per-replica stats."""
    out_rows, duplicates = _join_outputs(result, len(prompts))
    stats, retried = _replica_stats(part, attempts, finished)
    return BatchResult(rows=out_rows, partition=part, replica_stats=stats, retried=retried,
                       duplicates_dropped=duplicates, saving_ratio=part.saving_ratio(),
                       single_replica_saving_ratio=saving_ratio(prompts, groups))


def _join_outputs(result, num_requests: int) -> tuple[list, int]:
    """Exactly one output per request id: the rows in input order (the pipeline's columns dropped, numpy
    values as plain Python) and the number of duplicates dropped. A request with no output is an error."""
    ids = result[ROW_COLUMN].to_numpy(dtype=np.int64)
    counts = np.bincount(ids, minlength=num_requests)
    if (counts == 0).any():
        missing = np.flatnonzero(counts == 0)
        raise RuntimeError(f"run_batch: {missing.size} requests got no output (first: {missing[:8].tolist()})")
    duplicates = int(counts.sum() - num_requests)
    result = result.drop_duplicates(subset=[ROW_COLUMN], keep="first").sort_values(ROW_COLUMN, kind="stable")
    out_rows = [{k: _plain(v) for k, v in rec.items() if k not in _OWN_COLUMNS}
                for rec in result.to_dict("records")]
    return out_rows, duplicates


def _replica_stats(part: Partition, attempts: dict, finished: dict) -> tuple[list, list]:
    """Per replica: the stats of :attr:`BatchResult.replica_stats`; and the replicas started more than once
    (:attr:`BatchResult.retried`)."""
    stats, retried = [], []
    for r in range(part.num_replicas):
        gidx = np.flatnonzero(part.replicas == r)
        gs = [part.groups[i] for i in gidx.tolist()]
        fin = finished.get(r, {})
        tries = attempts.get(r, [])
        stats.append(dict(replica=r, requests=sum(g.num_requests for g in gs), groups=len(gs),
                          prompt_tokens=sum(g.logical_tokens for g in gs),
                          computed_tokens=sum(g.processed_tokens for g in gs),
                          est_cost=float(part.costs[gidx].sum()), attempts=len(tries), actors=sorted(set(tries)),
                          wall_s=float(fin.get("wall_s", 0.0)), engine=fin.get("engine", {})))
        if len(tries) > 1:
            retried.append(dict(replica=r, attempts=len(tries), groups=sorted({int(part.source[i]) for i in gidx}),
                                requests=stats[-1]["requests"]))
    return stats, retried
