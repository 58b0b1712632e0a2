"""One-off: prove that the format-2 tables give every lookup the tiles the format-1 tables gave.

    python scripts/compare_tile_lookups.py OLD_TREE NEW_TREE

Each tree is a checkout's root (the commit before the conversion, and after it). The script runs itself in each tree
(``--dump``) with an empty tuning cache and no fixed config, and compares what the two answer:

* the shipped rows of every target (its table with the measured overrides): each bucket's tiles and launches;
* the table step of the lookup (``lookup.nearest_entry``, where the tables enter the chain; the steps before and
  after it do not read them) for every target, every head size ``plan()`` takes, every dtype, GQA groups 1-128 and
  the bucket grid of query rows, query length and KV length: the matched bucket and its tiles and launches;
* ``choose_tiles`` (the planner's call, through the whole chain with the cost model and the heuristic) for every
  target and every head size, dtype, group and query length it can be asked: the tiles of the three classes;
* compile-check's jobs: the default configs of every target, head size and dtype, CI's worst-case selection for
  every target, and the Triton 3.6 suite's selection (sm90 and gfx942, bf16, head_dim 64 and 128).

Exit status 0 when every answer is equal.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 17, 24, 32, 48, 64, 128)
POW2 = tuple(2**i for i in range(13))  # 1 .. 4096
KV_LENS = tuple(2**i for i in range(4, 17))  # 16 .. 65536


def _tiles(t) -> list:
    return [t.block_m, t.block_n]


def _launch(lo) -> dict:
    return lo.to_dict()


def _live(cfg) -> list:
    return [_tiles(cfg.shared), _launch(cfg.launch_for(True)), _tiles(cfg.suffix), _launch(cfg.launch_for(False)),
            cfg.short()]


def dump() -> dict:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.pop("PREFIXATTN_TILE_CONFIG", None)
    os.environ["PREFIXATTN_TUNING_DIR"] = tempfile.mkdtemp()
    from prefixattn.autotune import lookup
    from prefixattn.autotune.buckets import Bucket
    from prefixattn.autotune.targets import TARGETS
    from prefixattn.planner.tiles import choose_tiles
    from prefixattn.validation import SUPPORTED_HEAD_DIMS

    try:
        from prefixattn.tuning import compile_check
    except ImportError:
        from prefixattn.autotune import compile_check

    out: dict = {"rows": {}, "nearest": {}, "tiles": {}, "defaults": {}, "jobs": {}}
    for name, target in TARGETS.items():
        table = lookup.load_shipped(name)
        out["rows"][name] = {b.key(): _live(c) for b, c in sorted(table.items())}
        answers = out["nearest"][name] = []
        for head_dim, dtype, group, q_rows, max_q_len, kv_len in itertools.product(
                SUPPORTED_HEAD_DIMS, ("fp16", "bf16", "fp32"), GROUPS, (1, 16, 64, 1024, 4096), POW2, (16, 1024, 4096,
                                                                                                     16384, 65536)):
            bucket = Bucket(head_dim=head_dim, dtype=dtype, group=min(group, 16), q_rows=q_rows, max_q_len=max_q_len,
                            kv_len=kv_len)
            found = lookup.nearest_entry(bucket, table, target, group)
            answers.append(None if found is None else [found[0].key(), _live(found[1])])
        tiles = out["tiles"][name] = []
        with lookup.planning_target(name):
            for head_dim, dtype, group, max_q_len in itertools.product(
                    SUPPORTED_HEAD_DIMS, ("fp16", "bf16", "fp32"), GROUPS, POW2):
                t = choose_tiles(head_dim=head_dim, group=group, max_q_len=max_q_len, dtype=dtype)
                tiles.append([[c.block_m, c.block_n, _launch(c.launch)] for c in (t.shared, t.chunk, t.decode)]
                             + [t.block_d, t.is_hip])
        for head_dim, dtype in itertools.product((64, 80, 96, 128, 256), ("fp16", "bf16", "fp32")):
            out["defaults"][f"{name}-d{head_dim}-{dtype}"] = [
                [mode, _live(cfg)] for mode, cfg in compile_check.default_attention_configs(target, head_dim, dtype)]
    selections = {"worst-case": compile_check.worst_case_jobs(list(TARGETS.values())),
                  "triton36": [j for t, hds in (("sm90", [64, 128]), ("gfx942", [128]))
                               for j in compile_check.build_jobs(targets=[TARGETS[t]], kernels=list(
                                   compile_check.KERNELS), dtypes=["bf16"], head_dims=hds)]}
    for selection, jobs in selections.items():
        out["jobs"][selection] = [_job(j) for j in jobs]
    return out


def _job(job) -> dict:
    """A compile job as data, its config as the tiles and launches it holds (the rest decides the binary)."""
    from dataclasses import asdict

    from prefixattn.autotune.config_space import AttentionConfig

    d = asdict(job)
    config = d.pop("config")
    d["config"] = _live(AttentionConfig.from_dict(config)) if "shared" in config else config
    d["attrs"] = {str(k): v for k, v in d["attrs"].items()}
    return json.loads(json.dumps(d, default=list))


def compare(old: dict, new: dict) -> list[str]:
    problems = []
    for section in old:
        for key in sorted(set(old[section]) | set(new[section])):
            a, b = old[section].get(key), new[section].get(key)
            if a != b:
                n = len(a) if isinstance(a, (list, dict)) else 0
                problems.append(f"{section}/{key}: differs ({n} answers in the old tree)")
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["--dump"]:
        json.dump(dump(), sys.stdout)
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    answers = []
    for tree in argv:
        run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--dump"], cwd=tree, check=True,
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path(tree).resolve())})
        answers.append(json.loads(run.stdout))
    old, new = answers
    problems = compare(old, new)
    counts = {section: sum(len(v) for v in old[section].values()) for section in old}
    print(f"compared: {counts}")
    for p in problems:
        print(p)
    print("equal" if not problems else f"{len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
