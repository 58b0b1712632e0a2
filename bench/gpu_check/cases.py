"""What the GPU check (driver.py) runs: the correctness case matrix, the timing shapes and the attention
FLOPs its compute floors count (the floors themselves: floors.py).
Batches come from tests/prefix_batches.py (correctness) and bench/batches/shapes.py (timing).

``scale`` is 1 for ``--dry-run`` (tiny batches the Triton interpreter runs in seconds) and :data:`GPU_SCALE` on a GPU,
where it multiplies lengths and request counts so that tiles fill, split-k chunks and merges really happen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from batches.shapes import Shape, fig8_shapes, flashinfer_cascade_grid
from tests.prefix_batches import make_batch, random_batch

#: GPU batches are this many times longer / larger than the dry run's (still seconds of reference time each).
GPU_SCALE = 8
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 4, 8)  # MHA, GQA 4, GQA 8
PAGES = (16, 1)
SCENARIOS = ("decode", "chunked_prefill", "mixed", "split_k", "multi_level")
#: CUDA-graph padding rows after the valid rows of q / out: the kernel must neither read nor write them.
PAD_ROWS = 2


@dataclass(frozen=True)
class Case:
    scenario: str
    dtype: torch.dtype
    head_dim: int
    group: int
    page: int

    @property
    def name(self) -> str:
        return (f"{self.scenario}/{str(self.dtype).replace('torch.', '')}/d{self.head_dim}/"
                f"gqa{self.group}/page{self.page}")


def correctness_cases() -> list[Case]:
    """Every dtype x head_dim pair once (9 cases); scenario, GQA group and page size cycle through the pairs so each
    value of each appears at least once (5 scenarios, 3 groups, 2 page sizes), then one case per scenario at the
    common production layout (bf16, d128, GQA 8, page 16) so every scenario also runs there."""
    cases = []
    for i, (dtype, d) in enumerate((t, d) for t in DTYPES for d in HEAD_DIMS):
        cases.append(Case(SCENARIOS[i % len(SCENARIOS)], dtype, d, GROUPS[i % len(GROUPS)], PAGES[i % len(PAGES)]))
    cases += [Case(s, torch.bfloat16, 128, 8, 16) for s in SCENARIOS]
    return list(dict.fromkeys(cases))


def build_case(case: Case, scale: int, seed: int):
    """(batch, plan options) for one case; kv heads 1 in the dry run (cheap interpreter grid), 2 on a GPU."""
    kv_heads = 1 if scale == 1 else 2
    heads = dict(num_qo_heads=kv_heads * case.group, num_kv_heads=kv_heads, head_dim=case.head_dim,
                 block_size=case.page, dtype=case.dtype)
    # Shared-prefix lengths in tokens, converted to whole blocks of this page size.
    blocks = lambda tokens: max(1, tokens // case.page)  # noqa: E731
    options = dict(sharing="always")
    if case.scenario == "decode":
        b = random_batch(seed, num_requests=6 * scale, levels=1, decode_fraction=1.0,
                         max_level_blocks=blocks(16 * scale), **heads)
    elif case.scenario == "chunked_prefill":
        b = make_batch(seed, q_lens=[9 * scale, 5 * scale, 3], extra_lens=[11 * scale, 5 * scale, 7],
                       paths=[("d",)] * 3, level_blocks={"d": blocks(24 * scale)}, **heads)
    elif case.scenario == "mixed":
        b = random_batch(seed, num_requests=5 * scale, levels=2, decode_fraction=0.6, max_q_len=8 * scale,
                         max_level_blocks=blocks(12 * scale), **heads)
    elif case.scenario == "split_k":
        b = split_k_batch(seed, scale, heads)
        options.update(num_sms=64, min_split_tokens=16)  # more SMs than items: the planner splits long ranges
    else:  # multi_level: three nested shared levels
        b = random_batch(seed, num_requests=6 * scale, levels=3, max_q_len=4 * scale,
                         max_level_blocks=blocks(8 * scale), **heads)
    return b, options


def split_k_batch(seed: int, scale: int, heads: dict):
    """Decodes under a long two-level shared prefix (few rows, long KV) plus one long lone request: with few SMs and
    short chunks every long range is split, so many merge units are completed by the last of several programs."""
    page = heads["block_size"]
    n = 3 * scale + 3
    paths = [("a", "b")] * (n - 2) + [("a",), ()]
    return make_batch(seed, q_lens=[1] * (n - 1) + [3], extra_lens=[1 + r % 7 for r in range(n - 1)] + [150 * scale],
                      paths=paths, level_blocks={"a": 128 * scale // page, "b": 64 * scale // page}, **heads)


#: The timing shapes' dtype on a GPU: Llama-3.1's, and one dtype means one set of FlashInfer JIT modules
#: (flashinfer_jit.py). The dry run keeps fp16: the interpreter computes bf16 arithmetic wrongly.
TIMING_DTYPE = "bfloat16"


def timing_shapes(dry_run: bool) -> list[Shape]:
    """In the order the time guard keeps them: Fig. 8 at GQA 32:4 (the production layout), Fig. 8 at MHA 32:32,
    then FlashInfer's published grid restricted to batch 64/256, shared 1K/8K/32K, own 128/512 at GQA 32:8 and MHA;
    bf16, head_dim 128. The dry run uses two tiny shapes (decode and mixed, shared prefix, MHA and GQA)."""
    if dry_run:
        common = dict(distinct=16, head_dim=64, block_size=16, per_group=0)
        return [Shape(scenario="decode", num_decode=4, num_prefill=0, shared=32, num_qo_heads=2, num_kv_heads=2,
                      paper="dry-run:decode", **common),
                Shape(scenario="mixed", num_decode=3, num_prefill=1, shared=32, num_qo_heads=4, num_kv_heads=1,
                      paper="dry-run:mixed", **common)]
    grid = [s for s in flashinfer_cascade_grid()
            if s.num_decode in (64, 256) and s.shared in (1024, 8192, 32768) and s.distinct in (128, 512)]
    grid = [dataclasses.replace(s, num_kv_heads=8, paper=s.paper + ":gqa32/8") for s in grid] + grid
    shapes = fig8_shapes(scaled=False, gqa=True) + fig8_shapes(scaled=False) + grid
    return [dataclasses.replace(s, dtype=TIMING_DTYPE) for s in shapes]


def attention_flops(batch) -> float:
    """:func:`causal_attention_flops` of a :class:`batches.shapes.Batch`."""
    s = batch.shape
    return causal_attention_flops(batch.q_lens, batch.kv_lens.cpu().numpy(), s.num_qo_heads, s.head_dim)


def causal_attention_flops(q_lens, kv_lens, num_qo_heads: int, head_dim: int) -> float:
    """Multiply-add FLOPs of causal attention: QK^T and PV, 2 FLOPs per MAC, each query row against the KV positions
    it sees (``kv_len - q_len + i + 1``); ``q_lens``, ``kv_lens`` ``[R]`` per request."""
    q_lens, kv_lens = np.asarray(q_lens, dtype=np.int64), np.asarray(kv_lens, dtype=np.int64)
    # Sum over rows i < q_len of (kv_len - q_len + i + 1) = q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2.
    visible = q_lens * (kv_lens - q_lens) + q_lens * (q_lens + 1) // 2
    return float(visible.sum()) * num_qo_heads * head_dim * 2 * 2
