"""End to end on the real vLLM CPU engine with attention sinks: a tiny random gpt-oss (``GptOssForCausalLM``,
sinks in every layer, a windowed layer then a full one, 4 experts) gives vLLM's own greedy tokens with prefixattn's
backend, on the shared-prefix batch of ``test_e2e.py``.

The reference is vLLM's CPU attention (``CPU_ATTN``), which runs gpt-oss's sinks itself (``s_aux``); the
prefixattn run registers prefixattn's backend over it (see ``test_e2e.py``), so the only difference between the
two runs is the attention backend.
"""

import pytest

from tests.vllm.engine import run_engine
from tests.vllm.test_e2e import MAX_TOKENS, engine_kwargs, shared_prefix_prompts
from tests.vllm.tiny_model import assert_same_greedy_tokens

pytestmark = pytest.mark.vllm

#: One sink logit per query head, spread so that heads of one KV group differ (a sink indexed by KV head, or
#: applied per partial instead of once per row, changes the output) and large enough to matter: with every sink
#: at -30 (no sink mass) vLLM's own backend gives different greedy tokens at 3 of the 36 positions (measured,
#: ``test_sinks_change_the_tokens``), so a backend that dropped the sinks would fail the comparison.
SINKS = (0.0, 2.0, 4.0, 6.0)
NO_SINKS = (-30.0,) * len(SINKS)
#: Layer 0's window (vLLM's sliding_window, keys p-47..p) is shorter than the prompts (73-89 tokens) and ends
#: inside the shared 64-token prefix: the windowed layer runs its own plan (its KV cache group's).
WINDOW = 48


def gpt_oss(tmp_path_factory, name: str, sinks) -> str:
    from tests.vllm.tiny_model import save_tiny_gpt_oss

    return save_tiny_gpt_oss(str(tmp_path_factory.mktemp(name)), sinks=sinks, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e_sinks")
    prompts = shared_prefix_prompts()
    common = dict(model=gpt_oss(tmp_path_factory, "gpt_oss_sinks", SINKS), prompts=prompts,
                  max_tokens=MAX_TOKENS, llm=engine_kwargs())
    return dict(prompts=prompts,
                vllm=run_engine(tmp, "vllm_cpu_attn", backend="vllm", **common),
                prefixattn=run_engine(tmp, "prefixattn", backend="prefixattn", **common))


def test_backends_are_the_intended_ones(runs):
    assert runs["vllm"]["backend_class"].endswith("cpu_attn.CPUAttentionBackend")
    assert runs["prefixattn"]["backend_class"] == "prefixattn.integrations.vllm.backend.PrefixAttnBackend"
    assert runs["prefixattn"]["plans"], "the prefixattn run built no plan: its backend never ran"
    # One plan per KV cache group: the windowed layer's (prefixattn's window_left = S - 1) and the full layer's.
    assert {p["window_left"] for p in runs["prefixattn"]["plans"]} == {WINDOW - 1, -1}


def test_greedy_tokens_match_vllm_cpu_attention(runs):
    ref, got = runs["vllm"], runs["prefixattn"]
    assert got["prompts_back"] == runs["prompts"]
    assert_same_greedy_tokens(ref, got, max_tokens=MAX_TOKENS)


@pytest.mark.slow
def test_sinks_change_the_tokens(runs, tmp_path_factory):
    """The control for the comparison above: the same weights without sink mass give other tokens."""
    tmp = tmp_path_factory.mktemp("e2e_no_sinks")
    ref = run_engine(tmp, "vllm_no_sinks", backend="vllm", prompts=runs["prompts"], max_tokens=MAX_TOKENS,
                     model=gpt_oss(tmp_path_factory, "gpt_oss_no_sinks", NO_SINKS), llm=engine_kwargs())
    assert ref["tokens"] != runs["vllm"]["tokens"]
