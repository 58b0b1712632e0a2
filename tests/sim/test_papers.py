"""The same-backend verdict rows of the paper tables."""

from types import SimpleNamespace

from prefixattn.sim import papers


def _r(policy, tok_s, backend, of_bound=0.5):
    return SimpleNamespace(policy=policy, throughput_tok_s=tok_s, backend=backend, fraction_of_bound=of_bound)


def test_verdicts_compare_each_of_ours_with_the_best_other_on_its_backend():
    res = [_r("vllm", 100.0, "sequential"), _r("batchllm", 120.0, "sequential"), _r("blendserve", 150.0, "overlap"),
           _r("nanoflow-dfs", 140.0, "overlap"), _r("prefixattn", 114.0, "sequential", 0.4),
           _r("prefixattn-2k", 500.0, "sequential"), _r("prefixattn-overlap", 165.0, "overlap", 0.6)]
    seq, ovl = papers.verdicts(res)
    assert (seq["policy"], seq["best"]) == ("prefixattn", "batchllm")  # prefixattn-2k is ours, not a rival
    assert abs(seq["margin"] - (114 / 120 - 1)) < 1e-12
    assert (ovl["best"], round(ovl["margin"], 6)) == ("blendserve", 0.1)
    assert papers.verdict_cell(seq).startswith("BELOW: -5.0% vs batchllm (40% vs 50% of T_o)")
    assert papers.verdict_cell(ovl).startswith("at or above: +10.0% vs blendserve")
    table = papers.verdict_markdown({"#1": res})
    assert table.count("\n") == 2 and "| #1 | BELOW" in table
