"""Prompt-only JSONL (``{"prompt_token_ids": [...]}`` lines, the common offline format): ``prefixattn partition``
and ``prefixattn simulate`` run on it, and the output-length assumption they made is printed."""

import json

import pytest

from prefixattn.cli import main
from prefixattn.sim.workloads import ASSUMED_OUTPUT_LEN, load_jsonl

#: 3 documents of 64 shared tokens, 8 questions each (distinct 8-token tails).
DOCS, PER_DOC, PREFIX, TAIL = 3, 8, 64, 8


def _prompt(doc: int, q: int) -> list:
    return [1000 * (doc + 1) + t for t in range(PREFIX)] + [50000 + 100 * doc + 10 * q + t for t in range(TAIL)]


def _write(path, lengths=None) -> str:
    """One line per (doc, question); ``lengths[(doc, q)]`` adds an ``output_len`` to that line."""
    lines = []
    for d in range(DOCS):
        for q in range(PER_DOC):
            obj = {"prompt_token_ids": _prompt(d, q)}
            if lengths and (d, q) in lengths:
                obj["output_len"] = lengths[(d, q)]
            lines.append(json.dumps(obj))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_prompt_only_file_gets_the_assumed_constant(tmp_path):
    w = load_jsonl(_write(tmp_path / "p.jsonl"))
    assert [r.output_len for r in w.requests] == [ASSUMED_OUTPUT_LEN] * (DOCS * PER_DOC)
    assert f"24 of 24 requests give no output_len/max_tokens: assumed {ASSUMED_OUTPUT_LEN}" in \
        w.info["output_len_assumption"]


def test_max_tokens_fills_only_the_missing_lines(tmp_path):
    w = load_jsonl(_write(tmp_path / "p.jsonl", {(0, 0): 7}), default_output_len=33)
    assert w.requests[0].output_len == 7
    assert {r.output_len for r in w.requests[1:]} == {33}
    assert "23 of 24 requests" in w.info["output_len_assumption"] and "--max-tokens" in w.info["output_len_assumption"]


def test_missing_lengths_are_estimated_per_prefix_group(tmp_path):
    # Doc 0 measured at 10 and 20 tokens, doc 1 at 300; doc 2 has no sample and takes the batch mean (110).
    w = load_jsonl(_write(tmp_path / "p.jsonl", {(0, 0): 10, (0, 1): 20, (1, 3): 300}))
    lens = [[w.requests[d * PER_DOC + q].output_len for q in range(PER_DOC)] for d in range(DOCS)]
    assert lens[0] == [10, 20] + [15] * 6
    assert lens[1] == [300] * PER_DOC
    assert lens[2] == [110] * PER_DOC
    assert "21 of 24 requests" in w.info["output_len_assumption"] and "per prefix group" in \
        w.info["output_len_assumption"]


def test_complete_file_assumes_nothing(tmp_path):
    full = {(d, q): 5 for d in range(DOCS) for q in range(PER_DOC)}
    assert load_jsonl(_write(tmp_path / "p.jsonl", full)).info["output_len_assumption"] is None


@pytest.mark.parametrize("bad", [0, -3, True, "7", 2.5])
def test_a_given_bad_length_still_fails(tmp_path, bad):
    with pytest.raises(ValueError, match="expected output_len .or max_tokens. as a positive int"):
        load_jsonl(_write(tmp_path / "p.jsonl", {(1, 1): bad}))


def test_partition_cli_on_prompt_only_file(tmp_path, capsys):
    path = _write(tmp_path / "prompts.jsonl")
    assert main(["partition", "--replicas", "4", path]) == 0
    text = capsys.readouterr().out
    assert "24 requests, 3 groups" in text
    assert f"output lengths: 24 of 24 requests give no output_len/max_tokens: assumed {ASSUMED_OUTPUT_LEN}" in text
    assert main(["partition", "--replicas", "2", path, "--max-tokens", "64", "--cost", "tokens"]) == 0
    assert "assumed 64 output tokens each (--max-tokens)" in capsys.readouterr().out
    assert main(["partition", "--replicas", "2", path, "--max-tokens", "0"]) == 2
    assert "--max-tokens: expected a positive int, got 0" in capsys.readouterr().err


def test_simulate_cli_on_prompt_only_file(tmp_path, capsys):
    path = _write(tmp_path / "prompts.jsonl", {(0, 0): 12})
    assert main(["simulate", "--workload", path, "--policies", "vllm,batchllm", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "24 requests" in text and "MODELED" in text
    assert "output lengths: 23 of 24 requests give no output_len/max_tokens: estimated per prefix group" in text
    assert main(["simulate", "--workload", path, "--policies", "vllm", "--max-tokens", "9", "--no-progress"]) == 0
    assert "assumed 9 output tokens each (--max-tokens)" in capsys.readouterr().out
