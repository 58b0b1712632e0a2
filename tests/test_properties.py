"""Property-based hostile metadata: plan() + attention() give a clear ValueError or the reference's
result; never another exception, never a crash, never a read outside the cache.

Out-of-bounds reads are caught in the interpreter by placing each cache inside a larger guard tensor filled with NaN
(the cache is a view into its middle): a block id one past either end lands in the guard, and NaN would reach the
output of an otherwise valid batch. Ids farther out than the guard must be refused before any launch (the kernel is
replaced by a stub that fails the test if it is called). Small shapes and few examples: this runs in the default
suite under the interpreter.
"""

import math

import numpy as np
import pytest
import torch

from hypothesis import HealthCheck, event, given, settings  # a test dependency (pyproject's [test] extra)
from hypothesis import strategies as st

from prefixattn import attention, plan, reference_attention
from prefixattn import prefix_attention
from tests.tolerances import ATTENTION_TOL, LSE_TOL

#: Guard blocks on each side of the cache: ids in [-GUARD, num_blocks + GUARD) stay inside the allocation.
GUARD = 2
HEADS = dict(num_qo_heads=2, num_kv_heads=1, head_dim=64)
#: Examples per property: each runs at most one small interpreter launch (~0.2 s); derandomized, so CI always
#: explores the same examples (a failure reproduces; new ones come from changing the strategy).
MAX_EXAMPLES = 40
SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


#: What hostile_batches breaks (one thing per batch: several at once mostly test the first check that fires).
CORRUPTIONS = ("none", "block_id", "cache_smaller", "kv_len", "indptr", "indptr_start")


@st.composite
def hostile_batches(draw):
    """A small paged batch with (mostly) one thing wrong, the way users get it wrong; a third are left valid."""
    block_size = draw(st.sampled_from([1, 3, 4]))
    num_blocks = draw(st.integers(1, 6))
    num_reqs = draw(st.integers(1, 3))
    q_lens = draw(st.lists(st.integers(0, 3), min_size=num_reqs, max_size=num_reqs))
    kv_lens = [q + draw(st.integers(0, 2 * block_size)) for q in q_lens]
    needed = [-(-n // block_size) for n in kv_lens]
    width = max(needed + [1])
    table = [[draw(st.integers(0, num_blocks - 1)) for _ in range(width)] for _ in range(num_reqs)]
    indptr = [int(x) for x in np.r_[0, np.cumsum(q_lens)]]
    cache_blocks = num_blocks
    kind = draw(st.sampled_from(CORRUPTIONS[:1] * 3 + CORRUPTIONS[1:2] * 3 + CORRUPTIONS[2:]))
    users = [r for r in range(num_reqs) if needed[r]]
    if kind == "block_id" and users:
        r = draw(st.sampled_from(users))
        j = draw(st.integers(0, needed[r] - 1))
        table[r][j] = draw(st.sampled_from([-1, -GUARD, num_blocks, num_blocks + GUARD - 1, num_blocks + 50,
                                            2 ** 31 - 1, 2 ** 40]))
    elif kind == "cache_smaller":
        cache_blocks = num_blocks - 1  # the plan was made for a bigger cache (or none): the ids may not fit
    elif kind == "kv_len":
        kv_lens[draw(st.integers(0, num_reqs - 1))] += draw(st.sampled_from([-4, -1, 1, 2 * block_size]))
    elif kind == "indptr":
        indptr[draw(st.integers(1, num_reqs))] += draw(st.sampled_from([-2, 1]))
    elif kind == "indptr_start":
        indptr[0] = 1
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    plan_num_blocks = draw(st.sampled_from([None, None, num_blocks]))
    causal = draw(st.booleans())
    return dict(block_size=block_size, cache_blocks=cache_blocks, plan_num_blocks=plan_num_blocks, causal=causal,
                qo_indptr=torch.tensor(indptr, dtype=torch.int64).to(index_dtype),
                kv_lens=torch.tensor(kv_lens, dtype=torch.int64).to(index_dtype),
                block_table=torch.tensor(table, dtype=torch.int64).reshape(num_reqs, width).to(index_dtype))


def _guarded_cache(num_blocks: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches ``[num_blocks, block_size, 1, 64]`` that are views into NaN-filled guard tensors."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(2):
        guard = torch.full((num_blocks + 2 * GUARD, block_size, HEADS["num_kv_heads"], HEADS["head_dim"]), math.nan)
        guard[GUARD:GUARD + num_blocks] = torch.randn(num_blocks, block_size, HEADS["num_kv_heads"],
                                                      HEADS["head_dim"], generator=g)
        caches.append(guard[GUARD:GUARD + num_blocks])
    return caches[0], caches[1]


def _used_ids(b) -> np.ndarray:
    table, lens = b["block_table"].long().numpy(), b["kv_lens"].long().numpy()
    if table.size == 0:
        return np.zeros(0, dtype=np.int64)
    needed = -(-np.maximum(lens, 0) // b["block_size"])
    used = np.arange(table.shape[1])[None, :] < needed[:, None]
    return table[used]


class _RefuseLaunch:
    """Stands in for the kernel when a used id lies beyond the guard: such a batch must never be launched."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise AssertionError("attention() launched the kernel with a block id beyond the cache and its guard")
        return launch


def _ours(b, q, k_cache, v_cache):
    p = plan(b["qo_indptr"], b["kv_lens"], b["block_table"], block_size=b["block_size"], causal=b["causal"],
             q_dtype=q.dtype, num_blocks=b["plan_num_blocks"], **HEADS)
    return attention(q, k_cache, v_cache, p, return_lse=True)


def _theirs(b, q, k_cache, v_cache):
    return reference_attention(q, k_cache, v_cache, b["qo_indptr"], b["kv_lens"], b["block_table"],
                               causal=b["causal"], return_lse=True)


@SETTINGS
@given(b=hostile_batches(), seed=st.integers(0, 2 ** 16))
def test_hostile_metadata_is_refused_or_matches_the_reference(b, seed, monkeypatch_module):
    num_tokens = max(int(b["qo_indptr"][-1]), 0)
    q = torch.randn(num_tokens, HEADS["num_qo_heads"], HEADS["head_dim"], generator=torch.Generator().manual_seed(seed))
    k_cache, v_cache = _guarded_cache(b["cache_blocks"], b["block_size"], seed)
    ids = _used_ids(b)
    beyond_guard = bool(ids.size) and (ids.min() < -GUARD or ids.max() >= b["cache_blocks"] + GUARD)
    with monkeypatch_module.context() as m:
        if beyond_guard:
            m.setattr(prefix_attention, "prefix_attention_kernel", _RefuseLaunch())
        try:
            got = _ours(b, q, k_cache, v_cache)
        except ValueError as e:
            got = e
    try:
        want = _theirs(b, q, k_cache, v_cache)
    except ValueError as e:
        want = e
    # Both refuse or both accept: the planner and attention() check exactly what the reference checks.
    assert isinstance(got, ValueError) == isinstance(want, ValueError), (got, want)
    event("refused" if isinstance(got, ValueError) else "ran")
    if isinstance(got, ValueError):
        assert ": expected" in str(got), f"the message names the argument and what was expected: {got}"
        return
    out, lse = got
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN from the guard: a read outside the cache"
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(out, want[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, want[1], atol=LSE_TOL[0], rtol=LSE_TOL[1])


@SETTINGS
@given(b=hostile_batches())
def test_plan_never_raises_anything_but_value_error(b):
    # plan() alone (no cache): every input is a Plan or a ValueError, and a Plan's max_block_id is its largest
    # used id.
    try:
        p = plan(b["qo_indptr"], b["kv_lens"], b["block_table"], block_size=b["block_size"], causal=b["causal"],
                 q_dtype=torch.float32, num_blocks=b["plan_num_blocks"], **HEADS)
    except ValueError:
        return
    ids = _used_ids(b)
    assert p.max_block_id == (int(ids.max()) if ids.size else -1)


@pytest.fixture(scope="module")
def monkeypatch_module():
    # hypothesis runs many examples inside one test call: a module-scoped MonkeyPatch with per-example context().
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()
