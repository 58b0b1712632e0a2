"""generate() helper: submission order, per-prompt arguments, outputs back in the caller's order.

The real engine runs it in test_e2e.py; here a recording stand-in for ``LLM`` checks what the helper hands over
under each scheduling policy (the helper only reads ``llm_engine.vllm_config`` and calls ``generate``).
"""

from types import SimpleNamespace

import pytest

from prefixattn.integrations.vllm.offline import admission_order, generate
from prefixattn.integrations.vllm.scheduler import group_order

pytestmark = pytest.mark.vllm

A, B = [1] * 40, [2] * 80
PROMPTS = [B + [3], A + [4], B + [5], [9, 9, 9], A + [6]]


class RecordingLLM:
    def __init__(self, policy="fcfs", block_size=16, tokenizer=None):
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(skip_tokenizer_init=tokenizer is None),
            cache_config=SimpleNamespace(block_size=block_size),
            scheduler_config=SimpleNamespace(policy=policy)))
        self.tokenizer = tokenizer
        self.calls = []

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params=None, **kwargs):
        self.calls.append(dict(prompts=prompts, sampling_params=sampling_params, **kwargs))
        return [f"out:{p.get('prompt_token_ids', 'embeds') if isinstance(p, dict) else p}" for p in prompts]


def test_outputs_come_back_in_input_order_and_submission_is_grouped():
    llm = RecordingLLM()
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = generate(llm, prompts, "sp", use_tqdm=False)
    assert outs == [f"out:{p}" for p in PROMPTS]
    order = group_order(PROMPTS, min_shared_tokens=16)
    assert llm.calls[0]["prompts"] == [prompts[i] for i in order]
    assert order != list(range(len(PROMPTS)))  # the batch really was reordered
    assert llm.calls[0]["sampling_params"] == "sp" and llm.calls[0]["use_tqdm"] is False


def test_per_prompt_lists_are_permuted_with_the_prompts():
    llm = RecordingLLM()
    sps = [f"sp{i}" for i in range(len(PROMPTS))]
    loras = [f"lora{i}" for i in range(len(PROMPTS))]
    generate(llm, [{"prompt_token_ids": p} for p in PROMPTS], sps, lora_request=loras)
    order = group_order(PROMPTS, min_shared_tokens=16)
    assert llm.calls[0]["sampling_params"] == [sps[i] for i in order]
    assert llm.calls[0]["lora_request"] == [loras[i] for i in order]
    with pytest.raises(ValueError, match="sampling_params: expected one entry per prompt \\(5\\), got 2"):
        generate(llm, [{"prompt_token_ids": p} for p in PROMPTS], ["a", "b"])


def test_priority_policy_gets_the_order_as_priorities():
    llm = RecordingLLM(policy="priority")
    generate(llm, [{"prompt_token_ids": p} for p in PROMPTS], "sp", priority=[0, 1, 0, 0, 0])
    call = llm.calls[0]
    order = group_order(PROMPTS, min_shared_tokens=16)
    caller = [[0, 1, 0, 0, 0][i] for i in order]
    # Sorting by the passed priorities gives the caller's priority classes first, then the grouped order.
    ranked = sorted(range(len(order)), key=lambda k: call["priority"][k])
    assert ranked == sorted(range(len(order)), key=lambda k: (caller[k], k))


def test_text_prompts_use_the_llms_tokenizer_and_embeddings_go_last():
    tok = SimpleNamespace(encode=lambda text: [ord(c) for c in text])
    prompts = ["x" * 40 + "a", {"prompt_embeds": object()}, "y" * 3, "x" * 40 + "b"]
    order = admission_order(prompts, tokenize=tok.encode, min_shared_tokens=16)
    assert order[-1] == 1 and sorted(order) == [0, 1, 2, 3]
    assert abs(order.index(0) - order.index(3)) == 1  # the two prompts sharing 40 characters stay together
    llm = RecordingLLM(tokenizer=tok)
    assert generate(llm, prompts)[2] == "out:yyy"
    with pytest.raises(ValueError, match="prompts: expected token ids"):
        admission_order(["no tokenizer here"])


def test_empty_batch():
    assert generate(RecordingLLM(), []) == []
