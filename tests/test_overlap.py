"""plan(overlap=True): the decode launch beside the compute launches (prefixattn.planner.overlap), its model, its
results (interpreter on CPU; the side stream and a captured graph on a GPU) and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixattn import PrefixSharedAttention, attention, plan, reference_attention
from prefixattn import launcher, prefix_attention
from prefixattn.autotune.lookup import planning_target
from prefixattn.kernels import layout as K
from prefixattn.planner.options import checked_options
from prefixattn.planner.overlap import overlap_stats, overlapped_us
from prefixattn.planner.plans import OPTION_DEFAULTS
from prefixattn.planner.stats import modeled_step_us
from tests.prefix_batches import make_batch
from tests.test_launcher import direct  # noqa: F401 - the stand-in JIT function with the direct launch allowed
from tests.tolerances import ATTENTION_TOL, LSE_TOL

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 40, 16


def _mixed_batch(device):
    """Two prefill chunks and five decodes under one 4-block prefix, two of the decodes under a second level."""
    b = make_batch(7, q_lens=[21, 33, 1, 1, 1, 1, 1], extra_lens=[25, 40, 9, 17, 1, 30, 16],
                   paths=[("sys",), ("sys",), ("sys",), ("sys",), ("sys", "doc"), ("sys", "doc"), ()],
                   level_blocks={"sys": 4, "doc": 2}, block_size=BLOCK, num_qo_heads=HEADS, num_kv_heads=KV_HEADS,
                   head_dim=HEAD_DIM)
    for name in ("q", "k_cache", "v_cache", "qo_indptr", "kv_lens", "block_table"):
        setattr(b, name, getattr(b, name).to(device))
    return b


def _plan(b, **options):
    with planning_target("sm90"):  # a priced step (the interpreter's host has no GPU of its own)
        return plan(b.qo_indptr, b.kv_lens, b.block_table, block_size=BLOCK, num_qo_heads=HEADS,
                    num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, q_dtype=b.q.dtype, sharing="always", num_sms=4,
                    **options)


def test_overlapped_step_matches_the_reference(device):
    """A mixed step planned with overlap=True (on a GPU: its decode launch on the side stream) gives the reference's
    output and LSE, and the in-series plan's; it is the same work list."""
    b = _mixed_batch(device)
    p = _plan(b, overlap=True)
    assert p.overlapped and p.stats["overlapped"] and {K.CLASS_CHUNK, K.CLASS_DECODE} <= set(p.work_classes)
    assert p.stats["modeled_overlap_us"] < p.stats["modeled_step_us"]
    out, lse = attention(b.q, b.k_cache, b.v_cache, p, return_lse=True)
    want, want_lse = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True)
    atol, rtol = ATTENTION_TOL[b.q.dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, want_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1])
    serial = _plan(b)
    assert not serial.overlapped and "overlapped" not in serial.stats
    np.testing.assert_array_equal(serial.work.items, p.work.items)
    torch.testing.assert_close(out, attention(b.q, b.k_cache, b.v_cache, serial), atol=atol, rtol=rtol)


def test_only_a_decode_launch_after_a_compute_launch_goes_beside(device):
    """The prepared launch forks before the decode class only on a GPU tensor of an overlapped plan whose decode
    class follows a compute class."""
    b = _mixed_batch(device)
    p = _plan(b, overlap=True)

    def beside(plan, classes):
        grid_items = tuple(plan.work.class_range(c)[1] - plan.work.class_range(c)[0] for c in classes)
        return prefix_attention._prepare(plan, None, out=torch.empty_like(b.q), lse=plan.ws_lse, q=b.q,
                                         k_cache=b.k_cache, v_cache=b.v_cache, classes=classes,
                                         grid_items=grid_items, has_lse=False,
                                         features=prefix_attention._feature_args(plan, b.q, None, None,
                                                                                 None)).beside_from

    on_gpu = b.q.is_cuda
    assert beside(p, p.work_classes) == (p.work_classes.index(K.CLASS_DECODE) if on_gpu else None)
    assert beside(p, (K.CLASS_DECODE,)) is None  # the decode class alone: nothing to run beside
    assert beside(_plan(b), p.work_classes) is None


class _Stream:
    """A CUDA stream's stand-in: its handle, and the fork/join calls it gets, in one shared log."""

    def __init__(self, name: str, handle: int, log: list) -> None:
        self.name, self.handle, self.log, self.device = name, handle, log, "cuda:0"

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits {other.name}")


def test_the_decode_launch_runs_forked_and_joined(request, monkeypatch):
    """From ``beside_from`` on, the launches run on the side stream, after it waited for the current one, and the
    current stream waits for it before the call returns; on the JIT path and the direct one alike."""
    from contextlib import contextmanager

    jit = request.getfixturevalue("direct")

    log: list = []
    main, side = _Stream("main", 7, log), _Stream("side", 8, log)
    current = [main]

    @contextmanager
    def on(stream):
        current[:] = [stream]
        try:
            yield
        finally:
            current[:] = [main]

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(launcher, "side_stream", lambda stream: side if stream is main else None)
    monkeypatch.setattr(launcher, "current_stream", lambda device: current[0].handle)
    b = _mixed_batch("cpu")
    p = _plan(b, overlap=True)
    classes = p.work_classes
    q, out = b.q.to(torch.float16), torch.empty(b.q.shape, dtype=torch.float16)
    k, v = b.k_cache.to(torch.float16), b.v_cache.to(torch.float16)
    features = prefix_attention._feature_args(p, q, None, None, None)
    launch = prefix_attention._prepare(p, None, out=out, lse=p.ws_lse, q=q, k_cache=k, v_cache=v, classes=classes,
                                       grid_items=(1,) * len(classes), has_lse=False, features=features)
    launch.beside_from = classes.index(K.CLASS_DECODE)  # what a GPU tensor's plan gets
    for _ in range(2):  # the JIT path, then the direct one
        log.clear()
        prefix_attention._launch(launch, None, out, p.ws_lse, q, k, v, features)
        assert log == ["side waits main", "main waits side"]
    streams = [run[3] for c in jit.compiled.values() for run in c.runs]
    assert sorted(streams) == sorted([main.handle] * (len(classes) - 1) + [side.handle])
    decode = [c for c in jit.compiled.values() if c.runs and c.runs[0][3] == side.handle]
    assert len(decode) == 1 and len(jit.launches) == len(classes)


def _modeled(*rows):
    return np.array(rows, dtype=np.float64)


def test_the_overlapped_step_is_the_longest_side_or_the_even_spread():
    # Shared 5 + gap 2 + chunk 10 on the current stream against a 12 us decode launch: the compute side, 17 us.
    modeled = _modeled([5, 4], [10, 8], [12, 3])
    assert overlapped_us(modeled, (2, 6, 40)) == 17.0
    assert overlap_stats(modeled, (2, 6, 40)) == dict(overlapped=True, modeled_overlap_us=17.0)
    # Programs that fill every slot already (ideal = makespan): only the launch gap is saved.
    full = _modeled([0, 0], [10, 10], [10, 10])
    assert overlapped_us(full, (0, 6, 40)) == 20.0 and modeled_step_us(full, (0, 6, 40)) == 22.0


def test_steps_without_both_kinds_run_in_series():
    decode_only = overlap_stats(_modeled([0, 0], [0, 0], [10, 8]), (0, 0, 40))
    assert decode_only == dict(overlapped=False, modeled_overlap_us=10.0)
    chunks_only = overlap_stats(_modeled([0, 0], [10, 8], [0, 0]), (0, 40, 40))
    assert chunks_only == dict(overlapped=False, modeled_overlap_us=10.0)


def test_bad_overlap_options_are_refused():
    args = {**OPTION_DEFAULTS, "block_size": 16, "num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64}
    with pytest.raises(ValueError, match="overlap: expected a bool, got str"):
        checked_options(**{**args, "overlap": "yes"})
    with pytest.raises(ValueError, match="overlap: expected False for an MLA plan"):
        checked_options(**{**args, "head_dim": 512, "sm_scale": 0.1, "overlap": True}, rope_dim=64)
    graph = PrefixSharedAttention(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16, max_tokens=8,
                                  max_requests=4, max_blocks_per_request=4, use_cuda_graph=True, overlap=True,
                                  device="cpu", max_q_len=8)
    with pytest.raises(ValueError, match="overlap: expected no per-step override with use_cuda_graph=True"):
        graph.plan(torch.tensor([0, 1]), torch.tensor([5]), torch.tensor([[0]]), overlap=False)


def test_a_graph_wrapper_forks_at_every_replay_or_never():
    """use_cuda_graph with overlap=True: its captured decode launch runs beside its compute launches whatever a step
    holds (a graph's launches are fixed); a graph of the decode class alone has nothing to fork."""
    def wrapper(**options):
        return PrefixSharedAttention(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16, max_tokens=8,
                                     max_requests=4, max_blocks_per_request=4, use_cuda_graph=True, device="cpu",
                                     **options)

    assert wrapper(overlap=True).graph_overlapped
    assert wrapper(overlap=True, max_q_len=8).graph_overlapped
    assert not wrapper(overlap=True, sharing="never").graph_overlapped  # decode tiles only
    assert not wrapper().graph_overlapped
    assert not PrefixSharedAttention(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                                     overlap=True).graph_overlapped  # no graph: nothing captured


@pytest.mark.gpu
def test_overlapped_step_on_a_side_stream_and_under_a_graph():
    """On a GPU the decode launch runs on the side stream, joined back: the eager call and a captured replay give the
    reference's output."""
    b = _mixed_batch("cuda")
    p = _plan(b, overlap=True)
    assert p.overlapped
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata)
    atol, rtol = ATTENTION_TOL[b.q.dtype]
    out = torch.empty_like(b.q)
    attention(b.q, b.k_cache, b.v_cache, p, out=out)
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention(b.q, b.k_cache, b.v_cache, p, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


def test_the_engines_switch(monkeypatch):
    """``PREFIXATTN_OVERLAP`` reaches the vLLM wrappers' and SGLang's MHA plan options (never an MLA plan's); a value
    that is neither on nor off is refused, naming it."""
    from prefixattn.integrations.sglang.page_table import geometry_options, mla_key
    from prefixattn.integrations.switches import OVERLAP_ENV, overlap_enabled
    from prefixattn.integrations.vllm.wrappers import _wrapper_options

    geometry = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16, q_dtype=torch.float16, sm_scale=0.1,
                    device="cpu")
    mha_key = (4, 2, 64, torch.float16, 0.1, True, 0.0, -1)
    for value, on in (("", False), ("0", False), ("1", True), (" On ", True)):
        monkeypatch.setenv(OVERLAP_ENV, value)
        assert overlap_enabled() is on
        assert _wrapper_options(**geometry)["overlap"] is on
        assert geometry_options(mha_key, block_size=16, sharing="auto", kv_dtype=None)["overlap"] is on
        mla = geometry_options(mla_key(16, 512, 64, torch.bfloat16, 0.1), block_size=64, sharing="auto",
                               kv_dtype=None)
        assert "overlap" not in mla
    monkeypatch.setenv(OVERLAP_ENV, "2")
    with pytest.raises(ValueError, match="PREFIXATTN_OVERLAP: expected 1 or 0, got '2'"):
        overlap_enabled()


def short_shared_step() -> tuple:
    """``(metadata, options)`` of 32 decodes of GQA 32:4 under a 256-token prefix, 2,048 tokens each of their own: a
    step whose shared launch, in series, costs more than it saves (sm90 prices, modeled)."""
    shared, own, block = 256, 2048, 16
    rows = [list(range(shared // block)) + [shared // block + r * (own // block) + j for j in range(own // block)]
            for r in range(32)]
    metadata = (torch.arange(33, dtype=torch.int32), torch.full((32,), shared + own, dtype=torch.int32),
                torch.tensor(rows, dtype=torch.int32))
    return metadata, dict(block_size=block, num_qo_heads=32, num_kv_heads=4, head_dim=128, q_dtype=torch.bfloat16)


def test_candidates_are_priced_as_the_step_would_run():
    """:func:`short_shared_step` (sm90 prices): in series the shared launch costs more than it saves and the step
    runs unshared; beside the decode launch it costs less than the reads it saves, so an overlapped plan keeps the
    node (modeled)."""
    metadata, options = short_shared_step()
    with planning_target("sm90"):
        serial = plan(*metadata, **options)
        overlapped = plan(*metadata, **options, overlap=True)
        never = plan(*metadata, **options, sharing="never")
    assert serial.stats["sharing_declined"] and not serial.shared_nodes
    assert not overlapped.stats["sharing_declined"] and len(overlapped.shared_nodes) == 1 and overlapped.overlapped
    assert overlapped.stats["modeled_overlap_us"] < never.stats["modeled_step_us"] < overlapped.stats["modeled_step_us"]
