"""Symbolic phase: CSR pattern of vertex adjacency and the slot map."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import assembly
from managed_solve.mesh import grid, icosphere, torus


def adjacency_pattern(F: np.ndarray, n: int) -> sp.csr_matrix:
    k = F.shape[1]
    rows = np.repeat(F, k, axis=1).ravel()
    cols = np.tile(F, (1, k)).ravel()
    A = sp.coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, n)).tocsr()
    A.sort_indices()
    return A


@pytest.mark.parametrize("make", [lambda: icosphere(2), lambda: torus(nu=12, nv=7), lambda: grid(4, 3, 5)])
def test_pattern_and_slots(make):
    m = make()
    p = assembly.symbolic(m)
    R = adjacency_pattern(m.faces, m.n_vertices)
    np.testing.assert_array_equal(p.indptr, R.indptr)
    np.testing.assert_array_equal(p.indices, R.indices)
    k = m.faces.shape[1]
    rows = np.repeat(np.arange(m.n_vertices), np.diff(p.inc_ptr))
    # incidence: every (element, local) pair exactly once, grouped by vertex
    assert np.array_equal(m.faces[p.inc_elem, p.inc_local], rows)
    assert len(set(zip(p.inc_elem.tolist(), p.inc_local.tolist(), strict=True))) == m.n_faces * k
    # slots: the entry (row, column) they point at is the one the element needs
    slot_rows = np.searchsorted(p.indptr, p.inc_slot, side="right") - 1
    assert np.array_equal(slot_rows, np.broadcast_to(rows[:, None], slot_rows.shape))
    assert np.array_equal(p.indices[p.inc_slot], m.faces[p.inc_elem])


@pytest.mark.cudasim
@pytest.mark.parametrize("make", [lambda: icosphere(1), lambda: grid(3, 3, 3)])
def test_cuda_symbolic_kernels_match_cpu(make):
    m = make()
    a = assembly.symbolic(m)
    b = assembly.symbolic(m, backend="cudasim")
    assert b is not a and b.target.backend == "cudasim"
    for name in ("indptr", "indices", "inc_ptr", "inc_elem", "inc_local", "inc_slot"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_int64_indices_when_asked():
    m = icosphere(2)
    p32 = assembly.symbolic(m)
    p64 = assembly.symbolic(m, index_dtype=np.int64)
    assert p32.indices.dtype == np.int32 and p64.indices.dtype == np.int64
    assert p64.inc_slot.dtype == np.int64
    np.testing.assert_array_equal(p32.inc_slot, p64.inc_slot)
    L32 = assembly.assemble(m)
    L64 = assembly.assemble(m, index_dtype=np.int64)
    assert L64.indices.dtype == np.int64 and L64.indptr.dtype == np.int64
    assert abs(L64 - L32).max() == 0
