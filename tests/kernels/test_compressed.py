"""The compressed-pattern check (kernels/compressed.py) against a plain-NumPy reference and SciPy's canonical test."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve.kernels.compressed import (
    BAD_INDEX,
    BAD_POINTERS,
    CANONICAL,
    VALID,
    compressed_pattern,
)


def reference(indptr: np.ndarray, indices: np.ndarray, bound: int, canonical: bool) -> int:
    """What compressed_pattern must answer, the plain-NumPy way."""
    p = indptr.astype(np.int64)
    if p.size == 0 or p[0] != 0 or p[-1] != indices.size or (np.diff(p) < 0).any():
        return BAD_POINTERS
    if indices.size and (indices.min() < 0 or indices.max() >= bound):
        return BAD_INDEX
    if not canonical:
        return VALID
    rows_sorted = all((np.diff(indices[a:b]) > 0).all() for a, b in zip(p[:-1], p[1:], strict=True))
    return CANONICAL if rows_sorted else VALID


def random_pattern(rng: np.random.Generator, rows: int, cols: int, index_dtype) -> tuple:
    """A random CSR pattern (empty rows included), shuffled or with a duplicate some of the time."""
    counts = np.minimum(rng.integers(0, 4, size=rows) * (rng.random(rows) < 0.8), cols)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(index_dtype)
    indices = np.concatenate([np.sort(rng.choice(cols, size=c, replace=False)) for c in counts]
                             + [np.zeros(0, np.int64)]).astype(index_dtype)
    kind = rng.integers(0, 4)
    if kind == 1 and indices.size > 1:
        rng.shuffle(indices)  # rows out of order, sometimes still sorted by chance
    elif kind == 2:  # a duplicate inside a row of at least two entries
        long_rows = np.flatnonzero(counts >= 2)
        if long_rows.size:
            i = int(long_rows[0])
            indices[indptr[i] + 1] = indices[indptr[i]]
    return indptr, indices


def spoil(rng: np.random.Generator, indptr: np.ndarray, indices: np.ndarray, cols: int, how: str):
    indptr, indices = indptr.copy(), indices.copy()
    if how == "high" and indices.size:
        indices[rng.integers(indices.size)] = cols + int(rng.integers(0, 5))
    elif how == "negative" and indices.size:
        indices[rng.integers(indices.size)] = -1 - int(rng.integers(0, 5))
    elif how == "start":
        indptr[0] = 1
    elif how == "end":
        indptr[-1] += 1
    elif how == "fall" and indptr.size > 2:
        i = int(rng.integers(1, indptr.size - 1))
        indptr[i] = indptr[-1] + 1 if indptr[i + 1] <= indptr[-1] else -1
    return indptr, indices


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("how", ["none", "high", "negative", "start", "end", "fall"])
def test_matches_the_reference_on_random_patterns(index_dtype, how):
    rng = np.random.default_rng(7)
    for _ in range(60):
        rows, cols = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        indptr, indices = spoil(rng, *random_pattern(rng, rows, cols, index_dtype), cols, how)
        for canonical in (False, True):
            assert compressed_pattern(indptr, indices, cols, canonical) == \
                reference(indptr, indices, cols, canonical), (indptr, indices, cols, canonical)


def test_the_canonical_answer_is_scipys_and_an_empty_pattern_is_valid():
    rng = np.random.default_rng(3)
    for _ in range(100):
        indptr, indices = random_pattern(rng, 9, 7, np.int32)
        A = sp.csr_matrix((np.ones(indices.size), indices, indptr), shape=(9, 7))
        code = compressed_pattern(indptr, indices, 7, True)
        assert code >= 0 and (code == CANONICAL) == A.has_canonical_format
    empty = np.zeros(0, np.int64)
    assert compressed_pattern(np.zeros(4, np.int64), empty, 3, True) == CANONICAL
    assert compressed_pattern(np.zeros(1, np.int64), empty, 0, False) == VALID
    assert compressed_pattern(empty, empty, 3, False) == BAD_POINTERS


def test_pointers_are_checked_before_any_index_is_read():
    """A pointer past the indices is refused as such, whatever the indices hold."""
    indices = np.array([0, 99], dtype=np.int32)
    assert compressed_pattern(np.array([0, 3, 2], np.int32), indices, 2, True) == BAD_POINTERS
    assert compressed_pattern(np.array([0, 1, 2], np.int32), indices, 2, True) == BAD_INDEX
