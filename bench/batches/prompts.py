"""Synthetic offline batches for the scheduler benchmarks (token ids only; no tokenizer, no downloads).

* :func:`batchllm_case1`: BatchLLM's snippet-generation case 1 shape: a short global system prompt, documents of
  ~1,100 tokens each shared by ~7 queries of ~400 tokens (share degree ~7, ~1,500 tokens per prompt).
* :func:`blendserve_mix`: a BlendServe-style mix at its scale (400,000 requests): chat requests (BurstGPT-like,
  log-normal prompt lengths around 500 tokens behind a system prompt), MMLU-like requests (one of 57 subject 5-shot
  prefixes of 300-700 tokens plus a short question) and video-generation requests (short prompts). Mean prompt
  ~600 tokens, so the whole batch (~240M tokens, ~1 GB as int32) fits this 24 GB machine several times over.

Rows are int32 numpy arrays (views into one buffer per trace part are avoided so each row owns its memory, like
prompts coming from a tokenizer).
"""

from __future__ import annotations

import numpy as np

#: Llama-3 vocabulary size: the id range of the synthetic tokens.
VOCAB = 128_256
#: MMLU has 57 subjects; each has its own 5-shot prefix.
MMLU_SUBJECTS = 57


def batchllm_case1(num_requests: int = 3000, *, share: int = 7, prefix: int = 1100, distinct: int = 400,
                   system: int = 64, seed: int = 0) -> list[np.ndarray]:
    """BatchLLM case 1 shape (see module notes); rows shuffled so identical documents are not adjacent."""
    rng = np.random.default_rng(seed)
    sys_prompt = rng.integers(0, VOCAB, system, dtype=np.int32)
    rows: list[np.ndarray] = []
    while len(rows) < num_requests:
        doc = rng.integers(0, VOCAB, max(2, int(rng.normal(prefix, prefix / 10))), dtype=np.int32)
        for _ in range(min(max(1, int(round(rng.normal(share, 1.5)))), num_requests - len(rows))):
            query = rng.integers(0, VOCAB, max(2, int(rng.normal(distinct, distinct / 10))), dtype=np.int32)
            rows.append(np.concatenate([sys_prompt, doc, query]))
    return [rows[i] for i in rng.permutation(num_requests)]


def batchllm_case1_packed(num_requests: int = 400_000, *, share: int = 7, prefix: int = 1100, distinct: int = 400,
                          system: int = 64, seed: int = 0):
    """:func:`batchllm_case1`'s distribution (same parameters; other draws, so not the same rows) built straight into
    one int32 array: a :class:`~prefixattn.scheduling.PackedSequences` in row order (rows shuffled). At BlendServe's
    scale (400,000 rows, ~620M tokens: 2.5 GB) a list of 400,000 row arrays costs minutes of generation and a
    second 2.5 GB copy when packed; here every token is drawn in one call and documents are copied in per row."""
    from prefixattn.scheduling import PackedSequences

    rng = np.random.default_rng(seed)
    doc_of_row, doc_lens = [], []
    while len(doc_of_row) < num_requests:
        readers = min(max(1, int(round(rng.normal(share, 1.5)))), num_requests - len(doc_of_row))
        doc_of_row.extend([len(doc_lens)] * readers)
        doc_lens.append(max(2, int(rng.normal(prefix, prefix / 10))))
    doc_of_row = np.asarray(doc_of_row, dtype=np.int64)[rng.permutation(num_requests)]
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    query_lens = np.maximum(2, rng.normal(distinct, distinct / 10, num_requests).astype(np.int64))
    lengths = system + doc_lens[doc_of_row] + query_lens
    offsets = np.zeros(num_requests + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)  # queries keep these random ids
    sys_prompt = rng.integers(0, VOCAB, system, dtype=np.int32)
    doc_start = np.zeros(doc_lens.size + 1, dtype=np.int64)
    np.cumsum(doc_lens, out=doc_start[1:])
    docs = rng.integers(0, VOCAB, int(doc_start[-1]), dtype=np.int32)
    for row, (start, doc) in enumerate(zip(offsets[:-1].tolist(), doc_of_row.tolist())):
        values[start:start + system] = sys_prompt
        values[start + system:start + system + doc_lens[doc]] = docs[doc_start[doc]:doc_start[doc + 1]]
    return PackedSequences(values=values, offsets=offsets)


def blendserve_mix(num_requests: int = 400_000, *, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """BlendServe-style mix (see module notes). Returns ``(prompts, output_lens)``; output lengths follow the
    trace kinds (chat ~250, MMLU 2, video ~16k normalized as in BlendServe's appendix)."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, num_requests, p=[0.5, 0.35, 0.15])  # chat, mmlu, video
    system = [rng.integers(0, VOCAB, n, dtype=np.int32) for n in (120, 60, 40)]
    fewshot = [rng.integers(0, VOCAB, int(rng.integers(300, 700)), dtype=np.int32) for _ in range(MMLU_SUBJECTS)]
    subject = rng.integers(0, MMLU_SUBJECTS, num_requests)
    body_len = np.where(kind == 0, np.clip(rng.lognormal(np.log(500), 0.6, num_requests), 4, 4000),
                        np.where(kind == 1, rng.integers(30, 120, num_requests), rng.integers(20, 80, num_requests)))
    body_len = body_len.astype(np.int64)
    rows = []
    for i in range(num_requests):
        k = int(kind[i])
        head = fewshot[subject[i]] if k == 1 else None
        body = rng.integers(0, VOCAB, int(body_len[i]), dtype=np.int32)
        rows.append(np.concatenate([system[k], head, body]) if head is not None else np.concatenate([system[k], body]))
    out = np.where(kind == 0, np.clip(rng.lognormal(np.log(250), 0.5, num_requests), 1, 4000),
                   np.where(kind == 1, 2, np.clip(rng.normal(16384, 2000, num_requests), 1024, 32768)))
    return rows, out.astype(np.int64)
