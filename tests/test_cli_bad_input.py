"""Bad command-line input: exit code 2 and a message naming the argument, what was expected and
what arrived; never a traceback, never a silently different run."""

import json

import pytest

from prefixattn.cli import main

SIM = ["simulate", "--policies", "vllm", "--no-progress"]


def _fails_with(capsys, argv, *fragments):
    """``main(argv)`` returns 2 and stderr names every fragment."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


# ---------------------------------------------------------------------------------------------------------------
# simulate / partition: sizes, files, JSONL contents, output paths
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["-2", "0", "x"])
@pytest.mark.parametrize("command", [SIM, ["partition", "batchllm-case1", "--replicas", "2"]])
def test_num_requests_must_be_positive(capsys, command, value):
    # -2 used to run 4 of 6 requests (Python slicing), 0 the whole workload.
    _fails_with(capsys, [*command, "--num-requests", value], "--num-requests", f"expected a positive int, got {value}")


def test_negative_seed(capsys):
    _fails_with(capsys, [*SIM, "--seed", "-1"], "--seed", "expected a non-negative int, got -1")


def test_missing_workload_file(capsys, tmp_path):
    missing = tmp_path / "nope.jsonl"
    _fails_with(capsys, [*SIM, "--workload", str(missing)], "workload", "no such file", str(missing))


def test_partition_missing_prompts_file(capsys, tmp_path):
    _fails_with(capsys, ["partition", str(tmp_path / "nope.jsonl"), "--replicas", "2"], "no such file")


@pytest.mark.parametrize("line, fragment", [
    ([1, 2, 3], "expected a JSON object, got list"),
    ("text", "expected a JSON object, got str"),
    ({"prompt_token_ids": [1, 2 ** 40], "output_len": 4}, "token ids in [0, 2147483647]"),
    ({"prompt_token_ids": [1, -3], "output_len": 4}, "token ids in [0, 2147483647]"),
    ({"prompt_token_ids": [1, True], "output_len": 4}, "non-empty list of ints"),
    ({"prompt_token_ids": [1, 2], "output_len": True}, "output_len (or max_tokens) as a positive int, got True"),
    ({"prompt_len": True, "output_len": 4}, "prompt_len=True"),
    ({"prompt_len": 8, "prefix_len": False, "prefix_id": "a", "output_len": 4}, "prefix_len=False"),
])
def test_bad_jsonl_lines(capsys, tmp_path, line, fragment):
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "output_len": 2}) + "\n" + json.dumps(line) + "\n")
    _fails_with(capsys, [*SIM, "--workload", str(f)], "line 2", fragment)


@pytest.mark.parametrize("command", [SIM + ["--num-requests", "4"],
                                     ["partition", "batchllm-case1", "--replicas", "2", "--num-requests", "4"]])
def test_json_into_a_missing_folder_fails_before_the_run(capsys, tmp_path, command):
    target = tmp_path / "no" / "such" / "r.json"
    _fails_with(capsys, [*command, "--json", str(target)], "--json", "expected a file in an existing folder",
                str(target))


def test_plot_into_a_missing_folder(capsys, tmp_path):
    target = tmp_path / "missing" / "p.png"
    _fails_with(capsys, [*SIM, "--num-requests", "4", "--plot", str(target)], "--plot",
                "expected a file in an existing folder")


@pytest.mark.parametrize("argv, fragments", [
    (["--replicas", "0"], ("--replicas: expected a positive int, got 0",)),
    (["--replicas", "2", "--levels", "0"], ("--levels: expected a positive int, got 0",)),
    (["--replicas", "2", "--decode-weight", "nan"], ("--decode-weight", "expected a finite number >= 0")),
    (["--replicas", "2", "--decode-weight", "-1"], ("--decode-weight", "expected a finite number >= 0")),
])
def test_partition_arguments(capsys, argv, fragments):
    _fails_with(capsys, ["partition", "batchllm-case1", "--num-requests", "8", *argv], *fragments)


# ---------------------------------------------------------------------------------------------------------------
# compile-check and tune
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, fragments", [
    (["--head-dims", "33"], ("--head-dims", "expected values in (64, 80, 96, 128, 256)", "33")),
    (["--head-dims", "x"], ("--head-dims: expected comma-separated ints, got x",)),
    (["--jobs", "0"], ("--jobs: expected a positive int, got 0",)),
    (["--max-configs", "0"], ("--max-configs: expected a positive int, got 0",)),
    (["--head-dim-per-target", "sm90=33"], ("head-dim-per-target", "expected a head_dim in", "33")),
])
def test_compile_check_arguments(capsys, monkeypatch, argv, fragments):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # past the interpreter check: the arguments are what fails
    _fails_with(capsys, ["compile-check", "--targets", "sm90", *argv], *fragments)


def test_compile_check_under_the_interpreter_says_what_to_unset(capsys, monkeypatch):
    # Used to compile every variant and fail each with an AttributeError from the interpreter's kernels.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _fails_with(capsys, ["compile-check", "--targets", "sm90", "--head-dims", "64", "--kernels", "merge",
                         "--dtypes", "fp16"], "TRITON_INTERPRET=1", "unset TRITON_INTERPRET")


@pytest.mark.parametrize("argv, fragments", [
    (["--groups", "0"], ("--groups", "expected comma-separated positive ints", "0")),
    (["--q-rows", "-4"], ("--q-rows", "expected comma-separated positive ints", "-4")),
    (["--kv-lens", "1k"], ("--kv-lens: expected comma-separated positive ints, got 1k",)),
    (["--top-k", "0"], ("--top-k: expected a positive int, got 0",)),
    (["--head-dims", "33"], ("--head-dims", "expected values in", "33")),
])
def test_tune_arguments(capsys, argv, fragments):
    _fails_with(capsys, ["tune", "--dry-run", "--target", "sm90", *argv], *fragments)


@pytest.mark.parametrize("n", [0, -2, True])
def test_python_api_num_requests(n):
    from prefixattn.sim.simulate import simulate
    from prefixattn.sim.workloads import get_workload

    with pytest.raises(ValueError, match="num_requests: expected a positive int"):
        get_workload("batchllm-case1", num_requests=n)
    w = get_workload("batchllm-case1", num_requests=6)
    with pytest.raises(ValueError, match="num_requests: expected a positive int"):
        simulate(w, ["vllm"], num_requests=n)
