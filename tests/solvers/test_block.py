"""The block Krylov loop (CG, BiCGStab over an (n, k) block) against SciPy and the single-vector engines."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

import managed_solve as ms
from managed_solve import Solver, Status
from managed_solve.solvers.bicgstab import bicgstab, bicgstab_fused
from managed_solve.solvers.block import block_bicgstab, block_cg, block_solve
from managed_solve.solvers.block_ops import CupyBlockOps, NumpyBlockOps
from managed_solve.solvers.cg import cg, cg_fused
from managed_solve.solvers.engine import BREAKDOWN, CONVERGED, MAXITER
from managed_solve.solvers.preconditioners import neumann
from tests._problems import (
    BACKENDS,
    array_modules,
    convection_diffusion,
    host,
    neumann2d,
    on,
    poisson2d,
)

# Each method with the gallery matrix it suits. On a GPU the loop reads which
# columns still run only every 8 iterations, but a column stops on the device
# at its own iteration, so the counts are the single-vector engines' there too.
METHODS = {"cg": (block_cg, poisson2d), "bicgstab": (block_bicgstab, convection_diffusion)}


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _rhs(n, k, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal((n, k)).astype(dtype)


def _single(method, A, b, **kw):
    """The single-vector engine's outcome on one column (the fused core on a CSR matrix)."""
    return (cg_fused if method == "cg" else bicgstab_fused)(A, b, **kw)


def _check_against_splu(outs, A, B, rtol):
    ref = sla.splu(sp.csc_matrix(A, dtype=np.float64)).solve(B.astype(np.float64))
    for j, out in enumerate(outs):
        x = host(out.x).astype(np.float64)
        r = np.linalg.norm(B[:, j] - A @ x)
        assert r <= 1.5 * rtol * np.linalg.norm(B[:, j]), (j, r)
        scale = np.abs(ref[:, j]).max()
        np.testing.assert_allclose(x, ref[:, j], rtol=0, atol=max(scale, 1e-300) * rtol * 1e3)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-10), (np.float32, 1e-5)])
def test_block_matches_splu_per_column(backend, method, dtype, rtol):
    run, matrix = METHODS[method]
    A = matrix(14, dtype)
    B = _rhs(A.shape[0], 5, dtype=dtype)
    Ad, Bd = on(backend, A, B)
    outs = run(Ad, Bd, rtol=rtol)
    assert [o.code for o in outs] == [CONVERGED] * 5
    assert all(o.x.dtype == dtype and o.x.shape == (A.shape[0],) for o in outs)
    assert outs[0].info["path"] == "block" and outs[0].info["columns"] == 5
    _check_against_splu(outs, A.astype(np.float64), B.astype(np.float64), rtol)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("precond", [None, "jacobi", "neumann"])
def test_iterations_per_column_equal_the_single_vector_engine(backend, method, precond):
    """The same iterates as the single-vector engines, each column on its own (within one)."""
    run, matrix = METHODS[method]
    A = matrix(16)
    B = _rhs(A.shape[0], 6, seed=1)
    B[:, 1] *= 1e-3  # small: the relative stopping test is the column's own
    B[:, 4] = A @ np.ones(A.shape[0])  # smooth: fewer iterations
    Ad, Bd = on(backend, A, B)
    kw = {}
    single_kw = {}
    if precond == "jacobi":
        kw["dinv"] = 1.0 / Ad.diagonal()
        single_kw["jacobi"] = True
    elif precond == "neumann":
        kw["M"] = neumann(Ad)
    outs = run(Ad, Bd, rtol=1e-9, **kw)
    for j, out in enumerate(outs):
        b = Bd[:, j].copy()
        if precond == "neumann":  # the generic loop, reading every iteration
            one = (cg if method == "cg" else bicgstab)(Ad, b, rtol=1e-9, M=kw["M"], check_every=1)
        else:
            one = _single(method, Ad, b, rtol=1e-9, **single_kw)
        assert out.code == one.code == CONVERGED
        assert abs(out.iterations - one.iterations) <= 1, (j, out.iterations, one.iterations)
        np.testing.assert_allclose(host(out.x), host(one.x), rtol=1e-6, atol=1e-9)
    assert len({o.iterations for o in outs}) > 1  # the columns stopped at their own iterations


def test_columns_converge_at_their_own_iterations_and_are_compacted_out(backend):
    """A zero column at once, an eigenvector in one step, the others later; finished ones leave."""
    A = poisson2d(12)
    n = A.shape[0]
    m = 12
    i = np.arange(1, m + 1)
    s = np.sin(np.pi * np.outer(i, [1]) / (m + 1))[:, 0]
    eig = np.kron(s, s)  # an eigenvector of the 2D Laplacian: CG converges in one iteration
    B = _rhs(n, 5, seed=2)
    B[:, 1] = 0.0
    B[:, 3] = eig
    Ad, Bd = on(backend, A, B)
    outs = block_cg(Ad, Bd, rtol=1e-10)
    its = [o.iterations for o in outs]
    assert [o.code for o in outs] == [CONVERGED] * 5
    assert its[1] == 0 and its[3] == 1 and min(its[0], its[2], its[4]) > 10
    assert not np.any(host(outs[1].x))  # b = 0: x = 0 exactly
    np.testing.assert_allclose(host(outs[3].x), sla.spsolve(A.tocsc(), eig), rtol=1e-9)
    assert outs[0].info["compactions"] >= 1
    _check_against_splu(outs, A, B, 1e-10)


def test_a_cg_column_that_breaks_down_leaves_the_others_converging(backend):
    """A symmetric A, positive definite on one block and negative on another: p.Ap < 0 for one column."""
    P = poisson2d(8)
    A = sp.block_diag([P, -sp.identity(10)]).tocsr()
    n = A.shape[0]
    B = np.zeros((n, 3))
    B[:64, 0] = _rhs(64, 1, seed=3)[:, 0]
    B[64:, 1] = 1.0  # lies where A is negative definite: CG breaks down at once
    B[:64, 2] = 1.0
    Ad, Bd = on(backend, A, B)
    outs = block_cg(Ad, Bd, rtol=1e-10)
    assert [o.code for o in outs] == [CONVERGED, BREAKDOWN, CONVERGED]
    assert outs[1].iterations == 0 and "positive definite" in outs[1].message
    assert np.all(np.isfinite(host(outs[1].x)))
    for j in (0, 2):
        x = host(outs[j].x)
        assert np.linalg.norm(B[:, j] - A @ x) <= 1e-10 * np.linalg.norm(B[:, j]) * 1.5
        assert outs[j].iterations == cg_fused(A, B[:, j].copy(), rtol=1e-10).iterations


def test_a_bicgstab_column_that_breaks_down_leaves_the_others_converging(backend):
    """On a skew-symmetric block ``r . A r = 0``: rho's partner r~.v vanishes for that column."""
    C = convection_diffusion(8)
    S = sp.kron(sp.identity(5), sp.csr_matrix([[0.0, 1.0], [-1.0, 0.0]]))
    A = sp.block_diag([C, S]).tocsr()
    n = A.shape[0]
    B = np.zeros((n, 3))
    B[:64, 0] = _rhs(64, 1, seed=4)[:, 0]
    B[64:, 1] = np.arange(1.0, 11.0)
    B[:64, 2] = 1.0
    Ad, Bd = on(backend, A, B)
    outs = block_bicgstab(Ad, Bd, rtol=1e-10)
    assert [o.code for o in outs] == [CONVERGED, BREAKDOWN, CONVERGED]
    assert outs[1].iterations == 0 and "BiCGStab broke down" in outs[1].message
    for j in (0, 2):
        x = host(outs[j].x)
        assert np.linalg.norm(B[:, j] - A @ x) <= 1e-10 * np.linalg.norm(B[:, j]) * 1.5


@pytest.mark.parametrize("method", list(METHODS))
def test_initial_guesses_per_column(backend, method):
    run, matrix = METHODS[method]
    A = matrix(12)
    n = A.shape[0]
    B = _rhs(n, 4, seed=5)
    exact = sla.splu(A.tocsc()).solve(B)
    X0 = np.zeros_like(B)
    X0[:, 1] = exact[:, 1]  # already solved: no iteration
    X0[:, 2] = exact[:, 2] + 1e-3 * _rhs(n, 1, seed=6)[:, 0]  # close: few iterations
    Ad, Bd, X0d = on(backend, A, B, X0)
    outs = run(Ad, Bd, X0=X0d, rtol=1e-10)
    assert [o.code for o in outs] == [CONVERGED] * 4
    assert outs[1].iterations == 0
    assert outs[2].iterations < outs[0].iterations
    for j in range(4):
        one = _single(method, A, B[:, j].copy(), x0=X0[:, j].copy(), rtol=1e-10)
        assert abs(outs[j].iterations - one.iterations) <= 1
    _check_against_splu(outs, A, B, 1e-10)
    np.testing.assert_array_equal(host(X0d), X0)  # the initial guesses are not written to


def test_iteration_limit_and_tolerances_per_column(backend):
    A = poisson2d(16)
    n = A.shape[0]
    B = _rhs(n, 3, seed=7)
    Ad, Bd = on(backend, A, B)
    outs = block_cg(Ad, Bd, rtol=[1e-10, 1e-2, 1e-10], maxiter=[5, 400, 400])
    assert [o.code for o in outs] == [MAXITER, CONVERGED, CONVERGED]
    assert outs[0].iterations == 5
    assert outs[1].iterations < outs[2].iterations
    bn = np.linalg.norm(B, axis=0)
    assert outs[1].residual_norm <= 1e-2 * bn[1]
    # atol alone: the column stops at ||r|| <= atol
    outs = block_cg(Ad, Bd, rtol=0.0, atol=1e-6)
    assert all(o.code == CONVERGED and o.residual_norm <= 1e-6 for o in outs)


def test_bad_arguments_name_the_fix():
    A = poisson2d(4)
    B = np.ones((16, 2))
    with pytest.raises(ValueError, match="method='gmres'.*expected one of"):
        block_solve("gmres", A, B)
    with pytest.raises(ValueError, match="not both"):
        block_solve("cg", A, B, M=lambda r: r, dinv=np.ones(16))
    with pytest.raises(ValueError, match=r"X0.*\(16, 2\)"):
        block_cg(A, B, X0=np.ones((16, 3)))
    with pytest.raises(ValueError, match=r"B.*\(16, k\)"):
        block_cg(A, np.ones((15, 2)))


# ------------------------------------------------------------------------------ through Solver / solve
def test_solver_takes_the_block_loop_on_the_host_for_a_polynomial_preconditioner():
    """On the host the generic path's block goes through the loop (the fused core keeps its own)."""
    A = poisson2d(20)
    B = _rhs(A.shape[0], 6, seed=8)
    with Solver(A, method="cg", M="neumann", rtol=1e-9, device="cpu") as solver:
        res = solver.solve(B)
        one = [solver.solve(B[:, j]) for j in range(6)]
    assert res.info["path"] == "block" and res.converged
    assert all(abs(a - r.iterations) <= 1 for a, r in zip(res.iterations, one, strict=True))
    X = host(res.x)
    ref = sla.splu(A.tocsc()).solve(B)
    np.testing.assert_allclose(X, ref, rtol=1e-6, atol=1e-7 * np.abs(ref).max())
    with Solver(A, method="cg", rtol=1e-9, device="cpu") as fused:
        assert fused.solve(B).info["path"] == "batched"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [None, "jacobi"])
def test_solve_with_a_block_on_a_gpu_runs_one_block_loop(M):
    A = convection_diffusion(20)
    B = _rhs(A.shape[0], 7, seed=9)
    Ad, Bd = on("cuda", A, B)
    res = ms.solve(Ad, Bd, method="bicgstab", M=M, rtol=1e-10)
    assert res.info["path"] == "block" and res.converged, res.message
    assert res.x.shape == B.shape
    ref = sla.splu(A.tocsc()).solve(B)
    np.testing.assert_allclose(host(res.x), ref, rtol=1e-7, atol=1e-9 * np.abs(ref).max())



def test_solver_block_transpose_solves_the_transposed_system(backend):
    A = convection_diffusion(12)
    B = _rhs(A.shape[0], 4, seed=10)
    Ad, Bd = on(backend, A, B)
    M = "neumann" if backend == "cpu" else None  # the block loop on both
    with Solver(Ad, method="bicgstab", M=M, rtol=1e-10) as solver:
        res = solver.solve_transpose(Bd)
    assert res.converged and res.info["path"] == "block"
    ref = sla.splu(A.T.tocsc()).solve(B)
    np.testing.assert_allclose(host(res.x), ref, rtol=1e-7, atol=1e-9 * np.abs(ref).max())


def test_solver_block_honours_the_null_space(backend):
    """A singular Neumann Laplacian with nullspace='constant': each column projected, x orthogonal."""
    A = neumann2d(10)
    n = A.shape[0]
    B = _rhs(n, 3, seed=11)
    B[:, 1] -= B[:, 1].mean()  # consistent; the others have a constant part no x reaches
    Ad, Bd = on(backend, A, B)
    M = "neumann" if backend == "cpu" else None
    with Solver(Ad, method="cg", M=M, rtol=1e-9, nullspace="constant") as solver:
        res = solver.solve(Bd)
    assert res.info["path"] == "block"
    X = host(res.x)
    assert res.column_status[1] is Status.CONVERGED
    for j in range(3):
        assert abs(X[:, j].sum()) <= 1e-8 * np.abs(X[:, j]).sum()
        Bj = B[:, j] - B[:, j].mean()
        assert np.linalg.norm(Bj - A @ X[:, j]) <= 1e-8 * np.linalg.norm(B[:, j])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpu_block_passes_match_the_numpy_forms(dtype):
    """Each CUDA pass against its NumPy twin; the stopped columns are left untouched."""
    cp, _ = array_modules("cuda")
    rng = np.random.default_rng(12)
    n, m = 1000, 5
    live = np.array([True, False, True, True, False])
    start = {name: rng.standard_normal((n, m)).astype(dtype) for name in "XRPQVZT"}
    vectors = {"diag": rng.uniform(0.5, 2.0, n).astype(dtype), "a": rng.standard_normal(m),
               "beta": rng.standard_normal(m), "omega": rng.standard_normal(m), "live": live}
    tol = 1e-5 if dtype == np.float32 else 1e-12

    def both(fn, *args, **kw):
        """Run pass ``fn`` on both (names of blocks or vectors; other values as they are)."""
        h = {k: v.copy() for k, v in start.items()}
        d = {k: cp.asfortranarray(cp.asarray(v)) for k, v in start.items()}

        def pick(x, blocks, put):
            if x in blocks:
                return blocks[x]
            return put(vectors[x]) if x in vectors else x

        got_h = getattr(NumpyBlockOps(), fn)(*[pick(x, h, np.asarray) for x in args],
                                             **{k: pick(x, h, np.asarray) for k, x in kw.items()})
        got_d = getattr(CupyBlockOps(0), fn)(*[pick(x, d, cp.asarray) for x in args],
                                             **{k: pick(x, d, cp.asarray) for k, x in kw.items()})
        for k in start:
            np.testing.assert_allclose(cp.asnumpy(d[k]), h[k], rtol=tol, atol=tol, err_msg=f"{fn} {k}")
            np.testing.assert_array_equal(h[k][:, ~live], start[k][:, ~live])
        for u, v in zip(got_h or (), got_d or (), strict=True):
            if u is not None:
                np.testing.assert_allclose(cp.asnumpy(v)[live], u[live], rtol=10 * tol)

    both("dots", "P", "Q", None, "live")
    both("dots", "T", "T", "R", "live")
    both("update", "X", "R", "P", "Q", "a", "live")
    both("update", "X", "R", "P", "Q", "a", "live", second="dinv", dinv="diag")
    both("update", "X", "R", "R", "T", "a", "live", second="rt", Rt="V")
    both("update", "X", "R", "Z", "V", "a", "live", dinv="diag", Z="Z")
    both("cg_direction", "P", "R", None, None, "beta", "live")
    both("cg_direction", "P", "R", "diag", None, "beta", "live")
    both("cg_direction", "P", "R", None, "Z", "beta", "live")
    both("bicg_direction", "P", "R", "V", None, None, "beta", "omega", "live")
    both("bicg_direction", "P", "R", "V", "diag", "Z", "beta", "omega", "live")


def test_numpy_block_passes_leave_stopped_columns_alone():
    """The host forms skip stopped columns as the CUDA kernels do."""
    rng = np.random.default_rng(13)
    n, m = 50, 4
    live = np.array([True, False, True, False])
    X, R, P, Q = (rng.standard_normal((n, m)) for _ in range(4))
    before = [v.copy() for v in (X, R, P, Q)]
    a = rng.standard_normal(m)
    ops = NumpyBlockOps()
    rr, rz = ops.update(X, R, P, Q, a, live, second="dinv", dinv=np.full(n, 0.5))
    for v, w in zip((X, R, P, Q), before, strict=True):
        np.testing.assert_array_equal(v[:, ~live], w[:, ~live])
    np.testing.assert_allclose(X[:, live], before[0][:, live] + a[live] * P[:, live])
    np.testing.assert_allclose(rr[live], (R[:, live] ** 2).sum(axis=0))
    np.testing.assert_allclose(rz[live], 0.5 * rr[live])
    assert not rr[~live].any()


class _ColumnMajorHostOps(NumpyBlockOps):
    """The GPU's policy on host arrays: F-ordered blocks, compaction at three quarters."""

    order = "F"
    compact_at = 0.75


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("precond", [None, "jacobi"])
def test_late_checkpoints_and_column_major_blocks_give_the_same_columns(method, precond):
    """Columns frozen on the device between checkpoints (the GPU's reads every 8) change nothing."""
    run, matrix = METHODS[method]
    A = matrix(15)
    n = A.shape[0]
    B = _rhs(n, 9, seed=14)
    B[:, 2] = 0.0
    B[:, 5] *= 1e-6
    B[:, 7] = A @ np.ones(n)
    kw = {"dinv": 1.0 / A.diagonal()} if precond == "jacobi" else {}
    rtol = [1e-10] * 8 + [1e-3]  # the last column stops early
    every_step = run(A, B, rtol=rtol, **kw)
    late = run(A, B, rtol=rtol, check_every=8, ops=_ColumnMajorHostOps(), **kw)
    assert [o.code for o in late] == [CONVERGED] * 9
    # A column's sums are rounded alike whatever else is in the block up to
    # the order of the additions, which the layout and the block's width
    # change: CG's counts do not move; BiCGStab's erratic residual may cross
    # the tolerance a step or two apart.
    slack = 0 if method == "cg" else 3
    for j, (a, b) in enumerate(zip(late, every_step, strict=True)):
        assert abs(a.iterations - b.iterations) <= slack, (j, a.iterations, b.iterations)
        r = np.linalg.norm(B[:, j] - A @ a.x)
        assert r <= 1.5 * rtol[j] * np.linalg.norm(B[:, j]), (j, r)
    assert late[0].info["checkpoints"] < every_step[0].info["checkpoints"]
    assert late[0].info["compactions"] >= 1


@pytest.mark.gpu
def test_fused_scalar_steps_match_the_plain_ones():
    """cupy.fuse compiles every scalar step, and each gives the plain step's figures."""
    import inspect

    from managed_solve.solvers.block import scalar_steps

    cp, _ = array_modules("cuda")
    ops = CupyBlockOps(0)
    code = np.array([-1, -1, -1, -1, 0, 1, 2, -1], dtype=np.int64)
    ints = np.array([0, 3, 9, 10, 4, 10, 2, 1], dtype=np.int64)
    floats = [np.array([1.0, 0.0, -2.0, np.nan, 1e-30, np.inf, 3.0, 1e-12]) * s
              for s in (1.0, -0.5, 2.0, 1e-9)]
    plain, gpu = scalar_steps(np), scalar_steps(cp)
    for name, fn in vars(plain).items():
        args = []
        for i, arg in enumerate(inspect.signature(fn).parameters):
            if arg == "code":
                args.append(code)
            elif arg in ("it", "maxit"):
                args.append(ints if arg == "it" else np.full_like(ints, 10))
            else:
                args.append(np.roll(floats[i % len(floats)], i))
        with np.errstate(all="ignore"):
            want = fn(*args)
        fused = ops.fuse(getattr(gpu, name))
        got = fused(*[cp.asarray(a) for a in args])
        assert fused.works, name
        for w, g in zip(want if isinstance(want, tuple) else (want,),
                        got if isinstance(got, tuple) else (got,), strict=True):
            np.testing.assert_array_equal(cp.asnumpy(g), w, err_msg=name)
