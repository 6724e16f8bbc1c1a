"""LinearSystem (system/linear_system.py): validation once at construction, facts, moves."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve import LinearSystem
from tests._problems import laplacian1d


def test_facts():
    A = laplacian1d(10)
    s = LinearSystem(A, np.ones(10), x0=np.zeros(10), name="lap")
    assert (s.n, s.nnz, s.shape) == (10, 28, (10, 10))
    assert s.nbytes == A.data.nbytes + A.indices.nbytes + A.indptr.nbytes + 2 * 80
    assert s.workspace_bytes("cg") == 4 * 10 * 8
    assert s.signature == (10, 28, "float64", "auto", "csr")
    assert s.device == "cpu"
    assert s.is_symmetric_hint is True
    assert LinearSystem(A + sp.eye(10, k=2), np.ones(10)).is_symmetric_hint is False
    assert "lap" in repr(s)


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (lambda: LinearSystem(sp.random(4, 5, density=0.5, format="csr"), np.ones(4)),
         ValueError, ["square", "(4, 5)"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(5)), ValueError, ["b must have shape (6,)", "(5,)"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones((6, 2))), ValueError, ["b must have shape", "solve_many"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), x0=np.ones(3)), ValueError, ["x0 must have shape (6,)"]),
        (lambda: LinearSystem(sp.csr_matrix((0, 0)), np.ones(0)), ValueError, ["empty"]),
        (lambda: LinearSystem(laplacian1d(6).astype(np.complex128), np.ones(6)), TypeError, ["complex", "real"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6, dtype=np.complex64)), TypeError, ["b", "complex"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), dtype=np.float16), TypeError, ["float16", "float32"]),
        (lambda: LinearSystem(laplacian1d(6), np.array(["a"] * 6)), TypeError, ["b", "float32 or float64"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), rtol=-1), ValueError, ["rtol"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), rtol=0, atol=0), ValueError, ["rtol and atol"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), maxiter=0), ValueError, ["maxiter"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), method="lu"), ValueError, ["method='lu'", "gmres"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), M="ilu"), ValueError, ["M='ilu'", "jacobi"]),
        (lambda: LinearSystem(sla.aslinearoperator(laplacian1d(6)), np.ones(6), method="direct"),
         ValueError, ["direct", "operator"]),
        (lambda: LinearSystem("A", np.ones(6)), TypeError, ["str", "sparse"]),
        (lambda: LinearSystem(None, np.ones(6)), TypeError, ["A is None"]),
    ],
)
def test_bad_input_names_the_argument(make, exc, words):
    with pytest.raises(exc) as info:
        make()
    for w in words:
        assert w in str(info.value)
    assert "LinearSystem" in str(info.value)


def test_to_cpu_keeps_options():
    s = LinearSystem(laplacian1d(6), np.ones(6), rtol=1e-6, method="cg", M="jacobi", name="n")
    t = s.to("cpu")
    assert (t.rtol, t.method, t.M, t.name) == (1e-6, "cg", "jacobi", "n")
    assert t.A is s.A  # already on the host: no copy
    assert s.to("sim:0").device == "cpu"


def test_replaced_keeps_the_system_and_refuses_unknown_fields():
    A = laplacian1d(6)
    s = LinearSystem(A, np.ones(6), rtol=1e-9)
    t = s.replaced(A=(2.0 * A).tocsr(), M="jacobi")
    assert t is not s and t.M == "jacobi" and t.rtol == 1e-9 and t.b is s.b
    np.testing.assert_allclose(t.A.toarray(), 2.0 * A.toarray())
    assert s.A is A and s.M != "jacobi"  # the original is untouched
    with pytest.raises(TypeError, match=r"replaced\(m=\.\.\.\).*expected one of"):
        s.replaced(m="jacobi")
