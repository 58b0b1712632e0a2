"""The GPU check's graph-step helpers (bench/gpu_check/graphs.py) that its dry run skips with the timings: the plan()
profile and the free plan() the stream-wait check calls, checked on the CPU so a GPU session does not find them
broken."""

from gpu_check.graphs import _Setup, profile_lines


def test_profile_lines_rank_the_plan_step_by_own_time():
    def slow():
        sum(range(20_000))

    def step():
        slow()
        len("x")

    lines = profile_lines(step, runs=3, top=2)
    assert len(lines) == 2
    assert "builtins.sum" in lines[0], lines  # the loop's own time ranks first, above its callers'
    assert all(" us " in line and "1.0x" in line for line in lines), lines


def test_graph_step_free_plan_plans_each_batch_with_the_setups_geometry():
    s = _Setup(dry_run=True, device="cpu")
    for _, b in s.batches:
        p = s.free_plan(b)
        assert p.workspace is None and p.device.type == "cpu"
        assert (p.num_tokens, p.num_qo_heads, p.head_dim) == (int(b.qo_indptr[-1]), s.heads["num_qo_heads"],
                                                               s.heads["head_dim"])
