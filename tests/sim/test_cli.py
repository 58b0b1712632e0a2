"""`prefixattn simulate`: the table, the --json contract, the plot, error messages."""

import json

import pytest

from prefixattn.cli import main


def test_simulate_json_and_table(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["simulate", "--workload", "batchllm-case1", "--num-requests", "40", "--policies", "vllm,sglang",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "MODELED" in text and "vllm" in text and "sglang" in text
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["vllm", "sglang"]
    for r in rows:
        for key in ("policy", "throughput_tok_s", "saving_ratio", "optimal_saving_ratio", "peak_kv_gib",
                    "fraction_of_bound"):
            assert key in r
        assert r["modeled"] is True and r["throughput_tok_s"] > 0 and 0 < r["fraction_of_bound"] <= 1


def test_simulate_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "steps.png"
    assert main(["simulate", "--workload", "batchllm-micro-1000-1000-sd4", "--num-requests", "16",
                 "--policies", "vllm", "--plot", str(png), "--no-progress"]) == 0
    assert png.stat().st_size > 1000


def test_jsonl_workload(tmp_path, capsys):
    f = tmp_path / "w.jsonl"
    lines = [{"prompt_len": 300, "prefix_id": "a", "prefix_len": 256, "output_len": 8} for _ in range(6)]
    lines.append({"prompt_token_ids": [1, 2, 3, 4, 5], "max_tokens": 3})
    f.write_text("\n".join(json.dumps(x) for x in lines))
    assert main(["simulate", "--workload", str(f), "--policies", "vllm", "--no-progress"]) == 0
    assert "7 requests" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--policies", "nope"], "policy"),
    (["--gpu", "tpu"], "gpu"),
    (["--workload", "nope"], "workload"),
    (["--set", "gemm_efficiency"], "NAME=VALUE"),
    (["--set", "nope=1"], "overrides"),
])
def test_errors_are_clear(argv, message, capsys):
    assert main(["simulate", "--num-requests", "4", "--no-progress", "--policies", "vllm", *argv]) == 2
    assert message in capsys.readouterr().err


def test_list_and_calibration(capsys):
    assert main(["simulate", "--list"]) == 0
    assert "blendserve-trace1" in capsys.readouterr().out
    assert main(["simulate", "--calibration"]) == 0
    assert "gemm_efficiency" in capsys.readouterr().out


def test_projection_option_renames_the_scheduled_policies_only(capsys):
    from prefixattn.sim.simulate import simulate

    assert main(["simulate", "--workload", "batchllm-case1", "--num-requests", "30", "--policies",
                 "vllm,prefixattn", "--projection", "peak", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "prefixattn-peak" in text and "vllm-peak" not in text  # stock vLLM keeps its own admission
    with pytest.raises(ValueError, match="projection: expected one of"):
        simulate("batchllm-case1", ["prefixattn"], num_requests=4, projection="mean")
    assert main(["simulate", "--num-requests", "4", "--policies", "vllm", "--projection", "mean"]) == 2
