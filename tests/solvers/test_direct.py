"""Direct solves against SciPy's spsolve; singular matrices give a status, not a crash."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve import Status, solve
from managed_solve.solvers.direct import CHOLESKY, DirectEngine, Singular, direct
from managed_solve.solvers.engine import Options
from tests._problems import (
    BACKENDS,
    host,
    laplacian1d,
    neumann2d,
    on,
    poisson2d,
    poisson2d_plus_diagonal,
    tridiagonal,
)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_direct_matches_spsolve(backend, dtype, symmetric):
    A = poisson2d(15, dtype) if symmetric else poisson2d_plus_diagonal(15, 0.7, offset=3, dtype=dtype)
    x_true = np.random.default_rng(4).standard_normal(A.shape[0]).astype(dtype)
    b = (A @ x_true).astype(dtype)
    ref = sla.spsolve(A.astype(np.float64).tocsc(), b.astype(np.float64))
    Ad, bd = on(backend, A, b)
    rtol = 1e-8 if dtype == np.float64 else 1e-5  # what float32 can resolve
    res = solve(Ad, bd, method="direct", rtol=rtol)
    assert res.converged, res.message
    assert res.relative_residual <= rtol
    x = host(res.x)
    assert x.dtype == dtype
    tol = 1e-10 if dtype == np.float64 else 1e-3
    np.testing.assert_allclose(x, ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(x, x_true, rtol=tol * 10, atol=tol * 10)
    assert res.iterations == 1


def test_direct_reports_a_tolerance_the_dtype_cannot_meet(backend):
    """float32 factors refined in float32 cannot reach rtol 1e-8: an honest status, x kept."""
    A = poisson2d(15, np.float32)
    b = np.ones(A.shape[0], dtype=np.float32)
    Ad, bd = on(backend, A, b)
    res = solve(Ad, bd, method="direct", rtol=1e-8)
    assert res.status.name == "MAXITER" and res.x is not None
    assert "float32" in res.message
    assert 1e-8 < res.relative_residual < 1e-5


def test_high_contrast_solvable_system_keeps_its_solution():
    """A coefficient jump of 1e6 makes tiny pivots; the answer is judged by its residual."""
    from tests._problems import high_contrast_poisson

    A = high_contrast_poisson(63, contrast=1e6)
    b = np.ones(A.shape[0])
    res = solve(A, b, method="direct", rtol=1e-6)
    assert res.converged, res.message
    assert np.linalg.norm(b - A @ res.x) <= 1e-6 * np.linalg.norm(b)
    ref = sla.spsolve(A.tocsc(), b)
    np.testing.assert_allclose(res.x, ref, rtol=1e-6, atol=1e-9 * np.abs(ref).max())


def test_direct_orders_symmetric_matrices_for_symmetry():
    """SPD: Cholesky; symmetric indefinite: SuperLU ordered for symmetry; otherwise COLAMD."""
    from tests._problems import helmholtz2d

    A = poisson2d(10)
    out = direct(A, np.ones(100), symmetric=True)
    assert out.info["factorisation"] == "Cholesky (supernodal, nested dissection)"
    H = helmholtz2d(10, shift=1.0)  # indefinite, positive diagonal: the Cholesky fails late
    out = direct(H, np.ones(100), symmetric=True)
    assert "MMD_AT_PLUS_A" in out.info["factorisation"]
    np.testing.assert_allclose(out.x, sla.spsolve(H.tocsc(), np.ones(100)), rtol=1e-10)
    out = direct(A, np.ones(100), symmetric=False)
    assert "COLAMD" in out.info["factorisation"]


def test_large_symmetric_matrices_are_ordered_by_nested_dissection():
    """From NESTED_DISSECTION_MIN_ROWS rows: SuperLU on the permuted matrix, answers for A and A^T."""
    from managed_solve import Solver
    from managed_solve.solvers.direct import NESTED_DISSECTION_MIN_ROWS, DirectEngine
    from managed_solve.solvers.engine import Options
    from tests._problems import helmholtz2d

    m = int(np.ceil(np.sqrt(NESTED_DISSECTION_MIN_ROWS)))
    A = helmholtz2d(m, shift=0.5)  # symmetric indefinite: SPD matrices take a Cholesky factor
    # A non-symmetric diagonal scaling of a symmetric pattern checks the
    # transposed solve through the permutation too.
    D = sp.diags(np.linspace(1.0, 2.0, m * m))
    rng = np.random.default_rng(0)
    B = rng.standard_normal((m * m, 3))
    out = direct(A, B[:, 0], symmetric=True)
    # (ill-conditioned near an eigenvalue: the answers compared to 1e-6)
    assert out.info["factorisation"] == "SuperLU (nested dissection)"
    np.testing.assert_allclose(out.x, sla.spsolve(A.tocsc(), B[:, 0]), rtol=1e-6, atol=1e-9)
    with Solver(A, method="direct", rtol=1e-10, device="cpu") as solver:
        res = solver.solve(B)
    assert res.converged and res.info["path"] == "direct"
    np.testing.assert_allclose(res.x, sla.splu(A.tocsc()).solve(B), rtol=1e-6, atol=1e-9)
    # The engine trusts its symmetric flag: a non-symmetric matrix of symmetric
    # pattern is ordered alike, and its transposed solve goes through the
    # same permutation.
    S = (D @ A).tocsr()
    prepared = DirectEngine().prepare(S, Options("direct", rtol=1e-10, symmetric=True), None)
    assert prepared.how == "SuperLU (nested dissection)"
    for got, M in ((prepared.solve(B[:, 1]), S), (prepared.solve_transpose(B[:, 1]), S.T)):
        assert got.code == 0
        np.testing.assert_allclose(got.x, sla.spsolve(M.tocsc(), B[:, 1]), rtol=1e-6, atol=1e-9)
    prepared.close()


def test_direct_dense():
    A = poisson2d(6).toarray()
    b = np.arange(36.0)
    res = solve(A, b, method="direct")
    assert res.converged
    np.testing.assert_allclose(host(res.x), np.linalg.solve(A, b), rtol=1e-12)  # x on the chosen device


# The status says it; no warning from SciPy's LU or cuSOLVER's QR besides.
@pytest.mark.filterwarnings("error::scipy.linalg.LinAlgWarning")
@pytest.mark.filterwarnings("error:A is not positive definite or near singular:UserWarning")
@pytest.mark.parametrize("kind", ["exact", "numerical", "dense"])
def test_singular_matrix_gives_breakdown_with_fix(backend, kind):
    if kind == "exact":  # a zero row
        A = poisson2d(5).tolil()
        A[3, :] = 0
        A = A.tocsr()
        A.eliminate_zeros()
    elif kind == "numerical":  # pure Neumann Laplacian: rows sum to zero
        A = neumann2d(5)
    else:
        A = np.ones((4, 4))
    b = np.arange(1.0, A.shape[0] + 1)
    Ad, bd = on(backend, A, b)
    res = solve(Ad, bd, method="direct")
    assert res.status.name == "BREAKDOWN"
    assert res.x is None
    assert "singular" in res.message and "boundary" in res.message
    with pytest.raises(Exception, match="singular"):
        res.raise_for_status()


def test_direct_engine_with_a_null_space_solves_and_refactors_on_the_kept_analysis():
    """A 1D pure Neumann matrix meets an exactly zero pivot; pinned, it is SPD: Cholesky."""
    A = laplacian1d(40, neumann=True)
    with pytest.raises(Singular):
        DirectEngine().prepare(A, Options("direct", symmetric=True), None)
    N = np.ones((40, 1)) / np.sqrt(40.0)
    engine = DirectEngine().prepare(A, Options("direct", rtol=1e-12, symmetric=True), None,
                                    nullspace=N)
    # New values: a variable coefficient, the same pattern and null space (rows sum to zero).
    D = sp.diags([-np.ones(39), np.ones(39)], [0, 1], shape=(39, 40))
    A2 = (D.T @ sp.diags(np.linspace(1.0, 3.0, 39)) @ D).tocsr()
    A2.sort_indices()
    assert np.array_equal(A2.indptr, A.indptr) and np.array_equal(A2.indices, A.indices)
    rng = np.random.default_rng(6)
    for M in (A, A2):
        if M is A2:
            engine.update(A2.data)
        B = M @ rng.standard_normal((40, 2))
        outs = engine.solve(B)
        ref = np.linalg.pinv(M.toarray(), rcond=1e-10) @ B  # the zero singular value dropped
        for j, out in enumerate(outs):
            assert out.code == 0 and out.info["factorisation"] == CHOLESKY
            np.testing.assert_allclose(out.x, ref[:, j], rtol=1e-10, atol=1e-12)
    engine.close()


class _FakeNvmath:
    """A stand-in for nvmath.sparse.advanced (not installed here): SuperLU behind its API.

    Counts plans, factorisations and frees, so the cache's decisions can be
    checked on the CPU; the real library runs in the ``gpu`` tests below.
    """

    def __init__(self):
        import types

        self.plans = self.factorizations = self.frees = 0
        self.broken = False  # True: factorisations raise, as cuDSS's do on a failure
        self.options = []
        self.DirectSolverMatrixType = types.SimpleNamespace(GENERAL="general", SYMMETRIC="symmetric")
        self.DirectSolverOptions = lambda **kw: types.SimpleNamespace(**kw)
        fake = self

        class DirectSolver:
            def __init__(self, a, b, *, options):
                fake.options.append(options)
                self.a, self.b = a, b  # like cuDSS: pointers into the caller's buffers

            def plan(self):
                fake.plans += 1

            def factorize(self):
                if fake.broken:
                    raise RuntimeError("cuDSS factorisation failed")
                fake.factorizations += 1
                self.lu = sla.splu(self.a.tocsc())

            def reset_operands(self, *, b):
                self.b = b

            def solve(self):
                return self.lu.solve(self.b)

            def free(self):
                fake.frees += 1

        self.DirectSolver = DirectSolver


@pytest.fixture
def fake_cudss():
    """A stand-in nvmath and the cuDSS state over it: the cuDSS path runs on the host."""
    from managed_solve.solvers._cudss import Cudss

    fake = _FakeNvmath()
    return fake, Cudss(fake, make_handle=lambda device: 1234, threading_lib=lambda: None)


def test_gpu_sparse_path_prefers_cudss_when_nvmath_is_installed(fake_cudss):
    from managed_solve.solvers.direct import gpu_sparse_solve

    fake, cudss = fake_cudss
    A = tridiagonal(30, -1.0, 2.5, -1.0)
    b = np.ones(30)
    x, how, extra = gpu_sparse_solve(A, b, None, cudss=cudss)
    assert how == "cuDSS (nvmath-python)" and extra == {"cudss_reused": "none"}
    np.testing.assert_allclose(A @ x, b, rtol=1e-12)
    opts = fake.options[0]
    assert opts.sparse_system_type == "general" and opts.handle == 1234
    assert opts.logger.name == "managed_solve.cudss"  # nvmath's phase logs under ours
    assert not hasattr(opts, "multithreading_lib")  # no threading layer found
    gpu_sparse_solve(A, b, True, cudss=cudss)
    assert fake.options[1].sparse_system_type == "symmetric"  # cuDSS is told the matrix type


def test_cudss_solves_a_block_with_one_analysis_kept_apart_from_vectors(fake_cudss):
    from managed_solve.solvers.direct import gpu_sparse_solve

    fake, cudss = fake_cudss
    A = tridiagonal(30, -1.0, 2.5, -1.0)
    B = np.random.default_rng(4).standard_normal((30, 4))
    X, how, extra = gpu_sparse_solve(A, B, True, cudss=cudss)
    np.testing.assert_allclose(X, sla.splu(A.tocsc()).solve(B), rtol=1e-12, atol=1e-12)
    assert extra == {"cudss_reused": "none"} and fake.plans == 1
    X2, _how, extra = gpu_sparse_solve(A, 2.0 * B, True, cudss=cudss)
    assert extra == {"cudss_reused": "factors"} and fake.plans == 1  # the block's factors again
    np.testing.assert_allclose(X2, 2.0 * X, rtol=1e-12)
    # A column of a block (strided) solves as a vector, on an analysis of its own.
    x, _how, extra = gpu_sparse_solve(A, B[:, 1], True, cudss=cudss)
    assert extra == {"cudss_reused": "none"} and fake.plans == 2
    np.testing.assert_allclose(x, X[:, 1], rtol=1e-12)
    assert gpu_sparse_solve(A, B[:, 2], True, cudss=cudss)[2] == {"cudss_reused": "factors"}


def test_cudss_keeps_the_analysis_of_recent_matrices(fake_cudss):
    fake, cudss = fake_cudss
    rng = np.random.default_rng(3)
    A = poisson2d(8)
    b1, b2 = rng.standard_normal(64), rng.standard_normal(64)

    def check(M, b, reused, plans, factorizations):
        x, how = cudss.solve(M, b, True)
        np.testing.assert_allclose(M @ x, b, rtol=1e-10, atol=1e-10)
        assert (how, fake.plans, fake.factorizations) == (reused, plans, factorizations)

    check(A, b1, "none", 1, 1)
    check(A, b2, "factors", 1, 1)  # the same matrix: solve only
    A2 = (A * 3.0).tocsr()
    check(A2, b1, "plan", 1, 2)  # same pattern, new values: factorise again
    A2.data[:] *= 2.0  # the caller changes its matrix in place: the kept copy does not see it
    check(A2, b2, "plan", 1, 3)
    perm = rng.permutation(64)
    A3 = A[perm][:, perm].tocsr()  # same n and nnz, another pattern
    assert A3.nnz == A.nnz and not np.array_equal(A3.indices, A.indices)
    check(A3, b1, "none", 2, 4)
    assert fake.frees == 1  # the old analysis, freed
    assert cudss.release("cuda:0") == 0  # another GPU: nothing kept there
    assert cudss.release() == 1 and fake.frees == 2
    with pytest.raises(ValueError, match=r"device='cpu'\): cuDSS keeps factors on CUDA GPUs only"):
        cudss.release("cpu")
    with pytest.raises(ValueError, match="not a device name"):
        cudss.release("gpu zero")
    check(A, b1, "none", fake.plans + 1, fake.factorizations + 1)


def test_cudss_cache_keeps_the_most_recent(fake_cudss):
    fake, cudss = fake_cudss
    assert cudss.cache_size == 2
    mats = [poisson2d(m) for m in (4, 5, 6)]
    for M in mats:
        cudss.solve(M, np.ones(M.shape[0]), True)
    assert fake.frees == 1  # the first, least recent
    assert cudss.solve(mats[2], np.ones(36), True)[1] == "factors"
    assert cudss.solve(mats[0], np.ones(16), True)[1] == "none"
    cudss.cache_size = 0
    before = fake.frees
    assert cudss.solve(mats[0], np.ones(16), True)[1] == "factors"  # still kept from before
    assert fake.frees == before + 1 and cudss.release() == 1  # not kept again


def test_cudss_threading_layer_is_looked_for_once_and_reset_makes_new_handles(fake_cudss):
    from managed_solve.solvers._cudss import Cudss

    fake, _ = fake_cudss
    looked, handles = [], iter(range(100, 200))
    cudss = Cudss(fake, make_handle=lambda device: next(handles),
                  threading_lib=lambda: looked.append(1) or "/opt/libcudss_mtlayer_gomp.so.0")
    cudss.solve(poisson2d(4), np.ones(16), True)
    cudss.solve(poisson2d(5), np.ones(25), True)
    assert looked == [1] and [o.multithreading_lib for o in fake.options] == ["/opt/libcudss_mtlayer_gomp.so.0"] * 2
    assert [o.handle for o in fake.options] == [100, 100]  # one handle a GPU
    assert cudss.reset() == 2 and fake.frees == 2
    cudss.threading = False
    cudss.solve(poisson2d(4), np.ones(16), True)
    assert fake.options[-1].handle == 101 and not hasattr(fake.options[-1], "multithreading_lib")


def needs_cudss():
    """Skip unless nvmath-python and the cuDSS library it binds both load.

    nvmath-python installs without cuDSS (its own wheel); the package then
    solves with cuSOLVER, which the other GPU tests cover.
    """
    pytest.importorskip("nvmath.sparse.advanced")
    try:
        from nvmath.bindings import cudss

        cudss.destroy(cudss.create())
    except Exception as exc:  # the library missing, or no usable GPU
        pytest.skip(f"cuDSS does not load here: {exc}")


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cudss_solves_like_scipy(dtype, symmetric):
    """The real cuDSS path (runs where nvmath-python and cuDSS are installed)."""
    needs_cudss()
    # 14,400 unknowns: fill-in matters
    A = poisson2d(120, dtype) if symmetric else poisson2d_plus_diagonal(120, 0.7, offset=3, dtype=dtype)
    x_true = np.random.default_rng(5).standard_normal(A.shape[0]).astype(dtype)
    b = (A @ x_true).astype(dtype)
    ref = sla.spsolve(A.astype(np.float64).tocsc(), b.astype(np.float64))
    Ad, bd = on("cuda", A, b)
    rtol = 1e-8 if dtype == np.float64 else 1e-5  # what float32 can resolve
    res = solve(Ad, bd, method="direct", rtol=rtol)
    assert res.converged, res.message
    assert res.info["factorisation"] == "cuDSS (nvmath-python)"
    x = host(res.x)
    assert x.dtype == dtype
    tol = 1e-9 if dtype == np.float64 else 2e-3
    np.testing.assert_allclose(x, ref, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_cudss_solver_takes_a_block_and_reuses_its_factors():
    """A prepared direct Solver on a GPU: an (n, k) block in one cuDSS solve, like SciPy's splu."""
    needs_cudss()
    from managed_solve import Solver
    from managed_solve.solvers import release_factorisations

    release_factorisations()
    A = poisson2d_plus_diagonal(50, 0.7, offset=3)
    B = np.random.default_rng(6).standard_normal((A.shape[0], 6))
    ref = sla.splu(A.tocsc()).solve(B)
    Ad, Bd = on("cuda", A, B)
    with Solver(Ad, method="direct") as solver:
        first, again = solver.solve(Bd), solver.solve(Bd)
        col = solver.solve(Bd[:, 3])
    for out in (first, again):
        assert out.converged
        np.testing.assert_allclose(host(out.x), ref, rtol=1e-9, atol=1e-9)
    assert col.converged and col.info["factorisation"] == "cuDSS (nvmath-python)"
    np.testing.assert_allclose(host(col.x), ref[:, 3], rtol=1e-9, atol=1e-9)


@pytest.mark.gpu
def test_cudss_singular_matrix_is_breakdown():
    needs_cudss()
    A = neumann2d(8)  # pure Neumann: singular
    Ad, bd = on("cuda", A, np.arange(1.0, 65.0))
    res = solve(Ad, bd, method="direct")
    assert res.status.name == "BREAKDOWN" and res.x is None
    assert "singular" in res.message


@pytest.mark.gpu
def test_cudss_reuses_analysis_and_factors():
    """The same matrix solves only; new values on the same pattern factorise; threads share safely."""
    needs_cudss()
    import threading

    from managed_solve.solvers import release_factorisations

    release_factorisations()
    A = poisson2d(60)
    x_true = np.random.default_rng(8).standard_normal(A.shape[0])
    Ad, bd = on("cuda", A, A @ x_true)
    first, again = solve(Ad, bd, method="direct"), solve(Ad, bd, method="direct")
    assert (first.info["cudss_reused"], again.info["cudss_reused"]) == ("none", "factors")
    np.testing.assert_allclose(host(again.x), x_true, rtol=1e-9, atol=1e-9)
    A2 = (A * 2.0 + sp.identity(A.shape[0])).tocsr()
    A2d, b2d = on("cuda", A2, A2 @ x_true)
    res = solve(A2d, b2d, method="direct")
    assert res.info["cudss_reused"] == "plan" and res.converged
    np.testing.assert_allclose(host(res.x), x_true, rtol=1e-9, atol=1e-9)
    out = {}

    def other(k):
        out[k] = host(solve(Ad, bd, method="direct").x)

    threads = [threading.Thread(target=other, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(3):
        np.testing.assert_allclose(out[k], x_true, rtol=1e-9, atol=1e-9)
    assert release_factorisations() >= 1


def test_cudss_held_factors_are_not_shared_and_go_back_to_the_cache(fake_cudss):
    """Two holders of one pattern keep their own factors; released, the cache keeps one of them."""
    fake, cudss = fake_cudss
    A = poisson2d(8)
    B = (A * 2.0 + sp.identity(64)).tocsr()  # the same pattern, other values
    b = np.random.default_rng(4).standard_normal(64)
    ha = cudss.hold(A, b, True)
    hb = cudss.hold(B, b, True)
    assert (ha.reused, hb.reused) == ("none", "none") and fake.plans == 2
    for _ in range(3):  # in turn, as a heat and a Poisson solve of one mesh
        np.testing.assert_allclose(A @ ha.solve(b), b, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(B @ hb.solve(b), b, rtol=1e-10, atol=1e-10)
    assert (fake.plans, fake.factorizations) == (2, 2)  # no refactorisation in turn
    ha.release()
    hb.release()  # the same key: the one released first is freed, not lost
    assert fake.frees == 1
    with pytest.raises(RuntimeError, match="released"):
        ha.solve(b)
    assert cudss.solve(B, b, True)[1] == "factors"  # the cache kept the last
    again = cudss.hold(A, b, True)
    assert again.reused == "plan"  # its pattern: refactorised, not planned
    np.testing.assert_allclose(A @ again.solve(b), b, rtol=1e-10, atol=1e-10)
    again.release()
    assert cudss.release() == 1 and fake.frees == 2
    never = cudss.hold(A, b, True)  # held, discarded unsolved (a failed solve): freed, not kept
    never.discard()
    assert fake.frees == 3 and cudss.release() == 0


@pytest.mark.gpu
def test_cudss_solvers_of_one_pattern_keep_their_own_factors():
    """Two open direct Solvers (a heat and a Poisson matrix of one mesh) never refactorise in turn."""
    needs_cudss()
    from managed_solve import Solver, _backend
    from managed_solve.solvers import release_factorisations

    cp = _backend.cupy()
    release_factorisations()
    A = poisson2d(40)
    B = (A * 2.0 + sp.identity(A.shape[0])).tocsr()  # the same pattern, other values
    x_true = np.random.default_rng(6).standard_normal(A.shape[0])
    Ad, bd = on("cuda", A, A @ x_true)
    Bd, cd = on("cuda", B, B @ x_true)
    reused = []
    with Solver(Ad, method="direct", device="cuda:0") as sa, \
            Solver(Bd, method="direct", device="cuda:0") as sb:
        for _ in range(2):
            ra, rb = sa.solve(bd), sb.solve(cd)
            assert ra.converged and rb.converged
            np.testing.assert_allclose(host(ra.x), x_true, rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose(host(rb.x), x_true, rtol=1e-9, atol=1e-9)
            reused += [ra.info["cudss_reused"], rb.info["cudss_reused"]]
            assert ra.info["factorisation"] == "cuDSS (nvmath-python)"
        block = sa.solve(cp.stack([bd, 2.0 * bd], axis=1))  # columns of a row-major block
        assert block.converged
        np.testing.assert_allclose(host(block.x), np.stack([x_true, 2 * x_true], axis=1),
                                   rtol=1e-9, atol=1e-9)
        one = sa.solve(bd)
        assert one.info["cudss_reused"] == "factors"
    assert reused == ["none", "none", "factors", "factors"]
    # Given back on close: one kept per pattern and right-hand side's shape
    # (the vectors' and the block of two's).
    assert release_factorisations() == 2


def test_cudss_failure_frees_the_entry_and_keeps_nothing(fake_cudss):
    """A factorisation that raises on new values frees the kept analysis; the next solve starts over."""
    fake, cudss = fake_cudss
    A = poisson2d(6)
    cudss.solve(A, np.ones(36), True)
    bad = (A * 2.0).tocsr()
    fake.broken = True
    with pytest.raises(RuntimeError, match="factorisation failed"):
        cudss.solve(bad, np.ones(36), True)
    assert fake.frees == 1 and cudss.release() == 0  # freed, not kept
    fake.broken = False
    x, how = cudss.solve(bad, np.ones(36), True)
    assert how == "none"
    np.testing.assert_allclose(bad @ x, np.ones(36), rtol=1e-10)


def test_superlu_factors_are_made_and_freed_on_a_long_lived_lane(monkeypatch):
    """SciPy's SuperLU frees a factor only on the thread that made it: a lane makes and frees it."""
    import importlib
    import threading

    from managed_solve.solvers.direct import DirectEngine
    from managed_solve.solvers.engine import Options

    direct_module = importlib.import_module("managed_solve.solvers.direct")  # not the function
    made_on, freed_on, freed = [], [], threading.Event()

    class Watched:
        """The real factors, noting the thread that drops them."""

        def __init__(self, lu):
            self.lu = lu
            self.nnz = lu.nnz

        def solve(self, b, trans="N"):
            return self.lu.solve(b, trans=trans)

        def __del__(self):
            freed_on.append(threading.current_thread().name)
            freed.set()

    real = direct_module.superlu

    def spy(A, symmetric):
        made_on.append(threading.current_thread().name)
        lu, how = real(A, symmetric)
        return Watched(lu), how

    monkeypatch.setattr(direct_module, "superlu", spy)
    A = poisson2d_plus_diagonal(6, 0.7, offset=3)  # not symmetric: SuperLU, not Cholesky
    engines = []
    worker = threading.Thread(target=lambda: engines.append(
        DirectEngine().prepare(A, Options("direct", symmetric=True), None)))
    worker.start()
    worker.join()  # the thread that asked for the factors has ended
    (engine,) = engines
    assert len(made_on) == 1 and made_on[0].startswith("managed_solve-superlu")
    x = engine.solve_transpose(np.ones(36)).x  # solves run on any thread
    np.testing.assert_allclose(A.T @ x, np.ones(36), atol=1e-12)
    assert not freed.is_set()
    engine.close()  # from this thread: the factor's last reference goes to its lane
    assert freed.wait(60)  # the lane runs the release soon after
    assert freed_on == made_on


def test_an_ill_conditioned_float32_lu_is_maxiter_with_its_answer_not_singular():
    """A regular float32 matrix of condition 3.7e4 whose LU residual refinement cannot bring to
    rtol 1e-6: the answer is kept (its error 1e-7 of the float64 one) and the status says the
    matrix is too ill-conditioned for the dtype, not that it is singular. A singular one (pure
    Neumann, b outside its range) is still BREAKDOWN, A singular."""
    n = 300
    d = np.full(n, 2.0)
    d[0] = d[-1] = 3.0
    A = sp.diags([-np.ones(n - 1), d, -np.ones(n - 1) * (1 + 1e-3)], [-1, 0, 1],
                 format="csr").astype(np.float32)  # non-symmetric: SuperLU
    b = np.ones(n, np.float32)
    res = solve(A, b, rtol=1e-6, method="direct", device="cpu")
    assert res.status is Status.MAXITER, res.message
    assert "too ill-conditioned for rtol in float32" in res.message
    ref = sla.spsolve(A.astype(np.float64).tocsc(), b.astype(np.float64))
    assert np.linalg.norm(np.asarray(res.x, np.float64) - ref) <= 1e-5 * np.linalg.norm(ref)
    assert np.linalg.norm(b - A @ res.x) > 1e-6 * np.linalg.norm(b)  # the status is honest
    singular = solve(laplacian1d(n, np.float32, neumann=True), b, method="direct", device="cpu")
    assert singular.status is Status.BREAKDOWN and "singular" in singular.message
