"""The gallery of model problems, and device helpers shared by the tests.

Every test takes its model matrices from here (like ``pyamg.gallery``): 1D and
2D Laplacians, their shifted, convected and scaled variants, random SPD
matrices. Each builder documents its matrix (symmetry, definiteness, size),
so a test names the property it relies on by the builder it calls. Tiny
matrices that are the point of one test (a 2 x 2 singular one, a pattern)
stay in that test.

The device helpers are used by ``tests/solvers/`` and ``tests/test_solve.py``,
each of which parametrises its own ``backend`` fixture with :data:`BACKENDS`
(a conftest in ``tests/solvers/`` would shadow the root one that
``test_cluster.py`` imports as ``conftest``). The "cuda" backend moves
inputs with CuPy directly, not through the library, so a wrong library
transfer cannot hide a wrong solver.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

# Parameters of every ``backend`` fixture: the mark sits on the parameter so
# ``-m gpu`` selects the CUDA runs.
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# -- 1D
def tridiagonal(n, lower, diag, upper, dtype=np.float64):
    """The n x n CSR matrix with constant ``lower``, ``diag`` and ``upper`` diagonals.

    Symmetric when ``lower == upper``; strictly diagonally dominant (so
    nonsingular, and SPD when also symmetric with ``diag > 0``) when
    ``|diag| > |lower| + |upper|``.
    """
    return sp.diags([lower, diag, upper], [-1, 0, 1], shape=(n, n)).tocsr().astype(dtype)


def laplacian1d(n, dtype=np.float64, *, neumann=False):
    """The 1D Laplacian ``tridiag(-1, 2, -1)``: SPD with Dirichlet ends (3 n - 2 entries).

    ``neumann=True``: the ends' diagonal is 1, rows sum to zero, and the
    constants span the null space (singular, positive semi-definite).
    """
    A = tridiagonal(n, -1.0, 2.0, -1.0, dtype)
    if neumann:
        A = A.tolil()
        A[0, 0] = A[n - 1, n - 1] = 1.0
        A = A.tocsr()
    return A


def one_large_eigenvalue(n, value=1e10):
    """``diag(value, 1, ..., 1)``: nonsingular, cond ``|value|``; SPD when ``value > 0``.

    Badly scaled rather than singular: ``||A r|| / (||A|| ||r||)`` is
    ``1 / |value|`` for any r without a first entry.
    """
    return sp.diags(np.r_[value, np.ones(n - 1)]).tocsr()


# -- 2D and 3D Laplacians and their variants
def poisson2d(m, dtype=np.float64):
    """The 5-point Laplacian on an m x m grid: SPD, n = m * m."""
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return sp.kronsum(T, T).tocsr().astype(dtype)


def poisson3d(m, dtype=np.float64):
    """The 7-point Laplacian on an m x m x m grid: SPD, n = m ** 3."""
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return sp.kronsum(sp.kronsum(T, T), T).tocsr().astype(dtype)


def neumann2d(m):
    """The 5-point Laplacian on an m x m grid with pure Neumann boundaries: singular.

    Every row sums to zero (the constants are its null space), so a direct
    solve finds it singular and a right-hand side outside its range has no
    solution.
    """
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m)).tolil()
    T[0, 0] = T[m - 1, m - 1] = 1.0
    return sp.kronsum(T.tocsr(), T.tocsr()).tocsr()


def helmholtz2d(m, shift=0.3, dtype=np.float64):
    """:func:`poisson2d` minus ``shift * I`` (a Helmholtz operator): symmetric.

    SPD while ``shift`` is below the smallest eigenvalue of ``poisson2d(m)``,
    ``4 (1 - cos(pi / (m + 1)))`` (0.087 for m = 14), indefinite above it,
    nonsingular unless ``shift`` is one of its eigenvalues; the diagonal is
    negative for ``shift > 4``.
    """
    return (poisson2d(m) - shift * sp.eye(m * m)).tocsr().astype(dtype)


def high_contrast_poisson(m, contrast=1e6):
    """``-div(c grad u)`` on an m x m grid, c jumping by ``contrast`` across the middle (SPD)."""
    from managed_solve import pde

    def coefficient(x, y):
        return np.where(x < 0.5, contrast, 1.0)

    return pde.poisson_grid((m, m), 1.0, coefficient, device="cpu").A


def anisotropic_badly_scaled(m, eps=0.01, spread=3.0, seed=0):
    """S (L_x + eps L_y) S with S spanning exp(+-spread): SPD, anisotropic, badly scaled; n = m * m."""
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    A = sp.kron(T, sp.eye(m)) + eps * sp.kron(sp.eye(m), T)
    s = np.exp(np.random.default_rng(seed).uniform(-spread, spread, m * m))
    S = sp.diags(s)
    return (S @ A @ S).tocsr()


# -- non-symmetric
def convection_diffusion(m, dtype=np.float64, wind=0.4):
    """2D upwind convection-diffusion: non-symmetric, well posed."""
    T = sp.diags([-1.0 - wind, 2.0 + wind, -1.0], [-1, 0, 1], shape=(m, m))
    return sp.kronsum(T, sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))).tocsr().astype(dtype)


def upwind(m, peclet=0.6):
    """2D upwind convection-diffusion with both directions convected: non-symmetric; n = m * m.

    Diagonally dominant while ``peclet`` < 1 (BiCGStab and GMRES converge).
    """
    t = sp.diags([-1.0 - peclet, 2.0, -1.0 + peclet], [-1, 0, 1], shape=(m, m))
    return (sp.kron(sp.eye(m), t) + sp.kron(t, sp.eye(m))).tocsr()


def poisson2d_skew(m, c=0.5):
    """:func:`poisson2d` plus a skew-symmetric (convection) part: non-symmetric, positive definite.

    Its eigenvalues near zero are almost imaginary (hard for BiCGStab).

    ``x^T A x = x^T P x > 0``, so BiCGStab and GMRES converge on it.
    """
    U = sp.diags([c], [1], shape=(m * m, m * m))
    return (poisson2d(m) + U - U.T).tocsr()


def poisson2d_plus_diagonal(m, value, offset=1, dtype=np.float64):
    """:func:`poisson2d` plus the constant ``value`` on diagonal ``offset``: non-symmetric.

    Not symmetric, so not for CG; for the values the tests use (0.3 to 0.9)
    BiCGStab and GMRES converge on it.
    """
    n = m * m
    return (poisson2d(m) + sp.diags([value], [offset], shape=(n, n))).tocsr().astype(dtype)


# -- random
def random_spd(n, seed=0):
    """Random sparse SPD: symmetric pattern, strictly diagonally dominant, varied diagonal."""
    R = sp.random(n, n, density=4.0 / n, random_state=seed, format="csr")
    S = R + R.T
    d = np.asarray(abs(S).sum(axis=1)).ravel() + np.random.default_rng(seed).uniform(0.5, 5, n)
    return (S + sp.diags(d)).tocsr()


def random_gram_spd(n, rng, density=0.2):
    """A random sparse SPD matrix: R R^T shifted by ``1 + n * density``."""
    R = sp.random(n, n, density=density, random_state=rng, format="csr")
    return (R @ R.T + sp.eye(n) * (1.0 + n * density)).tocsr()


# -- transformations
def symmetrically_scaled(A, d):
    """``D A D`` with ``D = diag(d)``: keeps symmetry and definiteness, spoils the scaling.

    A badly scaled ``d`` (entries spanning decades) is what Jacobi
    preconditioning undoes.
    """
    D = sp.diags(d)
    return (D @ A @ D).tocsr()


# -- devices and checks
def on(backend, *arrays):
    """The arrays (CSR matrices and vectors) on ``backend``; one array alone is returned bare."""
    if backend == "cpu":
        return arrays if len(arrays) > 1 else arrays[0]
    import cupy as cp
    import cupyx.scipy.sparse as csp

    out = tuple(csp.csr_matrix(a) if sp.issparse(a) else cp.asarray(a) for a in arrays)
    return out if len(out) > 1 else out[0]


def array_modules(backend):
    """(xp, sparse module) of a ``backend`` parameter: NumPy/SciPy or CuPy/cupyx."""
    if backend == "cpu":
        return np, sp
    import cupy
    import cupyx.scipy.sparse as csp

    return cupy, csp


def host(x):
    """A NumPy copy of a NumPy or CuPy array."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def assert_solves(x, A, b, dtype, rtol, *, x_true, x_ref, residual_factor=5):
    """x (any device) keeps ``dtype``, meets ``residual_factor * rtol`` and matches both references."""
    x = host(x)
    assert x.dtype == dtype
    rel = np.linalg.norm(b.astype(np.float64) - A.astype(np.float64) @ x) / np.linalg.norm(b)
    assert rel <= residual_factor * rtol
    tol = 1e-5 if dtype == np.float64 else 5e-2
    assert np.linalg.norm(x - x_true) / np.linalg.norm(x_true) < tol
    assert np.linalg.norm(x - x_ref) / np.linalg.norm(x_ref) < tol


def assert_matches_spsolve(x, A, b, dtype):
    """x (any device) agrees with SciPy's sparse LU solution in float64."""
    x_direct = sla.spsolve(A.astype(np.float64).tocsc(), b.astype(np.float64))
    tol = 1e-6 if dtype == np.float64 else 1e-2
    assert np.linalg.norm(host(x) - x_direct) / np.linalg.norm(x_direct) < tol


# -- problems of the algebraic multigrid tests (tests/solvers/amg/)
def rotated_anisotropic(m, epsilon=0.001, theta=np.pi / 8):
    """Rotated anisotropic diffusion (PyAMG's FE stencil) on an m x m grid: SPD, n = m * m."""
    gallery = pytest.importorskip("pyamg.gallery")
    stencil = gallery.diffusion_stencil_2d(epsilon=epsilon, theta=theta, type="FE")
    return gallery.stencil_grid(stencil, (m, m), format="csr")


def elasticity(m):
    """2D linear elasticity on an m x m grid (BSR, blocksize 2) and its 3 rigid-body modes."""
    gallery = pytest.importorskip("pyamg.gallery")
    return gallery.linear_elasticity((m, m), format="bsr")
