"""The GPU checks of inputs (managed_solve/system/device_checks.py) against the host's.

Each check is compared with what the host computes for the same matrix:
the one-pass symmetry and Gershgorin kernel, SciPy's canonical form, NumPy's
``isfinite``. All run on a GPU only.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve.kernels.symmetry import csr_symmetry_gershgorin
from tests._problems import convection_diffusion, laplacian1d, poisson2d, random_spd

pytestmark = pytest.mark.gpu


def _gpu(A):
    import cupyx.scipy.sparse as csp

    return csp.csr_matrix(A)


def _host_answer(A, rel=1e-12):
    code, *bounds = csr_symmetry_gershgorin(A.indptr, A.indices, A.data, rel)
    return int(code), tuple(bounds)


def _gallery():
    sym_pattern = poisson2d(6).tolil()
    sym_pattern[0, 1] = -0.5  # the mirror (1, 0) keeps -1: values differ, pattern same
    missing = poisson2d(5).tolil()
    missing[0, 7] = 0.25  # no (7, 0): the pattern differs
    tiny = laplacian1d(4)
    tiny.data[1] *= 1 + 1e-14  # below the relative tolerance: symmetric
    return {
        "poisson2d": poisson2d(9),
        "poisson2d float32": poisson2d(7, np.float32),
        "random spd": random_spd(40, seed=3),
        "convection": convection_diffusion(6),
        "negative": -poisson2d(5),
        "values differ": sym_pattern.tocsr(),
        "pattern differs": missing.tocsr(),
        "within tolerance": tiny,
        "one row": sp.csr_matrix(np.array([[3.0]])),
    }


def test_symmetry_many_matches_the_host_kernel_matrix_by_matrix():
    from managed_solve.system.device_checks import symmetry_many

    gallery = _gallery()
    mats = [_gpu(A) for A in gallery.values()]
    found = symmetry_many(mats)
    for (name, A), (code, bounds) in zip(gallery.items(), found, strict=True):
        want_code, want_bounds = _host_answer(A)
        assert code == want_code, name
        np.testing.assert_allclose(bounds, want_bounds, rtol=1e-6 if A.dtype == np.float32 else 1e-12,
                                   err_msg=name)


def test_symmetry_many_over_hundreds_of_matrices_in_one_launch():
    from managed_solve.system.device_checks import symmetry_many

    rng = np.random.default_rng(0)
    host = []
    for k in range(300):
        A = poisson2d(int(rng.integers(3, 40)))
        if k % 3 == 1:
            A = convection_diffusion(int(rng.integers(3, 20)))
        host.append(A)
    found = symmetry_many([_gpu(A) for A in host])
    assert [c for c, _ in found] == [_host_answer(A)[0] for A in host]
    np.testing.assert_allclose(np.array([b for _, b in found]),
                               np.array([_host_answer(A)[1] for A in host]), rtol=1e-12)


def test_symmetry_many_leaves_rows_out_of_order_to_the_general_test():
    import cupy as cp

    from managed_solve.system.device_checks import csr_from_parts, symmetry_many

    A = poisson2d(4)
    indices = A.indices.copy()
    indices[[0, 1]] = indices[[1, 0]]  # row 0's two columns swapped
    data = A.data.copy()
    data[[0, 1]] = data[[1, 0]]
    M = csr_from_parts(cp.asarray(data), cp.asarray(indices), cp.asarray(A.indptr), 16,
                       canonical=False)
    assert symmetry_many([M]) == [None]


@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_csr_structure_flags_each_defect(index):
    import cupy as cp

    from managed_solve.system import device_checks as dc

    A = poisson2d(4)

    def flags(indptr, indices, n=16):
        return dc.csr_structure(cp.asarray(np.asarray(indptr, index)),
                                cp.asarray(np.asarray(indices, index)), n)

    assert flags(A.indptr, A.indices) == 0
    bad = A.indptr.copy()
    bad[0] = 1
    assert flags(bad, A.indices) & dc.FLAG_BAD_INDPTR
    bad = A.indptr.copy()
    bad[5], bad[6] = bad[6], bad[5]  # decreasing
    assert flags(bad, A.indices) & dc.FLAG_BAD_INDPTR
    assert flags(A.indptr, A.indices[:-1]) & dc.FLAG_BAD_INDPTR  # does not end at nnz
    for wrong in (-1, 16):
        cols = A.indices.copy()
        cols[3] = wrong
        assert flags(A.indptr, cols) & dc.FLAG_BAD_INDEX
    cols = A.indices.copy()
    cols[1] = cols[0]  # a duplicate in row 0
    assert flags(A.indptr, cols) == dc.FLAG_NOT_CANONICAL


def test_nonfinite_names_each_array():
    import cupy as cp

    from managed_solve.system.device_checks import nonfinite

    arrays = [cp.ones(1000), cp.array([1.0, np.nan]), cp.array([np.inf], np.float32),
              cp.zeros(0), cp.full(70_000, -np.inf), cp.arange(5.0)[::2]]
    assert nonfinite(arrays) == [False, True, True, False, True, False]


def test_inputs_on_a_gpu_are_checked_as_the_host_checks_them():
    import cupy as cp
    torch = pytest.importorskip("torch")

    from managed_solve import LinearSystem

    A = poisson2d(5)
    crow = torch.tensor(A.indptr, dtype=torch.int64, device="cuda")
    col = torch.tensor(A.indices, dtype=torch.int64, device="cuda")
    vals = torch.tensor(A.data, device="cuda")
    b = torch.ones(25, dtype=torch.float64, device="cuda")
    s = LinearSystem((crow, col, vals), b)
    assert s.A.indices.dtype == np.int32 and s.A.has_canonical_format
    assert abs(s.A.get() - A).max() == 0
    t = LinearSystem(torch.sparse_csr_tensor(crow, col, vals, size=(25, 25)), b)
    assert abs(t.A.get() - A).max() == 0

    wrong = col.clone()
    wrong[4] = 25
    with pytest.raises(ValueError, match=r"column indices outside \[0, 25\)"):
        LinearSystem((crow, wrong, vals), b)
    short = crow.clone()
    short[-1] -= 1
    with pytest.raises(ValueError, match="row pointers"):
        LinearSystem((short, col, vals), b)
    nan = vals.clone()
    nan[7] = float("nan")
    with pytest.raises(ValueError, match="A has NaN or Inf"):
        LinearSystem((crow, col, nan), b)
    with pytest.raises(ValueError, match="b has NaN or Inf"):
        LinearSystem((crow, col, vals), b * float("inf"))
    with pytest.raises(ValueError, match="x0 has NaN or Inf"):
        LinearSystem((crow, col, vals), b, x0=cp.full(25, np.nan))

    # Duplicates and unsorted rows are summed and sorted, as SciPy does.
    coo = A.tocoo()
    rows = np.concatenate([coo.row, [0, 3]])
    cols = np.concatenate([coo.col, [0, 4]])
    data = np.concatenate([coo.data, [1.5, -2.0]])
    order = np.lexsort((-cols, rows))  # columns descending within each row
    D = sp.csr_matrix((data, (rows, cols)), shape=(25, 25))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=25))])
    u = LinearSystem((cp.asarray(indptr), cp.asarray(cols[order]), cp.asarray(data[order])),
                     cp.ones(25))
    assert u.A.has_canonical_format and abs(u.A.get() - D).max() < 1e-15


def test_solve_many_on_gpu_inputs_chooses_as_on_host_inputs():
    import cupy as cp
    import cupyx.scipy.sparse as csp

    import managed_solve as ms

    mats = [poisson2d(6), convection_diffusion(5), -poisson2d(4), random_spd(30, seed=1),
            poisson2d(7)]
    host = ms.solve_many([(A, np.ones(A.shape[0])) for A in mats], rtol=1e-10, devices=["cuda:0"])
    gpu = ms.solve_many([(csp.csr_matrix(A), cp.ones(A.shape[0])) for A in mats], rtol=1e-10,
                        devices=["cuda:0"])
    assert [r.method for r in gpu] == [r.method for r in host]
    for A, r in zip(mats, gpu, strict=True):
        assert r.converged
        x = cp.asnumpy(r.x)
        assert np.linalg.norm(A @ x - 1) <= 1e-9 * np.sqrt(A.shape[0])
