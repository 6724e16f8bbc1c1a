"""Staging: the host pack of a batch (one block-diagonal CSR) that the stagers copy to devices."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import LinearSystem
from tests._problems import poisson2d
from tests._problems import poisson2d_skew as convection


@pytest.mark.parametrize("chunk_nnz", [1 << 21, 40])  # one piece; many pieces on the pool
@pytest.mark.parametrize("jacobi", [False, True])
def test_vectorised_host_pack_matches_block_diagonal(jacobi, chunk_nnz):
    from managed_solve.solvers.batched import default_maxiter, pack_host

    rng = np.random.default_rng(30)
    systems = []
    for k, m in enumerate(rng.integers(2, 9, size=7)):
        m = int(m)
        x0 = rng.standard_normal(m * m) if k % 3 == 0 else None
        systems.append(LinearSystem(convection(m) if k % 2 else poisson2d(m), rng.standard_normal(m * m),
                                    x0=x0, rtol=1e-6 * (k + 1), maxiter=50 if k == 2 else None,
                                    name=f"h{k}"))
    # Matrices shared by several systems (read once by the packer), one of them
    # with 64-bit indices (that family is then concatenated, casting).
    wide = poisson2d(4)
    wide.indices, wide.indptr = wide.indices.astype(np.int64), wide.indptr.astype(np.int64)
    for k, A in enumerate([systems[1].A, wide, systems[0].A, wide, systems[1].A]):
        systems.append(LinearSystem(A, rng.standard_normal(A.shape[0]), name=f"shared{k}"))
    assert systems[-1].A is systems[1].A and systems[-2].A is systems[-4].A
    assert systems[-2].A.indices.dtype == np.int64
    made = []

    def empty(size, dtype):  # stands in for the pinned allocator used towards GPUs
        made.append(np.full(size, -1, dtype=dtype))
        return made[-1]

    ours = pack_host(systems, jacobi=jacobi, empty=empty, chunk_nnz=chunk_nnz)
    for attr in ("indptr", "indices", "data", "b", "x0", "row_sys") + (("dinv",) if jacobi else ()):
        assert any(getattr(ours, attr) is m for m in made), attr
    # Reference: SciPy's block diagonal and plain concatenations.
    ref = sp.block_diag([s.A for s in systems], format="csr")
    np.testing.assert_array_equal(ours.indptr, ref.indptr)
    np.testing.assert_array_equal(ours.indices, ref.indices)
    np.testing.assert_array_equal(ours.data, ref.data)
    assert ours.indptr.dtype == ours.indices.dtype == np.int32
    np.testing.assert_array_equal(ours.b, np.concatenate([s.b for s in systems]))
    np.testing.assert_array_equal(
        ours.x0, np.concatenate([s.x0 if s.x0 is not None else np.zeros(s.n) for s in systems]))
    sizes = [s.n for s in systems]
    np.testing.assert_array_equal(ours.offsets, np.concatenate([[0], np.cumsum(sizes)]))
    np.testing.assert_array_equal(ours.row_sys, np.repeat(np.arange(len(systems)), sizes))
    np.testing.assert_array_equal(ours.rtol, [s.rtol for s in systems])
    np.testing.assert_array_equal(ours.maxiter, [s.maxiter or default_maxiter(s.n) for s in systems])
    if jacobi:
        np.testing.assert_allclose(ours.dinv, 1.0 / ref.diagonal())
    else:
        assert ours.dinv is None
    assert ours.names == [s.name for s in systems]


@pytest.mark.parametrize("chunk_nnz", [1 << 21, 30])
def test_host_pack_names_a_system_jacobi_cannot_scale(chunk_nnz):
    systems = [LinearSystem(poisson2d(4), np.ones(16), name=f"z{k}") for k in range(5)]
    A = poisson2d(4).tolil()
    A[2, 2] = 0.0
    systems[3] = LinearSystem(A.tocsr(), np.ones(16), name="zero-diagonal")
    from managed_solve.solvers.batched import pack_host

    with pytest.raises(ValueError, match="zero-diagonal has a zero on its diagonal"):
        pack_host(systems, jacobi=True, chunk_nnz=chunk_nnz)
