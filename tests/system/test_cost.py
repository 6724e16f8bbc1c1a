"""The cost and byte model (system/cost.py) against SciPy's CG and the arrays it counts."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as spla

from managed_solve import LinearSystem
from managed_solve.system.cost import (
    bytes_per_iteration,
    predict_iterations,
    solve_bytes,
    workspace_bytes,
)
from tests._problems import poisson2d


@pytest.mark.parametrize("m", [24, 48])
def test_predicted_iterations_match_scipy_cg(m):
    A, b = poisson2d(m), np.ones(m * m)
    count = [0]
    spla.cg(A, b, rtol=1e-8, callback=lambda _x: count.__setitem__(0, count[0] + 1))
    assert 0.8 < predict_iterations(m * m, rtol=1e-8) / count[0] < 1.25


def test_bytes_per_iteration_is_the_benchmark_floor():
    # The benchmark floor: nnz*(w+4) + 4n + 11*n*w, about 152 bytes a row for the 5-point stencil.
    m = 512
    A = poisson2d(m)
    per_row = bytes_per_iteration(A.shape[0], A.nnz) / A.shape[0]
    assert 150 < per_row <= 152


def test_solve_bytes_cover_the_arrays():
    A = poisson2d(20)
    stored = A.data.nbytes + A.indices.astype(np.int32).nbytes + A.indptr.astype(np.int32).nbytes
    vectors = 6 * A.shape[0] * 8  # b, x and CG's four work vectors
    assert solve_bytes(A.shape[0], A.nnz, method="cg") >= stored + vectors


def test_linear_system_workspace_bytes_is_the_cost_models():
    s = LinearSystem(poisson2d(6), np.ones(36), M="jacobi")
    for method in ("cg", "bicgstab", "gmres", "minres", "direct", "auto"):
        assert s.workspace_bytes(method) == workspace_bytes(method, 36, s.nnz, preconditioned=True)
    assert workspace_bytes("cg", 36, s.nnz) == 4 * 36 * 8
