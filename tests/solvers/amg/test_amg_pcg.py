"""CG bound to the fused V-cycle (pcg.py, pcg.cu) against the generic CG (cg.py).

On the CPU the loop's sequence runs on its NumPy twins over a host fused
cycle, pinned against the generic CG preconditioned by a second fused cycle
of the same hierarchy; on a GPU the CUDA loop (one graph an iteration),
chosen by the Krylov engine, against the generic CG on the same
preconditioner.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg  # noqa: F401 - sp.linalg

from managed_solve.solvers.amg import amg
from managed_solve.solvers.amg import twins as tw
from managed_solve.solvers.amg.fused import FusedCycle
from managed_solve.solvers.amg.pcg import BoundCG
from managed_solve.solvers.amg.preconditioner import csr_arrays
from managed_solve.solvers.cg import cg
from managed_solve.solvers.engine import BREAKDOWN, CONVERGED, MAXITER
from tests._problems import host, poisson2d, poisson3d


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def triple(M):
    return (M.indptr.astype(np.int32), M.indices.astype(np.int32), M.data)


def host_cycle(M, dtype):
    """A fused cycle on the twins over the host preconditioner's hierarchy."""
    c = M._cycle  # noqa: SLF001 - the host cycle's smoothers and coarse inverse
    return FusedCycle(np, tw.TwinOps, csr_arrays(M.levels, dtype, np), c.smoothers,
                      c.coarse_inv, dtype)


def pair(A, dtype=np.float64, **options):
    """(the bound loop on the twins, the generic CG's preconditioner): the same hierarchy."""
    M = amg(A, setup="native", max_coarse=40, **options, dtype=dtype)
    loop = BoundCG(np, tw.LoopTwinOps, triple(A), np.float64, host_cycle(M, dtype))
    other = host_cycle(M, dtype)
    return loop, (lambda r: other.apply(r, np.float64))


PROBLEMS = {"poisson2d": lambda: poisson2d(48), "poisson3d": lambda: poisson3d(14)}


# ---------------------------------------------------------------- CPU: the twins' loop


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_twin_loop_equals_the_generic_cg(name, dtype):
    A = PROBLEMS[name]()
    b = np.random.default_rng(0).standard_normal(A.shape[0])
    loop, M = pair(A, dtype)
    ref = cg(A, b, rtol=1e-8, M=M)
    out = loop.solve(b, rtol=1e-8)
    assert out.code == ref.code == CONVERGED
    assert out.iterations == ref.iterations, (out.iterations, ref.iterations)
    assert rel(out.x, ref.x) < 1e-10
    assert np.linalg.norm(b - A @ out.x) <= 1e-8 * np.linalg.norm(b)
    # a second solve on the same buffers: the same answer
    again = loop.solve(b, rtol=1e-8)
    assert again.iterations == out.iterations and rel(again.x, out.x) < 1e-13
    assert again.x is not out.x


def test_twin_loop_with_x0_and_an_iteration_limit():
    A = poisson2d(40)
    rng = np.random.default_rng(1)
    b, x0 = rng.standard_normal(A.shape[0]), rng.standard_normal(A.shape[0])
    loop, M = pair(A)
    for limit in (1, 3):
        ref = cg(A, b, x0=x0, rtol=1e-12, M=M, maxiter=limit)
        out = loop.solve(b, x0, rtol=1e-12, maxiter=limit)
        assert out.code == ref.code == MAXITER and out.iterations == ref.iterations == limit
        assert rel(out.x, ref.x) < 1e-12
        assert out.residual_norm == pytest.approx(ref.residual_norm, rel=1e-10)
    ref = cg(A, b, x0=x0, rtol=1e-9, M=M)
    out = loop.solve(b, x0, rtol=1e-9)
    assert out.code == CONVERGED and out.iterations == ref.iterations
    assert rel(out.x, ref.x) < 1e-10
    # x0 solving the system already: no iteration
    done = loop.solve(A @ x0, x0, rtol=1e-8)
    assert done.code == CONVERGED and done.iterations == 0 and rel(done.x, x0) == 0.0
    zero = loop.solve(np.zeros(A.shape[0]))
    assert zero.code == CONVERGED and zero.iterations == 0 and not zero.x.any()


def test_twin_loop_reports_non_positive_curvature():
    A = poisson2d(30)
    b = np.random.default_rng(2).standard_normal(A.shape[0])
    M = amg(A, setup="native", max_coarse=40)
    neg = (-A).tocsr()  # negative definite: p.A p < 0 from the first iteration
    loop = BoundCG(np, tw.LoopTwinOps, triple(neg), np.float64, host_cycle(M, np.float64))
    other = host_cycle(M, np.float64)
    ref = cg(neg, b, rtol=1e-8, M=lambda r: other.apply(r, np.float64))
    out = loop.solve(b, rtol=1e-8)
    assert out.code == ref.code == BREAKDOWN and out.iterations == ref.iterations == 1
    assert "positive definite" in out.message
    # an indefinite shift: the breakdown comes later, at the generic CG's iteration
    ind = (A - 0.05 * sp.eye(A.shape[0])).tocsr()
    loop = BoundCG(np, tw.LoopTwinOps, triple(ind), np.float64, host_cycle(M, np.float64))
    ref = cg(ind, b, rtol=1e-10, M=lambda r: other.apply(r, np.float64), maxiter=300)
    out = loop.solve(b, rtol=1e-10, maxiter=300)
    assert out.code == ref.code and out.iterations == ref.iterations, (out, ref.code)


@pytest.mark.parametrize("x0", [False, True])
def test_twin_loop_hands_over_the_true_residual_of_its_x(x0):
    """The outcome carries ||b - A x|| of the very x it returns (the verify rule reads it)."""
    A = poisson2d(40)
    rng = np.random.default_rng(11)
    b = rng.standard_normal(A.shape[0])
    loop, _ = pair(A)
    for maxiter in (3, 200):  # stopped early (a large residual) and converged
        out = loop.solve(b, rng.standard_normal(A.shape[0]) if x0 else None, rtol=1e-9,
                         maxiter=maxiter)
        assert out.code == (MAXITER if maxiter == 3 else CONVERGED)
        want = np.linalg.norm(b - A @ out.x)
        assert out.checked_residual(out.x) == pytest.approx(want, rel=1e-10)
        assert out.checked_residual(out.x.copy()) is None  # another array: not vouched for
        assert out.host_syncs >= out.iterations + 2


def test_the_verify_rule_reads_the_engines_true_residual():
    """refine takes the engine's figure for the x it returned (one product fewer a solve)."""
    from managed_solve.solvers.engine import Outcome
    from managed_solve.solvers.verify import no_worse_than_the_start, refine

    A = poisson2d(20)
    b = np.ones(A.shape[0])
    x = np.zeros(A.shape[0])  # residual ||b||: far from converged

    class Refuses:
        maxiter = 10

        def solve_limited(self, *args, **kw):
            raise AssertionError("a refinement ran although the engine's residual met tol")

    # the engine vouches for a residual within tol: no restart, whatever b - A x is
    out = Outcome(x, CONVERGED, 5, 1e-12, true_residual=(x, 1e-12))
    assert refine(A, b, Refuses(), out, 1e-8, False) is out
    # vouching for another array counts for nothing: the rule forms b - A x itself
    other = Outcome(x, CONVERGED, 5, 1e-12, true_residual=(x.copy(), 1e-12))
    with pytest.raises(AssertionError, match="refinement ran"):
        refine(A, b, Refuses(), other, 1e-8, False)
    # a failed solve is judged on the engine's figure too (here one worse than the start)
    exact = np.asarray(sp.linalg.spsolve(A.tocsc(), b))
    failed = Outcome(exact, MAXITER, 5, 1.0, true_residual=(exact, 1e9))
    got = no_worse_than_the_start(A, b, None, failed, 1e-8)
    assert "initial guess" in got.info["returned"] and not got.x.any()


def test_twin_kernels_reduce_into_the_scalars():
    rng = np.random.default_rng(3)
    n = 50
    A = poisson2d(10)[:n, :n].tocsr()
    p, r, z, x = (rng.standard_normal(n) for _ in range(4))
    s = np.zeros(tw.NSCALARS)
    q = np.empty(n)
    tw.pcg_spmv_dot(n, *triple(A), p, q, s)
    assert np.allclose(q, A @ p) and s[tw.PQ] == pytest.approx(p @ (A @ p))
    s[tw.RZ] = 2.0
    x0, r0 = x.copy(), r.copy()
    tw.pcg_update(n, x, p, r, r, q, s)
    alpha = 2.0 / (p @ (A @ p))
    assert np.allclose(x, x0 + alpha * p) and np.allclose(r, r0 - alpha * (A @ p))
    assert s[tw.RR] == pytest.approx(r @ r)
    tw.pcg_dot(n, r, z, s)
    s[tw.RNORM], s[tw.TOL] = 1.0, 0.5
    rzn = s[tw.RZN]
    tw.pcg_scalars(s)
    assert s[tw.BETA] == pytest.approx(rzn / 2.0) and s[tw.RZ] == rzn and s[tw.BAD] == 0.0
    assert s[tw.RNORM] == pytest.approx(np.linalg.norm(r))
    assert s[tw.PQ] == s[tw.RR] == s[tw.RZN] == 0.0
    p0 = p.copy()
    tw.pcg_pupdate(n, z, p, s)
    assert np.allclose(p, z + s[tw.BETA] * p0)


# ---------------------------------------------------------------- GPU: the CUDA loop


@pytest.fixture
def cp():
    import cupy

    return cupy


def engine_solver(Ad, M, **options):
    from managed_solve.solvers.engine import Options
    from managed_solve.solvers.krylov import KrylovEngine

    return KrylovEngine().prepare(Ad, Options(method="cg", M=M, **options), None)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["poisson2d-255", "poisson3d-40"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpu_loop_equals_the_generic_cg(cp, name, dtype):
    import cupyx.scipy.sparse as csp

    A = poisson2d(255) if name.startswith("poisson2d") else poisson3d(40)
    b = np.random.default_rng(4).standard_normal(A.shape[0])
    Ad, bd = csp.csr_matrix(A), cp.asarray(b)
    M = amg(Ad, setup="native", dtype=dtype)
    prep = engine_solver(Ad, M)
    assert prep.bound
    out = prep.solve(bd)
    assert out.info["path"] == "amg-cg" and out.info["graph"]
    ref = cg(Ad, bd, rtol=1e-8, M=M, check_every=1)
    assert out.code == ref.code == CONVERGED
    assert abs(out.iterations - ref.iterations) <= 1, (out.iterations, ref.iterations)
    assert np.linalg.norm(b - A @ host(out.x)) <= 1e-8 * np.linalg.norm(b)
    # the same number of iterations: the same iterate up to rounding
    k = min(out.iterations, ref.iterations) - 1
    lim = engine_solver(Ad, M, maxiter=k).solve(bd)
    ref_k = cg(Ad, bd, rtol=1e-8, M=M, check_every=1, maxiter=k)
    assert lim.code == ref_k.code == MAXITER and lim.iterations == k
    assert rel(host(lim.x), host(ref_k.x)) < 1e-10
    # x0 given
    x0 = cp.asarray(np.random.default_rng(5).standard_normal(A.shape[0]))
    o0, r0 = prep.solve(bd, x0), cg(Ad, bd, x0=x0, rtol=1e-8, M=M, check_every=1)
    assert o0.code == CONVERGED and abs(o0.iterations - r0.iterations) <= 1
    assert np.linalg.norm(b - A @ host(o0.x)) <= 1e-8 * np.linalg.norm(b)


@pytest.mark.gpu
def test_gpu_loop_breakdown_maxiter_and_update(cp):
    import cupyx.scipy.sparse as csp

    import managed_solve as ms

    A = poisson2d(127)
    b = np.random.default_rng(6).standard_normal(A.shape[0])
    Ad, bd = csp.csr_matrix(A), cp.asarray(b)
    M = amg(Ad, setup="native")
    neg = engine_solver(csp.csr_matrix(-A), M)
    assert neg.bound
    out = neg.solve(bd)
    assert out.code == BREAKDOWN and out.iterations == 1 and "positive definite" in out.message
    lim = engine_solver(Ad, M, maxiter=2).solve(bd)
    assert lim.code == MAXITER and lim.iterations == 2
    # through the public entry points, and after a numeric update
    res = ms.solve(Ad, bd, method="cg", M="amg", rtol=1e-8)
    assert res.converged and res.iterations <= 20
    solver = ms.Solver(Ad, method="cg", M="amg")
    first = solver.solve(bd)
    A2 = csp.csr_matrix((Ad.data * 2.0, Ad.indices, Ad.indptr), shape=Ad.shape)
    solver.update(A2)
    second = solver.solve(bd)
    assert first.converged and second.converged
    assert rel(host(second.x), host(first.x) / 2.0) < 1e-6
    # a callback, or GMRES, keeps the generic loop
    assert not engine_solver(Ad, M, callback=lambda xk: None).bound


@pytest.mark.gpu
def test_gpu_solver_reports_the_loops_true_residual(cp, monkeypatch):
    """A Solver's residual is the loop's from-scratch figure: no second b - A x is formed."""
    import cupyx.scipy.sparse as csp

    import managed_solve as ms
    from managed_solve import solver as solver_module
    from managed_solve.solvers import verify

    A = poisson2d(200)
    b = np.random.default_rng(12).standard_normal(A.shape[0])
    Ad, bd = csp.csr_matrix(A), cp.asarray(b)
    calls = []

    def counted(real):
        return lambda *a: calls.append(1) or real(*a)

    for dtype in ("float64", "float32"):
        solver = ms.Solver(Ad, method="cg", M=amg(Ad, setup="native", dtype=dtype), rtol=1e-10)
        solver.solve(bd)  # set-up and graphs
        calls.clear()
        for module in (solver_module, verify):
            monkeypatch.setattr(module, "true_residual_norm",
                                counted(module.true_residual_norm))
        res = solver.solve(bd)
        monkeypatch.undo()
        assert res.converged and res.info["path"] == "amg-cg"
        want = np.linalg.norm(b - A @ host(res.x))
        assert res.residual_norm == pytest.approx(want, rel=1e-8)
        assert res.residual_norm <= 1e-10 * np.linalg.norm(b)
        assert not calls
        solver.close()


@pytest.mark.gpu
def test_gpu_loop_kernels_match_their_twins_on_wide_rows(cp):
    """The loop's product (its lanes take four entries a round) on rows of 1 to 240 entries."""
    from managed_solve.solvers.amg.kernels import LoopCudaOps, group_size

    rng = np.random.default_rng(13)
    mats = {"tridiagonal": sp.diags([1.0, -2.0, 1.0], [-1, 0, 1], shape=(500, 500)),
            "poisson": poisson2d(30),
            "mid": sp.random(300, 300, density=0.1, random_state=8),
            "very-wide": sp.random(300, 300, density=0.8, random_state=9)}
    widths = set()
    for name, A in mats.items():
        A = sp.csr_matrix(A)
        A.sort_indices()
        n = A.shape[0]
        widths.add(group_size(n, A.nnz, 8))
        ops = LoopCudaOps(np.float64, np.float64, cp.cuda.Device().id)
        p = rng.standard_normal(n)
        s_h, q_h = np.zeros(tw.NSCALARS), np.empty(n)
        tw.pcg_spmv_dot(n, *triple(A), p, q_h, s_h)
        s_d, q_d = cp.zeros(tw.NSCALARS), cp.full(n, cp.nan)
        ops.spmv_dot(n, *(cp.asarray(a) for a in triple(A)), cp.asarray(p), q_d, s_d)
        assert rel(host(q_d), q_h) < 1e-13, name
        assert float(s_d[tw.PQ]) == pytest.approx(s_h[tw.PQ], rel=1e-12), name
    assert widths >= {1, 2, 4, 32}
