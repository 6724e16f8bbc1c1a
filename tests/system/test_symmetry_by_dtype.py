"""The symmetry rule's tolerance follows the dtype (kernels/symmetry.py ``symmetry_rtol``).

A float32 matrix assembled from COO triplets sums the duplicates of
``(i, j)`` and of ``(j, i)`` in different orders, so its mirrors differ by a
few float32 ulps. Judged with float64's 1e-12 it counted as not symmetric
and ``method="auto"`` chose BiCGStab over CG. Every path of the rule is
checked here: the host walks, the array version, the dense test, ``solve``,
``solve_many``'s many-matrix pass and the GPU kernel; a float32 matrix with
a real asymmetry (1e-3) stays non-symmetric on each.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import managed_solve as ms
from managed_solve import LinearSystem
from managed_solve.scheduling import validate
from managed_solve.system import is_symmetric
from managed_solve.system.method import matrix_symmetry
from tests._problems import BACKENDS, convection_diffusion, host, on


def assembled(shift, n=200, edges=2000, contributions=4, seed=0):
    """A symmetric float32 matrix assembled from shuffled COO triplets, plus ``shift * I``.

    Each of ``edges`` random pairs ``(i, j)`` brings ``contributions``
    values to both ``(i, j)`` and ``(j, i)``; the triplets are shuffled, so
    SciPy sums an entry's and its mirror's duplicates in different orders
    and the mirrors differ in their last bits. SPD for ``shift=30`` (with 4
    contributions); with ``shift=10`` some diagonal entries are negative.
    """
    rng = np.random.default_rng(seed)
    i, j = rng.integers(0, n, edges), rng.integers(0, n, edges)
    w = rng.standard_normal((edges, contributions)).astype(np.float32).ravel()
    rows = np.r_[np.repeat(i, contributions), np.repeat(j, contributions)]
    cols = np.r_[np.repeat(j, contributions), np.repeat(i, contributions)]
    p = rng.permutation(rows.shape[0])
    A = sp.coo_matrix((np.r_[w, w][p], (rows[p], cols[p])), shape=(n, n)).tocsr()
    A = (A + shift * sp.identity(n, dtype=np.float32, format="csr")).tocsr()
    assert A.dtype == np.float32 and abs(A - A.T).max() > 0  # the mirrors do differ
    return A


def convection32(wind=1e-3):
    """Upwind convection-diffusion in float32 whose mirrors differ by ``wind`` relative (1e-3)."""
    return convection_diffusion(14, np.float32, wind=wind)


def marked_not_canonical(A):
    """A copy of CSR ``A`` that does not claim canonical form (the array version of the rule decides)."""
    B = A.copy()
    B.has_canonical_format = False
    return B


@pytest.mark.parametrize("contributions", [4, 30])
def test_a_float32_matrix_assembled_in_two_orders_is_symmetric(settings, contributions):
    """The brief's matrix (4 contributions a pair) and an FE-like one (30): symmetric on every host path."""
    A = assembled(10.0, contributions=contributions)
    assert is_symmetric(A)  # the one-pass walk
    assert is_symmetric(marked_not_canonical(A))  # the array version
    b = np.ones(A.shape[0], np.float32)
    assert matrix_symmetry(LinearSystem(A.toarray(), b)) is True  # the dense test
    assert LinearSystem(A, b).is_symmetric_hint
    settings(symmetry_parallel_nnz=1000, symmetry_workers=4)
    assert is_symmetric(A)  # in row chunks on helper threads


def test_a_float32_matrix_with_a_real_asymmetry_is_not_symmetric(settings):
    """1e-3 relative between mirrors is no rounding, in float32 as in float64."""
    for C in (convection32(), convection_diffusion(14, wind=1e-3)):
        assert not is_symmetric(C)
        assert not is_symmetric(marked_not_canonical(C))
        assert matrix_symmetry(LinearSystem(C.toarray(), np.ones(C.shape[0], C.dtype))) is False
    settings(symmetry_parallel_nnz=100, symmetry_workers=4)
    assert not is_symmetric(convection32())


def test_float64_keeps_its_tolerance():
    """The same mirrors a few float32 ulps apart, in float64, are beyond float64's rounding."""
    A = assembled(10.0).astype(np.float64)
    assert not is_symmetric(A)
    assert is_symmetric(assembled(10.0))


def test_auto_solves_an_assembled_float32_spd_matrix_with_cg():
    """It chose BiCGStab (A counted as non-symmetric); CG's answer matches the float64 solve."""
    A = assembled(30.0)
    b = np.ones(A.shape[0], np.float32)
    res = ms.solve(A, b, rtol=1e-5, device="cpu")
    assert res.method == "cg" and res.status == ms.Status.CONVERGED, res.message
    want = np.linalg.solve(A.toarray().astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(res.x, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    res = ms.solve(convection32(), np.ones(196, np.float32), rtol=1e-5, device="cpu")
    assert res.method not in ("cg", "minres") and res.status == ms.Status.CONVERGED


def test_solve_many_and_its_pass_take_the_dtypes_tolerance():
    """16 assembled float32 systems (the many-matrix pass runs) go to CG; convection ones do not."""
    base = assembled(30.0)
    mats = [(base * np.float32(2.0 ** k)).tocsr() for k in range(16)]  # exact scalings
    cache: dict = {}
    validate.check_symmetry(mats, cache)
    assert all(cache[id(A)][1] is True for A in mats)
    b = np.ones(base.shape[0], np.float32)
    out = ms.solve_many([(A, b) for A in mats], rtol=1e-5)
    assert [r.method for r in out] == ["cg"] * 16
    assert all(r.status == ms.Status.CONVERGED for r in out)
    convs = [convection32(1e-3 * (1 + k / 16)) for k in range(16)]
    cache = {}
    validate.check_symmetry(convs, cache)
    assert all(cache[id(C)][1] is False for C in convs)
    out = ms.solve_many([(C, np.ones(196, np.float32)) for C in convs], rtol=1e-5)
    assert not {r.method for r in out} & {"cg", "minres"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_device_takes_the_dtypes_tolerance(backend):
    """The GPU kernel (rel from the dtype, one launch) and its array fallback agree with the host."""
    A, C = assembled(30.0), convection32()
    assert is_symmetric(on(backend, A)) and not is_symmetric(on(backend, C))
    assert is_symmetric(on(backend, marked_not_canonical(A)))
    if backend == "cuda":
        from managed_solve.kernels.symmetry import DIFFERENT_VALUES, SYMMETRIC
        from managed_solve.system.device_checks import symmetry_many

        codes = [found[0] for found in symmetry_many([on(backend, A), on(backend, C)])]
        assert codes == [SYMMETRIC, DIFFERENT_VALUES]
    b = np.ones(A.shape[0], np.float32)
    res = ms.solve(*on(backend, A, b), rtol=1e-5)
    assert res.method == "cg" and res.status == ms.Status.CONVERGED, res.message
    out = ms.solve_many([on(backend, A * np.float32(2.0 ** k), b) for k in range(16)], rtol=1e-5)
    assert [r.method for r in out] == ["cg"] * 16
    assert host(out[0].x).dtype == np.float32


def test_a_float32_grid_operator_gets_the_method_its_float64_copy_gets():
    """A variable-coefficient diffusion operator built in float32: its row sums cancel to a few
    float32 ulps below zero (Gershgorin's lo about -4e-8 of the diagonal), which float64's 1e-12
    read as not weakly dominant: CG's count was unpredictable and the CPU chose an LU for float32
    only. Both dtypes now choose CG and solve to the tolerance."""
    from managed_solve import pde
    from managed_solve.system.method import choose_method

    c = np.exp(np.random.default_rng(0).uniform(-1.0, 1.0, (60, 60)))
    chosen = []
    for dt in (np.float64, np.float32):
        s = pde.poisson_grid((60, 60), np.ones((60, 60)), coefficient=c, dtype=dt, rtol=1e-4)
        res = ms.solve(s, device="cpu")
        chosen.append((choose_method(s, "cpu"), res.method))
        assert res.converged
        A = s.A.astype(np.float64)
        assert np.linalg.norm(s.b - A @ res.x) <= 1e-4 * np.linalg.norm(s.b) * 1.01
    assert chosen == [("cg", "cg"), ("cg", "cg")]
