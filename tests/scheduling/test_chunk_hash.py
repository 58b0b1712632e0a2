"""Chunk hashes: equal chunks hash alike wherever they sit; a single changed id at any position changes the hash."""

import numpy as np
import pytest

from prefixattn.chunk_hash import as_uint32, chunk_hashes


def test_equal_chunks_equal_hashes_anywhere():
    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 2**32 - 1, 64, dtype=np.uint32)
    # the same chunk at odd and even offsets of differently long rows
    rows = [np.concatenate([chunk, chunk]), np.concatenate([[7], chunk, [1, 2, 3]]).astype(np.uint32)]
    values = np.concatenate(rows)
    first, h0, h1 = chunk_hashes(values, np.array([0, 128, 129]), np.array([2, 0, 1]))
    assert first.tolist() == [0, 2, 2]
    assert len(set(h0.tolist())) == 1 and len(set(h1.tolist())) == 1


@pytest.mark.parametrize("vocab", [2**17, 2**32 - 1])
def test_single_id_changes_hash(vocab):
    # Every position (odd ones sit in the high half of a 64-bit word: h1 must catch those) and every bit.
    rng = np.random.default_rng(1)
    base = rng.integers(0, vocab, 64, dtype=np.uint64).astype(np.uint32)
    variants = [base]
    for pos in range(64):
        for bit in range(31):
            v = base.copy()
            v[pos] ^= np.uint32(1 << bit)
            variants.append(v)
    values = np.concatenate(variants)
    n = len(variants)
    _, h0, h1 = chunk_hashes(values, np.arange(n, dtype=np.int64) * 64, np.ones(n, dtype=np.int64))
    pairs = set(zip(h0.tolist(), h1.tolist()))
    assert len(pairs) == n


def test_rejects_odd_chunk_and_handles_empty():
    with pytest.raises(ValueError, match="chunk: expected an even"):
        chunk_hashes(np.zeros(8, np.uint32), np.array([0]), np.array([1]), chunk=3)
    first, h0, h1 = chunk_hashes(np.zeros(3, np.uint32), np.array([0, 1]), np.array([0, 0]))
    assert first.tolist() == [0, 0] and h0.size == 0 and h1.size == 0


def test_as_uint32_views_or_converts():
    a = np.array([1, 2], dtype=np.int32)
    assert as_uint32(a).base is a or np.shares_memory(as_uint32(a), a)
    assert as_uint32(np.array([2**32 - 2], dtype=np.int64)).tolist() == [2**32 - 2]
