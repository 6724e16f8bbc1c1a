"""Finite-difference stencils (5-point, 7-point, variable coefficient) against SciPy Kronecker sums."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import assembly

BACKENDS = [
    "cpu",
    pytest.param("cudasim", marks=pytest.mark.cudasim),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def second_difference(n: int, h: float) -> sp.csr_matrix:
    return sp.diags([-np.ones(n - 1), 2 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1]) / h**2


def reference_constant(shape, lengths=1.0):
    L = np.broadcast_to(np.asarray(lengths, float), (len(shape),))
    mats = [second_difference(n, Lx / (n + 1)) for n, Lx in zip(shape, L, strict=True)]
    A = sp.csr_matrix((int(np.prod(shape)),) * 2)
    for ax, T in enumerate(mats):
        ops = [sp.identity(n) for n in shape]
        ops[ax] = T
        K = ops[0]
        for o in ops[1:]:
            K = sp.kron(K, o)
        A = A + K
    return A.tocsr()


def reference_variable_2d(c_nodes: np.ndarray, h: float) -> sp.csr_matrix:
    """Flux form with face values = mean of the two nodes, boundary faces = the node value."""
    nx, ny = c_nodes.shape
    idx = np.arange(nx * ny).reshape(nx, ny)
    rows, cols, vals = [], [], []
    diag = np.zeros((nx, ny))
    for axis in (0, 1):
        cf = 0.5 * (np.take(c_nodes, range(1, c_nodes.shape[axis]), axis) +
                    np.take(c_nodes, range(c_nodes.shape[axis] - 1), axis))
        a = np.take(idx, range(c_nodes.shape[axis] - 1), axis).ravel()
        b = np.take(idx, range(1, c_nodes.shape[axis]), axis).ravel()
        rows += [a, b]
        cols += [b, a]
        vals += [-cf.ravel() / h**2] * 2
        np.add.at(diag.reshape(-1), a, cf.ravel() / h**2)
        np.add.at(diag.reshape(-1), b, cf.ravel() / h**2)
        first = np.take(idx, [0], axis).ravel()
        last = np.take(idx, [c_nodes.shape[axis] - 1], axis).ravel()
        np.add.at(diag.reshape(-1), first, c_nodes.reshape(-1)[first] / h**2)
        np.add.at(diag.reshape(-1), last, c_nodes.reshape(-1)[last] / h**2)
    n = nx * ny
    off = sp.coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n))
    return (off + sp.diags(diag.ravel())).tocsr()


def run(backend, shape, **kwargs):
    A = assembly.assemble_grid(shape, device="cuda:0" if backend == "cuda" else "cpu",
                               backend=backend, **kwargs)
    if backend == "cuda":
        import cupyx.scipy.sparse as csp

        assert isinstance(A, csp.csr_matrix)
        A = A.get()
    return A


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 5)])
def test_constant_coefficient_matches_kronecker_sum(backend, shape):
    A = run(backend, shape, lengths=(1.0, 2.0, 0.5)[: len(shape)])
    R = reference_constant(shape, lengths=(1.0, 2.0, 0.5)[: len(shape)])
    assert A.nnz == R.nnz and A.has_sorted_indices
    assert abs(A - R).max() <= 1e-12 * abs(R).max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_variable_coefficient_matches_flux_form(backend):
    rng = np.random.default_rng(0)
    c = rng.uniform(0.5, 2.0, (6, 5))
    # lengths make h equal on both axes: (n+1) h
    A = run(backend, c.shape, coefficient=c, lengths=(7.0 / 8, 6.0 / 8))
    R = reference_variable_2d(c, 1.0 / 8)
    assert abs(A - R).max() <= 1e-12 * abs(R).max()
    assert abs(A - A.T).max() == 0
    assert np.linalg.eigvalsh(A.toarray()).min() > 0


def test_float32_int64_and_callable_coefficient():
    A = assembly.assemble_grid((4, 6), coefficient=lambda x, y: 1.0 + 0.0 * x, dtype=np.float32,
                               index_dtype=np.int64)
    R = reference_constant((4, 6))
    assert A.dtype == np.float32 and A.indices.dtype == np.int64
    assert abs(A - R).max() <= 1e-6 * abs(R).max()


def test_bad_coefficient_is_rejected():
    with pytest.raises(ValueError, match="coefficient must be finite and > 0"):
        assembly.assemble_grid((3, 3), coefficient=-1.0)
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        assembly.assemble_grid((3, 3), coefficient=np.ones((2, 3)))
