"""Solver: set up once, solve many right-hand sides; update, transpose solves, release."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

import managed_solve as ms
from managed_solve import DeviceManager, Solver, Status, solve
from tests._problems import (
    BACKENDS,
    convection_diffusion,
    host,
    laplacian1d,
    neumann2d,
    on,
    poisson2d,
)

METHODS = ["direct", "cg", "bicgstab", "gmres", "minres"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _block(n, k, seed=0):
    return np.random.default_rng(seed).standard_normal((n, k))


def _check_columns(res, A, B, rtol):
    X = host(res.x)
    assert X.shape == B.shape
    ref = sla.splu(A.tocsc()).solve(B)
    for j in range(B.shape[1]):
        r = np.linalg.norm(B[:, j] - A @ X[:, j])
        assert r <= rtol * np.linalg.norm(B[:, j]) * (1 + 1e-6), (j, r)
        assert res.residual_norm[j] == pytest.approx(r, rel=1e-3, abs=1e-14)
        np.testing.assert_allclose(X[:, j], ref[:, j], rtol=1e-5, atol=1e-7 * np.abs(ref).max())
    assert res.column_status == tuple(Status.CONVERGED for _ in range(B.shape[1]))
    assert res.converged and np.all(res.relative_residual <= rtol * (1 + 1e-6))


@pytest.mark.parametrize("k", [1, 5])  # one column is a block too: (n, 1) x, per-column figures
@pytest.mark.parametrize("method", METHODS)
def test_several_right_hand_sides_match_splu_per_column(backend, method, k):
    A = poisson2d(12) if method in ("cg", "minres") else convection_diffusion(12)
    if method == "minres":
        A = (A - 0.3 * sp.identity(A.shape[0])).tocsr()  # symmetric indefinite
    B = _block(A.shape[0], k)
    Ad, Bd = on(backend, A, B)
    with Solver(Ad, method=method, rtol=1e-9) as solver:
        res = solver.solve(Bd)
    _check_columns(res, A, B, 1e-9)
    assert res.method == method and len(res.iterations) == k


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("device", ["cpu", "sim:0"])
def test_a_one_column_block_keeps_its_shape_forward_and_transposed(method, device):
    """B of shape (n, 1) gives x of shape (n, 1) and one column status, as any (n, k) block does."""
    A = laplacian1d(40) if method in ("cg", "minres") else convection_diffusion(6)
    n = A.shape[0]
    B = _block(n, 1, seed=3)
    dm = DeviceManager(simulate="1x1GiB")
    with Solver(A, method=method, rtol=1e-10, device=device, manager=dm) as solver:
        blocks = [(solver.solve(B), A), (solver.solve_transpose(B), A.T),
                  (solver.solve(B, x0=np.zeros(n)), A)]  # one guess, as (n,) or (n, 1)
        vector = solver.solve(B[:, 0], x0=np.zeros((n, 1)))
    for res, M in blocks:
        assert res.x.shape == (n, 1) and res.column_status == (Status.CONVERGED,)
        assert res.iterations.shape == res.residual_norm.shape == (1,) and res.device == device
        np.testing.assert_allclose(res.x[:, 0], sla.spsolve(M.tocsc(), B[:, 0]),
                                   rtol=1e-7, atol=1e-10)
    # A 1-D b keeps a 1-D x.
    assert vector.x.shape == (n,) and vector.column_status is None and vector.converged


def test_solve_accepts_a_block_and_each_column_converges_on_its_own():
    A = poisson2d(15)
    B = _block(225, 4, seed=1)
    B[:, 2] = 0.0  # a zero column converges at once
    res = solve(A, B, method="cg", rtol=1e-10, device="cpu")
    _check_columns(res, A, B, 1e-10)
    assert res.iterations[2] == 0 and res.iterations[0] > 10


def test_the_block_runs_as_one_batch_on_the_fused_core():
    """k columns on the fused core share one batch (A read once an iteration for all)."""
    A = poisson2d(10)
    B = _block(100, 6, seed=2)
    with Solver(A, method="cg", device="cpu") as solver:
        res = solver.solve(B)
    assert res.info["path"] == "batched"
    with Solver(A, method="cg", device="cpu") as solver:
        one = [solver.solve(B[:, j]) for j in range(6)]
    # The same iterations as six separate solves (the columns stop on their own).
    assert [r.iterations for r in one] == res.iterations.tolist()


def test_per_column_status_when_one_column_runs_out_of_iterations():
    A = poisson2d(20)
    B = np.stack([np.ones(400), _block(400, 1, seed=3)[:, 0]], axis=1)
    B[:, 0] = A @ np.ones(400)  # smooth: fewer iterations than the random column
    with Solver(A, method="cg", maxiter=25, rtol=1e-10, device="cpu") as solver:
        res = solver.solve(B)
    assert res.column_status[1] is Status.MAXITER
    assert res.status is Status.MAXITER and "columns did not converge" in res.message


def _scaled_norm(v):
    s = np.abs(v).max()
    return 0.0 if s == 0 else s * np.linalg.norm(v / s)


def _as_separate_solves(solver, B, res):
    """Every column of the block result is what a solve of that column alone gives."""
    alone = [solver.solve(B[:, j].copy()) for j in range(B.shape[1])]
    assert res.column_status == tuple(r.status for r in alone)
    eps = np.finfo(B.dtype).eps  # norms summed in another order differ by rounding
    np.testing.assert_allclose(res.b_norm, [r.b_norm for r in alone], rtol=100 * eps)
    # Residuals at rounding level differ by rounding; larger ones agree.
    scale = np.array([r.b_norm for r in alone])
    np.testing.assert_array_less(np.abs(res.residual_norm - [r.residual_norm for r in alone]),
                                 1e-3 * res.residual_norm + 100 * eps * scale + 1e-300)
    for j, r in enumerate(alone):
        if r.x is not None:
            tol = 1e-8 if B.dtype == np.float64 else 1e-4
            np.testing.assert_allclose(res.x[:, j], r.x, rtol=tol, atol=tol * np.abs(r.x).max())
    return alone


def test_a_direct_block_is_judged_per_column_against_splu():
    """Zero, huge and tiny columns beside ordinary ones: each judged by its own true residual."""
    A = convection_diffusion(13)
    n = A.shape[0]
    B = _block(n, 9, seed=5)
    B[:, 2] = 0.0
    B[:, 4] *= 1e200  # solved scaled by a power of two, scaled back
    B[:, 6] *= 1e-200
    ref = sla.splu(A.tocsc()).solve(B)
    with Solver(A, method="direct", rtol=1e-10, device="cpu") as solver:
        res = solver.solve(B)
        _as_separate_solves(solver, B, res)
        ordinary = B[:, [0, 1, 3, 5, 7, 8]]
        back = solver.solve_transpose(ordinary)  # A^T X = B on the same factors
    assert back.converged
    np.testing.assert_allclose(back.x, sla.splu(A.T.tocsc()).solve(ordinary), rtol=1e-8,
                               atol=1e-12 * np.abs(back.x).max())
    assert res.converged and res.method == "direct" and res.info["columns"] == 9
    X = res.x
    assert X.shape == B.shape and X.flags.c_contiguous and not np.shares_memory(X, B)
    for j in range(9):
        r = _scaled_norm(B[:, j] - A @ X[:, j])
        assert r <= 1e-10 * _scaled_norm(B[:, j]), j
        assert res.residual_norm[j] == pytest.approx(r, rel=1e-3, abs=1e-300)
        np.testing.assert_allclose(X[:, j], ref[:, j], rtol=1e-8,
                                   atol=1e-12 * np.abs(ref[:, j]).max())
    assert not X[:, 2].any() and res.iterations.tolist() == [1] * 9


def test_a_float32_direct_block_short_of_rtol_keeps_x_and_says_so():
    A = poisson2d(12, np.float32)
    B = _block(144, 6, seed=6).astype(np.float32)
    with Solver(A, method="direct", rtol=1e-9, device="cpu") as solver:
        res = solver.solve(B)
        _as_separate_solves(solver, B, res)
    assert res.column_status == (Status.MAXITER,) * 6 and res.x.dtype == np.float32
    assert "6 of 6 columns did not converge" in res.message and "float32" in res.message
    assert np.all(res.relative_residual > 1e-9) and np.all(res.relative_residual < 1e-5)


def test_auto_falls_back_from_a_singular_factorisation_for_a_block():
    """An exactly singular LU under "auto": each column goes to the Krylov fallback."""
    A = laplacian1d(30).tolil()
    A[7, :] = 0.0
    A[:, 7] = 0.0
    A = A.tocsr()
    A.eliminate_zeros()
    B = A @ _block(30, 5, seed=7)  # consistent columns
    with Solver(A, device="cpu") as solver:
        assert solver.method == "direct"
        res = solver.solve(B)
    assert res.converged and res.method != "direct", res.message
    for j in range(5):
        assert np.linalg.norm(B[:, j] - A @ res.x[:, j]) <= 1e-8 * np.linalg.norm(B[:, j])


def test_a_direct_block_with_a_null_space_projects_each_column():
    A = neumann2d(10)
    x_true = np.random.default_rng(8).standard_normal(100)
    x_true -= x_true.mean()
    b = A @ x_true
    B = np.stack([b, b + 3.0, 2.0 * b], axis=1)
    with Solver(A, method="direct", nullspace="constant", rtol=1e-10, device="cpu") as solver:
        res = solver.solve(B)
        _as_separate_solves(solver, B, res)
    assert res.column_status == (Status.CONVERGED, Status.LEAST_SQUARES, Status.CONVERGED)
    np.testing.assert_allclose(res.x, np.stack([x_true, x_true, 2 * x_true], axis=1), rtol=1e-6,
                               atol=1e-8)


@pytest.mark.parametrize("method", ["direct", "cg", "gmres"])
def test_update_with_new_values_equals_a_fresh_set_up(backend, method):
    A = poisson2d(10) if method == "cg" else convection_diffusion(10)
    # Same pattern, new values (a symmetric scaling keeps an SPD matrix SPD).
    d = sp.diags(np.linspace(1.0, 2.0, A.shape[0]))
    A2 = (d @ A @ d).tocsr()
    assert (A2.indptr == A.indptr).all() and (A2.indices == A.indices).all()
    b = np.arange(1.0, 101.0)
    Ad, bd, A2d = on(backend, A, b, A2)
    with Solver(Ad, method=method, rtol=1e-10) as solver:
        solver.solve(bd)
        solver.update(A2d)
        updated = host(solver.solve(bd).x)
    with Solver(A2d, method=method, rtol=1e-10) as fresh:
        expected = host(fresh.solve(bd).x)
    np.testing.assert_allclose(updated, expected, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(A2 @ updated, b, rtol=1e-7)


def test_update_to_values_that_are_not_symmetric_leaves_cg(backend):
    """auto chose CG for SPD values; new values on the same pattern that are not symmetric
    are solved by the method auto gives them (CG would stall to the iteration limit)."""
    A = poisson2d(20)
    rng = np.random.default_rng(0)
    N = A.copy()
    N.data = A.data * np.where(A.data < 0, rng.uniform(0.2, 1.8, A.nnz), 1.0)
    b = rng.standard_normal(A.shape[0])
    Ad, bd, Nd = on(backend, A, b, N)
    with Solver(Ad, method="auto", M=None, rhs=1) as solver:
        assert solver.method == "cg"
        solver.update(Nd)
        assert solver.symmetric is False and solver.method == "bicgstab"
        res = solver.solve(bd)
    assert res.status == Status.CONVERGED and res.method == "bicgstab"
    assert res.iterations < 10 * A.shape[0]
    x = host(res.x)
    assert np.linalg.norm(b - N @ x) <= 1e-8 * np.linalg.norm(b)
    ref = sla.spsolve(N.tocsc(), b)
    assert np.linalg.norm(x - ref) <= 1e-5 * np.linalg.norm(ref)


def test_update_with_another_pattern_names_the_fix():
    A = poisson2d(6)
    with Solver(A, method="cg") as solver:
        with pytest.raises(ValueError, match=r"^Solver\.update\(A\): A has another sparsity "
                                             r"pattern.*new solver"):  # its own argument's name
            solver.update(poisson2d(6) + sp.diags([1.0], [5], shape=A.shape))
        with pytest.raises(ValueError, match="expected"):
            solver.update(np.ones(3))


@pytest.mark.parametrize("method", ["direct", "bicgstab", "gmres"])
def test_solve_transpose_of_a_non_symmetric_matrix(backend, method):
    A = convection_diffusion(11)
    b = np.linspace(-1.0, 1.0, A.shape[0])
    Ad, bd = on(backend, A, b)
    with Solver(Ad, method=method, rtol=1e-10) as solver:
        res = solver.solve_transpose(bd)
        again = solver.solve_transpose(bd)  # the transposed set-up is reused
    assert res.converged and again.converged
    np.testing.assert_allclose(host(res.x), sla.spsolve(A.T.tocsc(), b), rtol=1e-7, atol=1e-10)


def test_an_amg_solver_reserves_its_hierarchy():
    from managed_solve.system.cost import amg_bytes

    dm = DeviceManager(simulate="1x1GiB")
    A = poisson2d(40)
    plain = Solver(A, method="cg", M=None, manager=dm)
    dev = plain.device
    base = dm.reserved_bytes(dev)
    amg_solver = Solver(A, method="cg", M="amg", manager=dm, device=dev)
    grown = dm.reserved_bytes(dev) - base
    assert grown >= base + amg_bytes(A.shape[0], A.nnz)  # the same system, plus the hierarchy
    assert amg_solver.solve(np.ones(1600)).converged
    amg_solver.close()
    plain.close()
    assert dm.reserved_bytes(dev) == 0


def test_close_releases_the_reservation_and_refuses_later_solves():
    dm = DeviceManager(simulate="1x1GiB")
    A = poisson2d(30)
    solver = Solver(A, method="cg", manager=dm)
    dev = solver.device
    assert dm.reserved_bytes(dev) > 0
    assert solver.solve(np.ones(900)).converged
    solver.close()
    solver.close()  # idempotent
    assert dm.reserved_bytes(dev) == 0
    with pytest.raises(RuntimeError, match="closed"):
        solver.solve(np.ones(900))


def test_a_solver_on_a_simulated_gpu_takes_the_gpu_method():
    dm = DeviceManager(simulate="1x1GiB")
    with Solver(poisson2d(8), manager=dm) as solver:
        assert solver.method == "cg" and str(solver.device) == "sim:0"
        res = solver.solve(_block(64, 3))
    assert res.converged and res.device == "sim:0"


def test_a_block_takes_the_ledger_room_it_needs_and_passes_where_it_lacks_it():
    dm = DeviceManager(simulate="1x1GiB")
    A = poisson2d(30)
    B = _block(900, 8, seed=9)
    ref = sla.splu(A.tocsc()).solve(B)
    with Solver(A, method="cg", manager=dm, rtol=1e-10) as solver:
        dev = solver.device
        held = dm.reserved_bytes(dev)
        whole = solver.solve(B)  # room for all: one pass, its columns reserved while it runs
        assert whole.info["passes"] == 1 and dm.reserved_bytes(dev) == held
        per = dm.size_of(solver.block_column_bytes)
        dev.sim_used_bytes = dev.total_bytes - int(2.5 * per)  # room for two more columns
        tight = solver.solve(B)
        assert tight.info["passes"] == 3 and dm.reserved_bytes(dev) == held
        dev.sim_used_bytes = dev.total_bytes  # no room: one column a pass
        one = solver.solve(B)
        assert one.info["passes"] == 8
    for res in (whole, tight, one):
        assert res.converged and res.x.shape == B.shape and res.info["columns"] == 8
        np.testing.assert_allclose(res.x, ref, rtol=1e-7, atol=1e-9 * np.abs(ref).max())
    np.testing.assert_array_equal(one.iterations, whole.iterations)


def test_bad_right_hand_sides_name_the_argument():
    with Solver(poisson2d(4), method="cg") as solver:
        with pytest.raises(ValueError, match=r"b must have shape \(16,\) or \(16, k\)"):
            solver.solve(np.ones(15))
        bad = np.ones(16)
        bad[3] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            solver.solve(bad)
        with pytest.raises(ValueError, match="x0"):
            solver.solve(np.ones((16, 2)), x0=np.ones(16))
        with pytest.raises(ValueError, match=r"k >= 1, got shape \(16, 0\)"):
            solver.solve(np.ones((16, 0)))


def test_exported_at_the_top_level():
    assert ms.Solver is Solver
    assert "Solver(n=16" in repr(Solver(poisson2d(4), method="cg"))


def _solved_on_threads(solvers: list, bs: list) -> dict:
    """``bs[j]`` solved by ``solvers[j % len(solvers)]``, one thread a solver entry; results by j.

    Failures inside a thread are raised again here, in the test's thread.
    """
    import threading

    out: dict = {}
    errors: list = []
    count = len(solvers)

    def work(k: int) -> None:
        try:
            for j in range(k, len(bs), count):
                out[j] = solvers[k].solve(bs[j])
        except BaseException as exc:  # noqa: BLE001 - raised again below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _assert_each_answer(A, bs: list, out: dict) -> None:
    for j, b in enumerate(bs):
        assert out[j].converged
        x = ms._backend.to_host(out[j].x)
        assert np.linalg.norm(A @ x - b) <= 1e-9 * np.linalg.norm(b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("M", ["amg", None])
def test_one_solver_shared_by_threads_gives_each_its_own_answer(device, M):
    """Solves from several threads on one Solver (and its cycle's buffers) take turns.

    Each solve spans several of the interpreter's thread switches, so
    without the solver's turns the threads' solves interleave in its workspace.
    """
    A = poisson2d(96)
    rng = np.random.default_rng(7)
    bs = [rng.standard_normal(A.shape[0]) for _ in range(12)]
    # maxiter: a solve whose workspace another thread overwrote stops, not runs on
    with Solver(A, method="cg", M=M, rtol=1e-10, maxiter=3000, device=device) as solver:
        out = _solved_on_threads([solver] * 4, bs)
    _assert_each_answer(A, bs, out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_two_solvers_sharing_one_amg_hierarchy_solve_side_by_side(device):
    """One hierarchy as M of two solvers on two threads: its cycle's buffers are taken in turn."""
    from managed_solve.solvers.amg import AMGPreconditioner

    A = poisson2d(48)
    if device != "cpu":
        import cupyx.scipy.sparse as csp

        A_dev = csp.csr_matrix(A)
    else:
        A_dev = A
    hierarchy = AMGPreconditioner(A_dev)
    rng = np.random.default_rng(8)
    bs = [rng.standard_normal(A.shape[0]) for _ in range(8)]
    solvers = [Solver(A, method="cg", M=hierarchy, rtol=1e-10, device=device) for _ in range(2)]
    try:
        out = _solved_on_threads(solvers, bs)
    finally:
        for s in solvers:
            s.close()
    _assert_each_answer(A, bs, out)


def _zero_diagonal(A):
    """A with its diagonal set to stored zeros: the same pattern, values Jacobi cannot scale by."""
    Z = A.copy()
    Z.setdiag(0.0)
    return Z.tocsr()


@pytest.mark.parametrize("method,M", [("gmres", "jacobi"), ("gmres", "neumann"),
                                      ("cg", "jacobi"), ("bicgstab", "jacobi")])
def test_a_rejected_update_leaves_the_solver_solving_its_previous_matrix(method, M, backend):
    A = poisson2d(10)
    Z = _zero_diagonal(A)
    assert (Z.indptr == A.indptr).all() and (Z.indices == A.indices).all()
    b = np.linspace(1.0, 2.0, A.shape[0])
    Ad, Zd, bd = on(backend, A, Z, b)
    with Solver(Ad, method=method, M=M, rtol=1e-10) as solver:
        with pytest.raises(ValueError, match="zero diagonal"):
            solver.update(Zd)
        res = solver.solve(bd)
        back = solver.solve_transpose(bd)
    assert res.converged and back.converged
    np.testing.assert_allclose(host(res.x), sla.spsolve(A.tocsc(), b), rtol=1e-7)
    np.testing.assert_allclose(host(back.x), sla.spsolve(A.T.tocsc(), b), rtol=1e-7)


@pytest.mark.parametrize("method", ["cg", "gmres", "bicgstab", "minres", "direct"])
def test_a_dense_solver_takes_a_new_matrix_of_its_shape(method, backend):
    D = poisson2d(4).toarray()
    b = np.linspace(1.0, 2.0, D.shape[0])
    Dd, D2d, bd, wrong = on(backend, D, 2.0 * D, b, np.ones((3, 3)))
    with Solver(Dd, method=method, rtol=1e-10) as solver:
        solver.solve(bd)
        solver.update(D2d)
        res = solver.solve(bd)
        with pytest.raises(ValueError, match="shape"):
            solver.update(wrong)
        again = solver.solve(bd)  # the refused update changed nothing
    assert res.converged and again.converged
    expected = sla.spsolve(sp.csc_matrix(2.0 * D), b)
    np.testing.assert_allclose(host(res.x), expected, rtol=1e-7)
    np.testing.assert_allclose(host(again.x), expected, rtol=1e-7)


@pytest.mark.parametrize("method", ["direct", "cg", "gmres"])
def test_update_refuses_complex_values_as_solve_does(method):
    A = laplacian1d(12)
    b = np.ones(A.shape[0])
    with Solver(A, method=method, rtol=1e-10) as solver:
        with pytest.raises(TypeError, match="update.*complex"):
            solver.update(A.data * (1 + 1j))
        with pytest.raises(TypeError, match="update.*complex"):
            solver.update(sp.csr_matrix((A.data * (1 + 1j), A.indices, A.indptr), shape=A.shape))
        res = solver.solve(b)
    assert res.converged
    np.testing.assert_allclose(res.x, sla.spsolve(A.tocsc(), b), rtol=1e-7)
    D = A.toarray()
    with Solver(D, method="direct") as solver:
        with pytest.raises(TypeError, match="update.*complex"):
            solver.update(D * (1 + 1j))
        np.testing.assert_allclose(solver.solve(b).x, sla.spsolve(A.tocsc(), b), rtol=1e-7)


def _update_forms(A, scale):
    """A's values times ``scale`` in every form Solver.update takes for a sparse A."""
    torch = pytest.importorskip("torch")
    crow, col = torch.tensor(A.indptr), torch.tensor(A.indices)
    values = torch.tensor(A.data * scale)
    return {
        "numpy values": A.data * scale,
        "torch values": values,
        "scipy csr": (A * scale).tocsr(),
        "torch csr": torch.sparse_csr_tensor(crow, col, values, size=A.shape),
        "torch coo": torch.sparse_csr_tensor(crow, col, values, size=A.shape).to_sparse_coo(),
        "(crow, col, values)": (crow, col, values),
    }


@pytest.mark.parametrize("form", ["numpy values", "torch values", "scipy csr", "torch csr",
                                  "torch coo", "(crow, col, values)"])
@pytest.mark.parametrize("built_from", ["scipy", "torch csr"])
def test_update_takes_every_documented_form(form, built_from):
    torch = pytest.importorskip("torch")
    A = convection_diffusion(6)
    b = np.linspace(-1.0, 1.0, A.shape[0])
    given = A if built_from == "scipy" else torch.sparse_csr_tensor(
        torch.tensor(A.indptr), torch.tensor(A.indices), torch.tensor(A.data), size=A.shape)
    with Solver(given, method="gmres", rtol=1e-10) as solver:
        solver.update(_update_forms(A, 3.0)[form])
        res = solver.solve(b)
    assert res.converged
    np.testing.assert_allclose(res.x, sla.spsolve((3.0 * A).tocsc(), b), rtol=1e-7)


def test_update_names_the_accepted_forms_for_a_dense_matrix_on_a_sparse_solver():
    A = laplacian1d(8)
    with Solver(A, method="cg") as solver:
        with pytest.raises(ValueError, match=r"Solver.update\(A\).*\(crow, col, values\)"):
            solver.update(A.toarray())
        np.testing.assert_allclose(solver.solve(np.ones(8)).x,
                                   sla.spsolve(A.tocsc(), np.ones(8)), rtol=1e-7)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_updated_torch_values_that_require_grad_get_their_gradient(where):
    """New values given as torch tensors (on the CPU, or on a GPU for a solver there) are
    solved with and get the gradient; the values they replaced get none."""
    torch = pytest.importorskip("torch")
    A = convection_diffusion(5)
    crow, col = torch.tensor(A.indptr, device=where), torch.tensor(A.indices, device=where)
    first = torch.tensor(A.data, requires_grad=True, device=where)
    b = torch.linspace(1.0, 2.0, A.shape[0], dtype=torch.float64, device=where)
    with Solver((crow, col, first), method="gmres", rtol=1e-12) as solver:
        values = torch.tensor(2.0 * A.data, requires_grad=True, device=where)
        solver.update(values)
        out = solver.solve(b).to_torch()
        assert out.device == b.device
        out.sum().backward()
    dense = torch.sparse_csr_tensor(crow.cpu(), col.cpu(), values.detach().cpu(), size=A.shape).to_dense()
    dense.requires_grad_(True)
    torch.linalg.solve(dense, b.cpu()).sum().backward()
    rows = np.repeat(np.arange(A.shape[0]), np.diff(A.indptr))
    expected = dense.grad.numpy()[rows, A.indices]
    assert values.grad.device == values.device
    np.testing.assert_allclose(values.grad.cpu().numpy(), expected, rtol=1e-8, atol=1e-12)
    assert first.grad is None


class _RmatvecOnly:
    """An operator with matvec and rmatvec and no ``.T``: what the transpose messages ask for."""

    def __init__(self, A):
        self.A, self.shape, self.dtype = A, A.shape, A.dtype

    def matvec(self, x):
        return self.A @ x

    def rmatvec(self, x):
        return self.A.T @ x


@pytest.mark.parametrize("method", ["gmres", "bicgstab"])
def test_solve_transpose_of_an_operator_uses_its_rmatvec(method):
    A = convection_diffusion(8)
    b = np.linspace(-1.0, 1.0, A.shape[0])
    with Solver(_RmatvecOnly(A), method=method, rtol=1e-10) as solver:
        res = solver.solve_transpose(b)
        block = solver.solve_transpose(np.stack([b, 2.0 * b], axis=1))
    assert res.converged and block.converged
    expected = sla.spsolve(A.T.tocsc(), b)
    np.testing.assert_allclose(res.x, expected, rtol=1e-7)
    np.testing.assert_allclose(block.x, np.stack([expected, 2.0 * expected], axis=1), rtol=1e-7)


def test_the_gradient_of_an_operator_solve_takes_the_adjoint_through_rmatvec():
    torch = pytest.importorskip("torch")
    A = convection_diffusion(8)
    b = torch.linspace(-1.0, 1.0, A.shape[0], dtype=torch.float64, requires_grad=True)
    solve(_RmatvecOnly(A), b, method="gmres", rtol=1e-12).to_torch().sum().backward()
    expected = sla.spsolve(A.T.tocsc(), np.ones(A.shape[0]))
    np.testing.assert_allclose(b.grad.numpy(), expected, rtol=1e-8)


@pytest.mark.parametrize("method,M", [("cg", None), ("cg", "jacobi"), ("cg", "amg"), ("gmres", None),
                                      ("bicgstab", None), ("minres", None), ("direct", None)])
def test_a_b_in_the_null_space_gives_x_zero_and_least_squares(method, M, backend):
    """A uniform source on a pure Neumann problem: b is all in the null space, so no part of it
    can be reached; the least-squares x orthogonal to the null space is 0, found at once."""
    A = neumann2d(12)
    n = A.shape[0]
    b = np.ones(n)
    B = np.stack([b, np.linspace(-1.0, 1.0, n) - np.linspace(-1.0, 1.0, n).mean() + b], axis=1)
    Ad, bd, Bd = on(backend, A, b, B)
    res = solve(Ad, bd, method=method, M=M, nullspace="constant")
    assert res.status is Status.LEAST_SQUARES and res.iterations <= 1, res.message
    assert float(np.abs(host(res.x)).max()) == 0.0
    with Solver(Ad, method=method, M=M, nullspace="constant", rtol=1e-10) as solver:
        block = solver.solve(Bd)  # one column all in the null space, one with a reachable part
    assert list(block.column_status) == [Status.LEAST_SQUARES, Status.LEAST_SQUARES]
    X = host(block.x)
    assert np.abs(X[:, 0]).max() == 0.0
    want = np.linalg.lstsq(A.toarray(), B[:, 1], rcond=None)[0]
    want -= want.mean()
    assert np.linalg.norm(X[:, 1] - want) <= 1e-7 * np.linalg.norm(want)


def test_a_block_with_bad_columns_names_them_and_reports_its_preconditioner(backend):
    A = poisson2d(6)
    n = A.shape[0]
    B = np.ones((n, 4))
    B[3, 1], B[7, 3] = np.nan, np.inf
    Ad, Bd = on(backend, A, B)
    with Solver(Ad, method="cg", M="jacobi") as solver:
        with pytest.raises(ValueError, match=r"^Solver\.solve: b has NaN or Inf entries in "
                                             r"columns 1, 3; replace them with finite values"):
            solver.solve(Bd)
        good = solver.solve(Bd[:, [0, 2]])
    assert good.converged and good.info["preconditioner"] == "jacobi"


def test_every_error_names_the_solver_call_and_the_argument(backend):
    """Set-up errors name Solver(A), a solve's its own method; x0 of another shape than b's is the
    Solver's check (naming x0 and b's shape), not an engine's."""
    A = poisson2d(4)
    with pytest.raises(ValueError, match=r"^Solver\(A\): maxiter must be a positive integer"):
        Solver(A, maxiter=-1)
    with pytest.raises(TypeError, match=r"^Solver\(manager='cpu'\): expected a DeviceManager"):
        Solver(A, manager="cpu")
    # A device the call cannot use is named as the user wrote it (not as solve(device=...)).
    dm = DeviceManager(simulate="2x64MiB")
    with pytest.raises(ValueError, match=r"^Solver\(device=\.\.\.\): 'tpu:0' is not a device name"):
        Solver(A, device="tpu:0", manager=dm)
    with pytest.raises(RuntimeError, match=r"^Solver\(device='sim:7'\): sim:7 is not managed here"):
        Solver(A, device="sim:7", manager=dm)
    system = ms.LinearSystem(A, np.ones(16))
    with pytest.raises(RuntimeError, match=r"^Solver\.from_system\(device='sim:7'\): sim:7 is not"):
        Solver.from_system(system, device="sim:7", manager=dm)
    for b in (np.ones(16), np.ones((16, 2)), system):  # solve(A, b), solve(A, B), solve(system)
        args = (b,) if isinstance(b, ms.LinearSystem) else (A, b)
        with pytest.raises(RuntimeError, match=r"^solve\(device='sim:7'\): sim:7 is not managed"):
            solve(*args, device="sim:7", manager=dm)
    B = np.ones((16, 2))
    Ad, Bd = on(backend, A, B)
    for method in ("cg", "direct"):  # the fused CG core and a factorisation
        with Solver(Ad, method=method) as solver:
            for x0, got in ((np.ones((16, 3)), r"\(16, 3\)"), (np.ones(16), r"\(16,\)"),
                            (np.ones((15, 2)), r"\(15, 2\)")):
                with pytest.raises(ValueError, match=r"^Solver\.solve: x0 must have shape "
                                                     rf"\(16, 2\), b's.*got shape {got}"):
                    solver.solve(Bd, on(backend, x0))
            with pytest.raises(ValueError, match=r"^Solver\.solve: x0 must have shape \(16,\)"):
                solver.solve(Bd[:, 0], np.ones((16, 2)))
            with pytest.raises(ValueError, match=r"^Solver\.solve_transpose: b must have shape"):
                solver.solve_transpose(np.ones(15))
            with pytest.raises(ValueError, match=r"^Solver\.adjoint: g has NaN or Inf entries; "
                                                 "replace them"):
                solver.adjoint(np.full(16, np.inf))
            with pytest.raises(TypeError, match=r"^Solver\.solve: b must be a numeric array"):
                solver.solve([[1.0, 2.0], [3.0]])
            ref = sla.spsolve(A.tocsc(), B)
            got = solver.solve(Bd, on(backend, np.zeros((16, 2))))
            np.testing.assert_allclose(host(got.x), ref, rtol=1e-7)
