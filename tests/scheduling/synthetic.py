"""Small synthetic prompt batches for the scheduler tests (token ids as numpy int32 rows)."""

from __future__ import annotations

import numpy as np


def case1_like(num_requests: int = 700, *, share: int = 7, prefix: int = 1100, distinct: int = 400, system: int = 40,
               vocab: int = 32000, seed: int = 0) -> list[np.ndarray]:
    """BatchLLM case-1 shape: a short global system prompt, documents (~``prefix`` tokens) shared by ~``share``
    queries of ~``distinct`` tokens each, shuffled."""
    rng = np.random.default_rng(seed)
    sys_prompt = rng.integers(0, vocab, system, dtype=np.int32)
    rows: list[np.ndarray] = []
    while len(rows) < num_requests:
        doc = rng.integers(0, vocab, max(2, int(rng.normal(prefix, prefix / 10))), dtype=np.int32)
        for _ in range(min(max(1, int(rng.normal(share, 1.5))), num_requests - len(rows))):
            query = rng.integers(0, vocab, max(2, int(rng.normal(distinct, distinct / 10))), dtype=np.int32)
            rows.append(np.concatenate([sys_prompt, doc, query]))
    return [rows[i] for i in rng.permutation(num_requests)]


def nested_random(rng: np.random.Generator, num_requests: int, *, alphabet: int = 3,
                  max_len: int = 12) -> list[list[int]]:
    """Prompts over a tiny alphabet built by extending earlier prompts' prefixes: deep, irregular sharing,
    duplicates and prompts that prefix other prompts."""
    rows: list[list[int]] = []
    for _ in range(num_requests):
        if rows and rng.random() < 0.7:
            base = rows[int(rng.integers(len(rows)))]
            row = base[:int(rng.integers(0, len(base) + 1))]
        else:
            row = []
        row = row + rng.integers(0, alphabet, int(rng.integers(0, max_len))).tolist()
        rows.append(row if row else [int(rng.integers(alphabet))])
    return rows
