"""Batched GMRES against SciPy: per-system convergence, counts, statuses, preconditioning."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import LinearSystem, config
from managed_solve.solvers.batched import (
    GMRES_RESTART,
    ROWS_LAYOUT_MIN,
    PackedBatch,
    bicgstab_batched,
    gmres_batched,
    predict_bytes,
)
from managed_solve.solvers.batched.gmres import GMRES_CHECK_EVERY, BatchedGmres
from tests._problems import poisson2d_skew, upwind


@pytest.fixture(params=["cpu", "cpu-vectorised", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Where the batch lies; "cpu-vectorised" runs the device algorithm on NumPy."""
    with config.override(batched_gmres_vectorised_on_host=request.param == "cpu-vectorised"):
        yield "cuda:0" if request.param == "cuda" else "cpu"


def host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def skew_blocks(k=3):
    rot = sp.csr_matrix(np.array([[0.0, 1.0], [-1.0, 0.0]]))
    return sp.block_diag([(j + 1) * rot for j in range(k)], format="csr")


def scipy_gmres(A, b, *, rtol, restart):
    """SciPy's solution and its inner-iteration count (callback per inner step)."""
    count = [0]

    def cb(_):
        count[0] += 1

    x, info = spla.gmres(A, b, rtol=rtol, atol=0.0, restart=restart, maxiter=1000,
                         callback=cb, callback_type="pr_norm")
    return x, info, count[0]


def residual(A, x, b):
    return float(np.linalg.norm(b - A @ x))


def test_matches_scipy_on_a_mixed_nonsymmetric_batch(device):
    rng = np.random.default_rng(1)
    mats = [sp.csr_matrix(np.array([[3.0]])), skew_blocks(), upwind(5), poisson2d_skew(9),
            upwind(12, 0.9), poisson2d_skew(16, 0.3), sp.random(30, 30, 0.2, random_state=rng) + 6 * sp.eye(30)]
    mats = [sp.csr_matrix(A) for A in mats]
    bs = [rng.standard_normal(A.shape[0]) for A in mats]
    rtols = [1e-10, 1e-10, 1e-8, 1e-10, 1e-6, 1e-9, 1e-10]
    systems = [LinearSystem(A, b, rtol=r) for A, b, r in zip(mats, bs, rtols, strict=True)]
    batch = PackedBatch.pack(systems, device=device)
    out = gmres_batched(batch, restart=30)
    assert out.status.tolist() == [0] * len(mats)
    for k, (A, b, rtol, x) in enumerate(zip(mats, bs, rtols, batch.unpack(host(out.x)), strict=True)):
        bn = np.linalg.norm(b)
        assert residual(A, x, b) <= rtol * bn  # every system at its own tolerance
        assert out.residual_norms[k] == pytest.approx(residual(A, x, b), rel=1e-6, abs=1e-14 * bn)
        xr = spla.spsolve(A.tocsc(), b)
        np.testing.assert_allclose(x, xr, rtol=0, atol=np.linalg.cond(A.toarray()) * rtol * np.linalg.norm(xr))
        _x, info, its = scipy_gmres(A, b, rtol=rtol, restart=30)
        assert info == 0
        # Same Krylov spaces, same minimisation: the counts agree up to rounding
        # (SciPy re-checks the true residual at other points).
        assert abs(int(out.iterations[k]) - its) <= max(2, its // 20), (k, out.iterations[k], its)


def test_converges_where_bicgstab_breaks_down(device):
    A = skew_blocks(4)
    b = np.ones(8)
    batch = PackedBatch.pack([LinearSystem(A, b, rtol=1e-12)], device=device)
    assert int(bicgstab_batched(batch).status[0]) == 2
    out = gmres_batched(batch)
    # Eight distinct eigenvalues (+-i, +-2i, ...): the Krylov space fills R^8 in 8 steps.
    assert int(out.status[0]) == 0 and int(out.iterations[0]) == 8
    np.testing.assert_allclose(A @ host(out.x), b, atol=1e-12)


def test_short_restarts_still_converge_and_take_more_iterations(device):
    A, b = poisson2d_skew(12), np.random.default_rng(2).standard_normal(144)
    batch = PackedBatch.pack([LinearSystem(A, b, rtol=1e-9)], device=device)
    long, short = gmres_batched(batch, restart=40), gmres_batched(batch, restart=5)
    assert long.status[0] == 0 and short.status[0] == 0
    assert short.iterations[0] > long.iterations[0]
    for out in (long, short):
        assert residual(A, host(out.x), b) <= 1e-9 * np.linalg.norm(b)
    _x, _info, its5 = scipy_gmres(A, b, rtol=1e-9, restart=5)
    assert abs(int(short.iterations[0]) - its5) <= max(3, its5 // 10)


def test_per_system_maxiter_x0_and_zero_rhs(device):
    rng = np.random.default_rng(3)
    A = poisson2d_skew(10)
    b = rng.standard_normal(100)
    x_exact = spla.spsolve(A.tocsc(), b)
    systems = [LinearSystem(A, b, rtol=1e-10, maxiter=7),  # stops at 7 inner iterations
               LinearSystem(A, b, rtol=1e-10),
               LinearSystem(A, b, x0=x_exact, rtol=1e-8),  # already solved: no iteration
               LinearSystem(A, np.zeros(100))]
    batch = PackedBatch.pack(systems, device=device)
    out = gmres_batched(batch, restart=4)  # maxiter falls inside the second cycle
    assert out.status.tolist() == [1, 0, 0, 0]
    assert out.iterations.tolist()[0] == 7 and out.iterations.tolist()[2:] == [0, 0]
    xs = batch.unpack(host(out.x))
    assert residual(A, xs[0], b) > 1e-10 * np.linalg.norm(b)
    assert out.residual_norms[0] == pytest.approx(residual(A, xs[0], b), rel=1e-6)
    assert residual(A, xs[1], b) <= 1e-10 * np.linalg.norm(b)
    np.testing.assert_array_equal(xs[3], 0.0)


def test_jacobi_on_the_right_keeps_true_residuals_and_cuts_iterations(device):
    rng = np.random.default_rng(4)
    A = upwind(14)
    D = sp.diags(10.0 ** rng.uniform(-3, 3, A.shape[0]))
    S = (D @ A).tocsr()  # badly scaled rows
    b = rng.standard_normal(A.shape[0])
    plain = gmres_batched(PackedBatch.pack([LinearSystem(S, b, rtol=1e-8)], device=device))
    pj = PackedBatch.pack([LinearSystem(S, b, rtol=1e-8, M="jacobi")], device=device, jacobi=True)
    jac = gmres_batched(pj)
    assert jac.status[0] == 0
    x = host(jac.x)
    assert residual(S, x, b) <= 1e-8 * np.linalg.norm(b)
    assert jac.iterations[0] < plain.iterations[0] or plain.status[0] != 0


def test_float32(device):
    A = upwind(10).astype(np.float32)
    b = np.ones(100, dtype=np.float32)
    batch = PackedBatch.pack([LinearSystem(A, b, rtol=1e-5), LinearSystem(2 * A, b, rtol=1e-5)], device=device)
    out = gmres_batched(batch)
    assert out.status.tolist() == [0, 0]
    assert host(out.x).dtype == np.float32
    for M, x in zip((A, 2 * A), batch.unpack(host(out.x)), strict=True):
        assert residual(M.astype(np.float64), x.astype(np.float64), b.astype(np.float64)) <= 2e-5 * 10


def test_a_non_finite_system_breaks_down_alone(device):
    A = upwind(6)
    bad = np.ones(36)
    bad[4] = np.nan
    batch = PackedBatch.pack([LinearSystem(A, np.ones(36)), LinearSystem(A, np.ones(36))], device=device)
    batch.b[36 + 4] = np.nan  # PackedBatch.pack would refuse it; the core must still cope
    out = gmres_batched(batch)
    assert out.status.tolist() == [0, 2]
    assert residual(A, batch.unpack(host(out.x))[0], np.ones(36)) <= 1e-8 * 6


def test_checkpoint_spacing_does_not_change_the_answer(device):
    rng = np.random.default_rng(6)
    mats = [poisson2d_skew(m) for m in (5, 8, 11)]
    systems = [LinearSystem(A, rng.standard_normal(A.shape[0]), rtol=1e-9) for A in mats]
    batch = PackedBatch.pack(systems, device=device)
    a, c = gmres_batched(batch, check_every=1), gmres_batched(batch, check_every=30)
    assert a.iterations.tolist() == c.iterations.tolist()
    np.testing.assert_allclose(host(a.x), host(c.x), rtol=1e-12, atol=1e-13)
    if device != "cpu" or config.current().batched_gmres_vectorised_on_host:  # the per-system CPU kernel has no reads
        assert a.host_syncs > c.host_syncs


def test_cpu_kernel_and_device_algorithm_are_twins():
    """The per-system Numba GMRES and the whole-batch array algorithm take the same steps."""
    rng = np.random.default_rng(7)
    mats = [poisson2d_skew(m, 0.4) for m in (6, 9, 13)] + [upwind(11), skew_blocks(2)]
    systems = [LinearSystem(A, rng.standard_normal(A.shape[0]), rtol=1e-9, maxiter=150)
               for A in mats]
    systems.append(LinearSystem(mats[2], rng.standard_normal(169), rtol=1e-12, maxiter=20))
    batch = PackedBatch.pack(systems)
    kernel = gmres_batched(batch, restart=12)
    with config.override(batched_gmres_vectorised_on_host=True):
        arrays = gmres_batched(batch, restart=12)
    assert kernel.status.tolist() == arrays.status.tolist() == [0, 0, 0, 0, 0, 1]
    assert np.abs(kernel.iterations - arrays.iterations).max() <= 1
    assert kernel.iterations[-1] == arrays.iterations[-1] == 20
    np.testing.assert_allclose(kernel.x, arrays.x, rtol=0, atol=1e-7 * np.abs(kernel.x).max())


def test_bad_arguments():
    batch = PackedBatch.pack([LinearSystem(upwind(3), np.ones(9))])
    for bad in (0, -3, 2.5, "30", None, True):
        with pytest.raises(ValueError, match="restart must be a positive integer"):
            gmres_batched(batch, restart=bad)
    with pytest.raises(ValueError, match="check_every"):
        gmres_batched(batch, check_every=0)
    with pytest.raises(TypeError, match="PackedBatch"):
        gmres_batched("not a batch")
    assert GMRES_RESTART == 30


def test_memory_prediction_counts_the_device_workspace():
    """predict_bytes(method="gmres") holds the batch, x and GmresWorkspace's arrays."""
    from managed_solve.solvers.batched.workspace import POOL_ROUND, WORK_VECTORS

    assert WORK_VECTORS["gmres"] == GMRES_RESTART + 2
    rng = np.random.default_rng(9)
    systems = [LinearSystem(poisson2d_skew(m), rng.standard_normal(m * m)) for m in (30, 40, 50)]
    batch = PackedBatch.pack(systems)
    work = BatchedGmres(batch, GMRES_RESTART, GMRES_CHECK_EVERY)
    held = work.nbytes + batch.b.nbytes  # + x
    predicted = predict_bytes(batch.n, batch.nnz, batch.nsys, batch.dtype, batch.index_dtype, "gmres", jacobi=False, x0=False)
    assert batch.nbytes + held <= predicted <= batch.nbytes + held + 2 * 24 * POOL_ROUND + 4 * batch.n * 8


@pytest.mark.gpu
def test_gpu_memory_prediction_bounds_the_workspace():
    """On a GPU: the bytes CuPy's pool grows by during a solve stay within the prediction."""
    import cupy as cp

    rng = np.random.default_rng(10)
    systems = [LinearSystem(poisson2d_skew(m), rng.standard_normal(m * m), rtol=1e-10) for m in (60, 80, 100)]
    batch = PackedBatch.pack(systems, device="cuda:0")
    pool = cp.get_default_memory_pool()
    gmres_batched(batch)  # kernels and cuSPARSE set up
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    base = pool.total_bytes()
    out = gmres_batched(batch)
    cp.cuda.Device().synchronize()
    grown = pool.total_bytes() - base  # the pool keeps freed blocks: about the peak held
    assert (out.status == 0).all()
    predicted = predict_bytes(batch.n, batch.nnz, batch.nsys, batch.dtype, batch.index_dtype, "gmres", jacobi=False, x0=False)
    assert grown <= predicted - batch.nbytes, (grown, predicted - batch.nbytes)


@pytest.mark.gpu
def test_gpu_compaction_at_restart_keeps_the_answers():
    """Once the running systems hold at most half the rows, the kernels walk only theirs."""
    rng = np.random.default_rng(11)
    easy = [(upwind(40, 0.3) + 4 * sp.identity(1600)).tocsr() for _ in range(30)]  # a few steps
    hard = [poisson2d_skew(100, 0.5)]  # hundreds of steps, over several restarts
    systems = [LinearSystem(A, rng.standard_normal(A.shape[0]), rtol=1e-9) for A in easy + hard]
    batch = PackedBatch.pack(systems, device="cuda:0")
    packed = gmres_batched(batch)
    assert packed.compactions == 1 and (packed.status == 0).all()
    with config.override(batched_compact_fraction=0.0):
        whole = gmres_batched(batch)
    assert whole.compactions == 0
    assert packed.iterations.tolist() == whole.iterations.tolist()
    np.testing.assert_allclose(host(packed.x), host(whole.x), rtol=0, atol=1e-10 * np.abs(host(whole.x)).max())
    for s, x in zip(systems, batch.unpack(host(packed.x)), strict=True):
        assert residual(s.A, x, s.b) <= 1e-9 * np.linalg.norm(s.b)


@pytest.mark.gpu
@pytest.mark.parametrize("every", [8, 3])
def test_gpu_graph_replay_keeps_the_answers(every):
    """Chunks replayed as CUDA graphs (from the second restart cycle on) compute what direct launches do."""
    rng = np.random.default_rng(12)
    systems = [LinearSystem(poisson2d_skew(m, 0.5), rng.standard_normal(m * m), rtol=1e-10)
               for m in (20, 33, 47)]
    systems.append(LinearSystem(upwind(30), rng.standard_normal(900), rtol=1e-10, M="jacobi"))
    batch = PackedBatch.pack(systems, device="cuda:0", jacobi=True)
    graphs = gmres_batched(batch, check_every=every)
    with config.override(batched_gmres_graphs=False):
        direct = gmres_batched(batch, check_every=every)
    assert (graphs.status == 0).all() and graphs.iterations.max() > 3 * GMRES_RESTART
    assert graphs.iterations.tolist() == direct.iterations.tolist()
    np.testing.assert_allclose(host(graphs.x), host(direct.x), rtol=0, atol=1e-12 * np.abs(host(direct.x)).max())


def test_one_large_cpu_system_takes_the_blas_gmres_with_the_same_iterates():
    """On the CPU a single system of ROWS_LAYOUT_MIN rows or more runs cpu.gmres_one (BLAS products).

    Its iterates are the generic single-system GMRES's (same algorithm, a host
    read every step) and, within one iteration, the per-system kernel's.
    """
    from managed_solve.solvers.gmres import gmres

    A = upwind(110, 0.6)  # 12,100 rows
    b = np.random.default_rng(13).standard_normal(A.shape[0])
    assert A.shape[0] >= ROWS_LAYOUT_MIN
    dinv = 1.0 / A.diagonal()
    for jacobi in (False, True):
        M = (lambda v: dinv * v) if jacobi else None
        batch = PackedBatch.pack([LinearSystem(A, b, rtol=1e-9, maxiter=40)], jacobi=jacobi)
        short = gmres_batched(batch)
        assert short.status.tolist() == [1] and short.iterations.tolist() == [40]
        assert short.residual_norms[0] == pytest.approx(residual(A, short.x, b), rel=1e-12)
        generic = gmres(A, b, rtol=1e-9, maxiter=40, M=M)
        np.testing.assert_array_equal(short.x, generic.x)
        batch = PackedBatch.pack([LinearSystem(A, b, rtol=1e-9)], jacobi=jacobi)
        one = gmres_batched(batch)
        assert one.status.tolist() == [0] and residual(A, one.x, b) <= 1e-9 * np.linalg.norm(b)
        generic = gmres(A, b, rtol=1e-9, M=M)
        assert one.iterations.tolist() == [generic.iterations]
        np.testing.assert_array_equal(one.x, generic.x)
        small = PackedBatch.pack([LinearSystem(A, b, rtol=1e-9), LinearSystem(upwind(4), np.ones(16))],
                                 jacobi=jacobi)
        kernel = gmres_batched(small)  # two systems: the per-system kernel
        assert abs(int(kernel.iterations[0]) - int(one.iterations[0])) <= 1
