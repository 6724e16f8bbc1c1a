"""BatchedEngine (``solvers/batched/engine.py``): prepare once, solve, update, solve_transpose."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import LinearSystem
from managed_solve.solvers.batched import BatchedEngine, PackedBatch, cg_batched
from managed_solve.solvers.bicgstab import bicgstab_fused
from managed_solve.solvers.cg import cg_fused
from managed_solve.solvers.engine import Options
from managed_solve.solvers.gmres import gmres_fused
from tests._problems import laplacian1d, poisson2d, upwind

FUSED = {"cg": cg_fused, "bicgstab": bicgstab_fused, "gmres": gmres_fused}


def matrix(method):
    return poisson2d(9) if method == "cg" else upwind(9, 0.5)


def prepare(A, method, *, jacobi=False, device="cpu", **kw):
    opts = Options(method=method, M="jacobi" if jacobi else None, rtol=1e-10, **kw)
    return BatchedEngine().prepare(A, opts, device)


@pytest.mark.parametrize("jacobi", [False, True])
@pytest.mark.parametrize("method", ["cg", "bicgstab", "gmres"])
def test_solve_matches_spsolve_and_the_fused_wrapper(method, jacobi):
    A = matrix(method)
    rng = np.random.default_rng(1)
    prepared = prepare(A, method, jacobi=jacobi)
    assert prepared.engine == "batched" and prepared.n == A.shape[0]
    for _ in range(2):  # the packed operator is reused
        b = rng.standard_normal(A.shape[0])
        out = prepared.solve(b)
        ref = FUSED[method](A, b, rtol=1e-10, jacobi=jacobi)
        assert out.code == ref.code == 0
        assert out.iterations == ref.iterations
        np.testing.assert_array_equal(out.x, ref.x)
        np.testing.assert_allclose(out.x, spla.spsolve(A.tocsc(), b), rtol=0, atol=1e-8)


@pytest.mark.parametrize("method", ["cg", "bicgstab", "gmres"])
def test_a_block_of_right_hand_sides_is_one_batch_of_columns(method):
    A = matrix(method)
    rng = np.random.default_rng(2)
    B = rng.standard_normal((A.shape[0], 3))
    B[:, 1] = 0.0  # a zero column converges at once, alone
    X0 = rng.standard_normal(B.shape)
    prepared = prepare(A, method)
    outs = prepared.solve(B, X0)
    assert len(outs) == 3
    for j, out in enumerate(outs):
        one = prepared.solve(B[:, j], X0[:, j])
        assert out.code == one.code == 0
        assert abs(out.iterations - one.iterations) <= (0 if method != "bicgstab" else 1)
        np.testing.assert_allclose(out.x, spla.spsolve(A.tocsc(), B[:, j]), rtol=0, atol=1e-8)
        assert out.info["systems"] == 3
    zero = prepared.solve(B)[1]
    assert zero.iterations == 0 and not zero.x.any()
    # The same as packing the k systems by hand.
    if method == "cg":
        manual = cg_batched(PackedBatch.pack([LinearSystem(A, B[:, j], rtol=1e-10) for j in range(3)]))
        assert [o.iterations for o in prepared.solve(B)] == manual.iterations.tolist()
    assert prepared.solve(np.zeros((A.shape[0], 0))) == []


def test_update_replaces_values_on_the_same_pattern():
    A = upwind(8, 0.5)
    b = np.random.default_rng(3).standard_normal(A.shape[0])
    prepared = prepare(A, "bicgstab", jacobi=True)
    first = prepared.solve(b)
    A2 = A.copy()
    A2.data = A2.data * 1.5 + (A2.indices == np.repeat(np.arange(A.shape[0]), np.diff(A.indptr)))
    prepared.update(A2)
    again = prepared.solve(b)
    fresh = prepare(A2, "bicgstab", jacobi=True).solve(b)
    assert again.iterations == fresh.iterations
    np.testing.assert_array_equal(again.x, fresh.x)
    np.testing.assert_allclose(again.x, spla.spsolve(A2.tocsc(), b), rtol=0, atol=1e-8)
    assert not np.allclose(first.x, again.x)
    prepared.update(A.data)  # the values alone
    np.testing.assert_array_equal(prepared.solve(b).x, first.x)
    other = (A + sp.eye(A.shape[0], k=3)).tocsr()
    with pytest.raises(ValueError, match="another sparsity pattern.*prepare"):
        prepared.update(other)
    with pytest.raises(ValueError, match=f"expected {A.nnz} values"):
        prepared.update(np.ones(3))


def test_solve_transpose_of_a_non_symmetric_matrix_prepares_the_transpose_once():
    A = upwind(8, 0.6)
    b = np.random.default_rng(4).standard_normal(A.shape[0])
    prepared = prepare(A, "gmres")
    y = prepared.solve_transpose(b)
    assert y.code == 0
    np.testing.assert_allclose(y.x, spla.spsolve(A.T.tocsc(), b), rtol=0, atol=1e-8)
    transposed = prepared.transposed
    assert transposed is not None
    prepared.solve_transpose(b)
    assert prepared.transposed is transposed  # prepared once
    A2 = A.copy()
    A2.data = A2.data * 2.0
    prepared.update(A2)
    y2 = prepared.solve_transpose(b)
    np.testing.assert_allclose(y2.x, spla.spsolve(A2.T.tocsc(), b), rtol=0, atol=1e-8)


def test_solve_transpose_of_a_symmetric_matrix_is_the_same_solve():
    A = poisson2d(7)
    b = np.random.default_rng(5).standard_normal(A.shape[0])
    prepared = prepare(A, "cg", symmetric=True)
    np.testing.assert_array_equal(prepared.solve_transpose(b).x, prepared.solve(b).x)
    assert prepared.transposed is None


def test_simulated_gpu_device_and_close():
    A = poisson2d(4)
    b = np.ones(A.shape[0])
    with prepare(A, "cg", device="sim:0") as prepared:
        out = prepared.solve(b)
        assert out.code == 0 and isinstance(out.x, np.ndarray)
    with pytest.raises(RuntimeError, match="closed"):
        prepared.solve(b)


def test_options_the_engine_cannot_run_are_refused():
    A = poisson2d(3)
    with pytest.raises(ValueError, match="'cg', 'bicgstab' or 'gmres'"):
        prepare(A, "minres")
    with pytest.raises(ValueError, match="M=None or M='jacobi'"):
        BatchedEngine().prepare(A, Options(method="cg", M=lambda v: v), "cpu")
    with pytest.raises(ValueError, match="callback"):
        BatchedEngine().prepare(A, Options(method="cg", callback=print), "cpu")
    with pytest.raises(TypeError, match="sparse matrix"):
        BatchedEngine().prepare(A.toarray(), Options(method="cg"), "cpu")
    with pytest.raises(ValueError, match="shape"):
        prepare(A, "cg").solve(np.ones(4))


def test_a_strided_right_hand_side_gives_the_contiguous_answer():
    """A column of a row-major block is a strided view; the kernels need contiguous vectors."""

    from managed_solve.solvers.cg import cg_fused

    A = laplacian1d(30)
    B = np.random.default_rng(3).standard_normal((30, 4))
    strided = cg_fused(A, B[:, 2], rtol=1e-12)
    dense = cg_fused(A, np.ascontiguousarray(B[:, 2]), rtol=1e-12)
    np.testing.assert_array_equal(strided.x, dense.x)


# -- the batch entry: many systems, each its own matrix and right-hand side (solve_many's route)
@pytest.mark.parametrize("jacobi", [False, True])
@pytest.mark.parametrize("method", ["cg", "bicgstab", "gmres"])
def test_a_prepared_batch_solves_as_the_batched_core_does(method, jacobi):
    from managed_solve.solvers.batched import bicgstab_batched, gmres_batched

    core = {"cg": cg_batched, "bicgstab": bicgstab_batched, "gmres": gmres_batched}[method]
    rng = np.random.default_rng(7)
    mats = [poisson2d(5), matrix(method), poisson2d(7), matrix(method)]
    systems = [LinearSystem(A, rng.standard_normal(A.shape[0]), rtol=1e-9 * (k + 1))
               for k, A in enumerate(mats)]
    prepared = BatchedEngine().prepare_batch(systems, "cpu", jacobi=jacobi, method=method)
    assert prepared.engine == "batched" and prepared.batch.nsys == 4
    assert (prepared.batch.dinv is not None) == jacobi
    out = prepared.solve()
    ref = core(PackedBatch.pack(systems, jacobi=jacobi))
    np.testing.assert_array_equal(out.status, ref.status)
    np.testing.assert_array_equal(out.iterations, ref.iterations)
    np.testing.assert_array_equal(out.x, ref.x)
    for s, x in zip(systems, prepared.batch.unpack(out.x), strict=True):
        assert np.linalg.norm(s.b - s.A @ x) <= 10 * s.rtol * np.linalg.norm(s.b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("method", ["cg", "bicgstab", "gmres"])
@pytest.mark.parametrize("count", [1, 5])
def test_a_prepared_batch_reports_each_systems_true_norms(device, method, count):
    """Every solve of a prepared batch carries ||b_s - A_s x_s|| and ||b_s|| of the x it returns.

    One system and CG or BiCGStab on a GPU: the row loop computes them at its end; several
    CG systems: the kernel with a block per system; GMRES: one pass after the core.
    """
    rng = np.random.default_rng(21)
    mats = [poisson2d(int(m)) if method == "cg" else upwind(int(m)) for m in rng.integers(4, 12, count)]
    systems = [LinearSystem(A, rng.standard_normal(A.shape[0]), rtol=1e-9) for A in mats]
    prepared = BatchedEngine().prepare_batch(systems, device, method=method)
    out = prepared.solve()
    assert out.true_norms is not None and (out.status == 0).all()
    rn, bn = out.true_norms
    xs = prepared.batch.unpack(out.x)
    for k, (s, x) in enumerate(zip(systems, xs, strict=True)):
        x = x if isinstance(x, np.ndarray) else x.get()
        assert rn[k] == pytest.approx(np.linalg.norm(s.b - s.A @ x), rel=1e-9, abs=1e-14)
        assert bn[k] == pytest.approx(np.linalg.norm(s.b), rel=1e-12)
        assert rn[k] <= 10 * s.rtol * bn[k]


def test_the_true_norms_of_one_large_host_gmres_system():
    """The core's large-system GMRES reports none itself: the engine computes them."""
    n = 10_000
    A = sp.diags([-1.0, 4.0, -1.5], [-1, 0, 1], shape=(n, n), format="csr")
    b = np.random.default_rng(3).standard_normal(n)
    out = BatchedEngine().prepare_batch([LinearSystem(A, b, rtol=1e-10)], "cpu", method="gmres").solve()
    rn, bn = out.true_norms
    assert out.status.tolist() == [0]
    assert rn[0] == pytest.approx(np.linalg.norm(b - A @ out.x), rel=1e-9)
    assert bn[0] == pytest.approx(np.linalg.norm(b), rel=1e-12) and rn[0] <= 1e-10 * bn[0]


@pytest.mark.gpu
def test_gpu_a_row_loop_with_true_norms_keeps_nothing_for_queued_work():
    """The norms' read waits for every queued iteration, so the solve retires nothing."""
    import cupy as cp

    from managed_solve.solvers.batched import cuda

    rng = np.random.default_rng(4)
    systems = [LinearSystem(poisson2d(30), rng.standard_normal(900))]
    prepared = BatchedEngine().prepare_batch(systems, "cuda:0", method="cg")
    cp.cuda.Device(0).synchronize()
    cuda.release_done()  # all earlier work is done: the queue is empty
    assert len(cuda.RETIRED) == 0
    out = prepared.solve()
    assert out.status.tolist() == [0] and len(cuda.RETIRED) == 0


@pytest.mark.gpu
def test_gpu_a_row_loop_whose_norms_fail_still_keeps_what_queued_work_reads(monkeypatch):
    """An error computing the norms (here no memory for their sums) leaves the queued
    iterations' workspace kept until they end, and reaches the caller."""
    import cupy as cp

    from managed_solve.solvers.batched import cuda
    from managed_solve.solvers.batched import gpu as batched_gpu

    rng = np.random.default_rng(4)
    prepared = BatchedEngine().prepare_batch([LinearSystem(poisson2d(30), rng.standard_normal(900))],
                                             "cuda:0", method="cg")
    cp.cuda.Device(0).synchronize()
    cuda.release_done()  # all earlier work is done: the queue is empty
    before = len(cuda.RETIRED)
    assert before == 0

    def no_memory(*args, **kwargs):
        raise cp.cuda.memory.OutOfMemoryError(16, 0, 0)

    monkeypatch.setattr(cp, "zeros", no_memory)  # only the norms' sums allocate in the loop
    with pytest.raises(cp.cuda.memory.OutOfMemoryError):
        prepared.solve()
    monkeypatch.undo()
    # Iterations still queued when the host saw every system stop (the usual case; none
    # when the host came late and the GPU had run them all): the workspace is kept for them.
    kept = cuda.RETIRED.held()[before:]
    assert len(kept) <= 1
    assert all(any(isinstance(obj, batched_gpu.FusedSolve) for obj in k) for k in kept)
    cp.cuda.Device(0).synchronize()
    cuda.release_done()
    assert len(cuda.RETIRED) == before


def test_a_prepared_batch_takes_new_right_hand_sides_and_a_method_when_solved():
    A = poisson2d(6)
    systems = [LinearSystem(A, np.ones(36)), LinearSystem(2 * A, np.arange(36.0))]
    prepared = BatchedEngine().prepare_batch(systems)  # no method yet (a deferred one)
    with pytest.raises(ValueError, match="give the method"):
        prepared.solve()
    base = prepared.solve(method="cg")
    doubled = prepared.solve(2.0 * prepared.batch.b, method="cg")
    np.testing.assert_allclose(doubled.x, 2.0 * base.x, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(prepared.batch.b[:36], 1.0)  # the batch keeps its own b
    with pytest.raises(ValueError, match="'cg', 'bicgstab' or 'gmres'"):
        prepared.solve(method="minres")
    # A batch packed already is taken as it is.
    again = BatchedEngine().prepare_batch(prepared.batch, method="cg")
    assert again.batch is prepared.batch
    np.testing.assert_array_equal(again.solve().x, base.x)


def test_a_deferred_method_is_found_only_where_a_workspace_is_built():
    """On the host no workspace is built, so a deferred method is not waited for."""
    asked = []
    systems = [LinearSystem(poisson2d(5), np.ones(25))]
    prepared = BatchedEngine().prepare_batch(systems, "sim:0", method=lambda: asked.append(1) or "cg")
    assert asked == [] and prepared.method is None
    assert prepared.solve(method="cg").status.tolist() == [0]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cg", "bicgstab", "gmres"])
def test_gpu_a_prepared_batch_builds_its_workspace_once_and_solves_as_the_core(method):
    import cupy as cp

    from managed_solve.solvers.batched import bicgstab_batched, gmres_batched

    core = {"cg": cg_batched, "bicgstab": bicgstab_batched, "gmres": gmres_batched}[method]
    rng = np.random.default_rng(8)
    systems = [LinearSystem(matrix(method), rng.standard_normal(81), rtol=1e-9) for _ in range(3)]
    asked = []
    prepared = BatchedEngine().prepare_batch(systems, "cuda:0",
                                             method=lambda: asked.append(1) or method)
    assert asked == [1] and prepared.method == method
    assert isinstance(prepared.batch.data, cp.ndarray)
    assert (prepared.batch.workspace is not None) == (method != "gmres")  # GMRES has no fused one
    out = prepared.solve()
    assert prepared.batch.workspace is None  # used once
    ref = core(PackedBatch.pack(systems, device="cuda:0"))
    assert (out.status == 0).all() and (np.abs(out.iterations - ref.iterations) <= 1).all()
    np.testing.assert_allclose(cp.asnumpy(out.x), cp.asnumpy(ref.x), rtol=1e-6, atol=1e-9)
