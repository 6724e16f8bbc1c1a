"""Batched CG and BiCGStab (``solvers/batched/cg.py``, ``bicgstab.py``, ``gpu.py``) against SciPy."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import LinearSystem, config
from managed_solve.solvers import batched
from managed_solve.solvers.batched import ROWS_LAYOUT_MIN, PackedBatch, bicgstab_batched, cg_batched
from tests._problems import laplacian1d, poisson2d, random_gram_spd, symmetrically_scaled, upwind


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return "cpu" if request.param == "cpu" else "cuda:0"


def host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def scipy_reference(solver, A, b, *, rtol, atol=0.0, maxiter=None, M=None, x0=None):
    count = [0]

    def cb(_):
        count[0] += 1

    x, info = solver(A, b, x0=x0, rtol=rtol, atol=atol, maxiter=maxiter, M=M, callback=cb)
    return x, info, count[0]


def true_residual(A, x, b):
    return float(np.linalg.norm(b - A @ x))


def mixed_spd(rng):
    """Sizes 1, 2, random SPD and Poisson of several sizes, a zero right-hand side."""
    mats = [sp.csr_matrix(np.array([[4.0]])), random_gram_spd(2, rng, 1.0), poisson2d(7),
            random_gram_spd(40, rng), poisson2d(16), poisson2d(5)]
    bs = [rng.standard_normal(A.shape[0]) for A in mats]
    bs[5][:] = 0.0
    return mats, bs


@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_matches_scipy_on_mixed_spd_batch(device, method):
    rng = np.random.default_rng(0)
    mats, bs = mixed_spd(rng)
    rtol = 1e-9
    systems = [LinearSystem(A, b, rtol=rtol, maxiter=500) for A, b in zip(mats, bs, strict=True)]
    batch = PackedBatch.pack(systems, device=device)
    solve = cg_batched if method == "cg" else bicgstab_batched
    out = solve(batch)
    ref_solver = spla.cg if method == "cg" else spla.bicgstab
    xs = [host(v) for v in batch.unpack(out.x)]
    assert out.status.tolist() == [0] * 6
    for k, (A, b) in enumerate(zip(mats, bs, strict=True)):
        x_ref, info, its = scipy_reference(ref_solver, A, b, rtol=rtol, maxiter=500)
        assert info == 0
        bnorm = np.linalg.norm(b)
        if bnorm == 0:
            assert out.iterations[k] == 0 and not xs[k].any()
            continue
        # Same algorithm, same iterates: counts agree up to rounding (and
        # BiCGStab's half step, which SciPy does not report to the callback).
        assert abs(int(out.iterations[k]) - its) <= 2, (k, out.iterations[k], its)
        np.testing.assert_allclose(xs[k], x_ref, rtol=0, atol=1e-7 * np.linalg.norm(x_ref))
        assert true_residual(A, xs[k], b) <= 10 * rtol * bnorm
        assert out.residual_norms[k] <= rtol * bnorm


def test_per_system_rtol_checked_on_true_residual(device):
    rng = np.random.default_rng(1)
    A = poisson2d(12)
    b = rng.standard_normal(A.shape[0])
    rtols = [1e-2, 1e-5, 1e-8, 1e-11]
    systems = [LinearSystem(A, b, rtol=r) for r in rtols]
    out = cg_batched(PackedBatch.pack(systems, device=device))
    assert (out.status == 0).all()
    its = out.iterations.tolist()
    assert its == sorted(its) and its[0] < its[-1]  # a tighter rtol costs more iterations
    for r, x, k in zip(rtols, PackedBatch.pack(systems).unpack(host(out.x)), its, strict=True):
        assert true_residual(A, x, b) <= r * np.linalg.norm(b) * 1.01
        _, _, its_ref = scipy_reference(spla.cg, A, b, rtol=r)
        assert abs(k - its_ref) <= 1


def test_atol_and_x0(device):
    rng = np.random.default_rng(2)
    A = poisson2d(9)
    x_true = rng.standard_normal(A.shape[0])
    b = A @ x_true
    near = x_true + 1e-3 * rng.standard_normal(A.shape[0])
    systems = [
        LinearSystem(A, b, rtol=1e-12),
        LinearSystem(A, b, x0=near, rtol=1e-12),
        LinearSystem(A, b, x0=x_true, rtol=1e-12),
        LinearSystem(A, b, rtol=0.0, atol=1e-3),
        LinearSystem(A, np.zeros_like(b), x0=near),  # b = 0: x = 0 whatever x0
    ]
    batch = PackedBatch.pack(systems, device=device)
    out = cg_batched(batch)
    xs = [host(v) for v in batch.unpack(out.x)]
    assert out.status.tolist() == [0] * 5
    assert out.iterations[2] == 0 and out.iterations[4] == 0
    assert not xs[4].any()
    np.testing.assert_allclose(xs[0], x_true, atol=1e-9)
    np.testing.assert_allclose(xs[1], x_true, atol=1e-9)
    assert out.iterations[1] <= out.iterations[0]
    assert true_residual(A, xs[3], b) <= 1.01e-3 < true_residual(A, xs[0] * 0, b)
    _, _, its_ref = scipy_reference(spla.cg, A, b, rtol=1e-12, x0=near)
    assert abs(int(out.iterations[1]) - its_ref) <= 1


@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_per_system_maxiter(device, method):
    rng = np.random.default_rng(3)
    A = poisson2d(10)
    b = rng.standard_normal(A.shape[0])
    systems = [LinearSystem(A, b, rtol=1e-10, maxiter=m) for m in (3, 7, 1000)]
    batch = PackedBatch.pack(systems, device=device)
    solve = cg_batched if method == "cg" else bicgstab_batched
    out = solve(batch)
    assert out.status.tolist() == [1, 1, 0]
    assert out.iterations[:2].tolist() == [3, 7] and 7 < out.iterations[2] < 1000
    xs = [host(v) for v in batch.unpack(out.x)]
    ref_solver = spla.cg if method == "cg" else spla.bicgstab
    for k, m in enumerate((3, 7)):
        x_ref, info, _ = scipy_reference(ref_solver, A, b, rtol=1e-10, maxiter=m)
        assert info == m  # SciPy also stopped at maxiter, at the same iterate
        np.testing.assert_allclose(xs[k], x_ref, atol=1e-10 * np.linalg.norm(x_ref))
    # A system stopped at maxiter did not change after its stop: its recurrence
    # residual is the one SciPy's iterate has.
    assert out.residual_norms[0] == pytest.approx(true_residual(A, xs[0], b), rel=1e-6)


def test_cg_breakdown_on_indefinite_system(device):
    rng = np.random.default_rng(4)
    n = 30
    d = np.linspace(-1.0, 2.0, n)
    d[np.abs(d) < 0.1] = 0.5
    indefinite = sp.diags(d).tocsr() + sp.diags([0.05, 0.05], [-1, 1], shape=(n, n)).tocsr()
    systems = [LinearSystem(poisson2d(5), rng.standard_normal(25)),
               LinearSystem(indefinite, rng.standard_normal(n), maxiter=500)]
    out = cg_batched(PackedBatch.pack(systems, device=device))
    assert out.status.tolist() == [0, 2]
    assert out.iterations[1] < 500


def test_bicgstab_matches_scipy_on_nonsymmetric(device):
    rng = np.random.default_rng(5)
    mats = [upwind(m, pe) for m, pe in ((4, 0.2), (9, 0.5), (15, 0.8))]
    bs = [rng.standard_normal(A.shape[0]) for A in mats]
    systems = [LinearSystem(A, b, rtol=1e-10, maxiter=400) for A, b in zip(mats, bs, strict=True)]
    batch = PackedBatch.pack(systems, device=device)
    out = bicgstab_batched(batch)
    assert (out.status == 0).all()
    for k, (A, b, x) in enumerate(zip(mats, bs, batch.unpack(host(out.x)), strict=True)):
        x_ref, info, its = scipy_reference(spla.bicgstab, A, b, rtol=1e-10, maxiter=400)
        assert info == 0
        assert abs(int(out.iterations[k]) - its) <= 2
        np.testing.assert_allclose(x, x_ref, atol=1e-8 * np.linalg.norm(x_ref))
        assert true_residual(A, x, b) <= 1e-9 * np.linalg.norm(b)


@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_jacobi_reduces_iterations_on_badly_scaled_spd(device, method):
    rng = np.random.default_rng(6)
    A = symmetrically_scaled(poisson2d(8), 10.0 ** rng.uniform(-2, 2, 64))
    b = rng.standard_normal(A.shape[0])
    systems = [LinearSystem(A, b, rtol=1e-8, maxiter=5000)]
    plain = PackedBatch.pack(systems, device=device)
    jac = PackedBatch.pack(systems, device=device, jacobi=True)
    solve = cg_batched if method == "cg" else bicgstab_batched
    o_plain, o_jac = solve(plain), solve(jac)
    assert o_jac.status[0] == 0
    assert o_jac.iterations[0] < 0.5 * o_plain.iterations[0]
    x = host(o_jac.x)
    assert true_residual(A, x, b) <= 1e-7 * np.linalg.norm(b)
    # Preconditioned iterates are SciPy's with M = diag(A)^-1.
    ref_solver = spla.cg if method == "cg" else spla.bicgstab
    x_ref, info, its = scipy_reference(ref_solver, A, b, rtol=1e-8, maxiter=5000,
                                       M=sp.diags(1.0 / A.diagonal()))
    assert info == 0 and abs(int(o_jac.iterations[0]) - its) <= 2
    np.testing.assert_allclose(x, x_ref, atol=1e-6 * np.linalg.norm(x_ref))


@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_float32(device, method):
    rng = np.random.default_rng(7)
    A = poisson2d(12)
    b = rng.standard_normal(A.shape[0])
    s32 = LinearSystem(A.astype(np.float32), b.astype(np.float32), rtol=1e-5)
    batch = PackedBatch.pack([s32, s32], device=device)
    assert batch.dtype == np.float32
    solve = cg_batched if method == "cg" else bicgstab_batched
    out = solve(batch)
    assert (out.status == 0).all() and out.x.dtype == np.float32
    x_ref = spla.spsolve(A.tocsc(), b)
    for x in batch.unpack(host(out.x)):
        assert true_residual(A, x.astype(np.float64), b) <= 5e-5 * np.linalg.norm(b)
        np.testing.assert_allclose(x, x_ref, atol=1e-3 * np.linalg.norm(x_ref))


@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_int64_indices_give_the_same_answer(device, method):
    rng = np.random.default_rng(8)
    systems = [LinearSystem(poisson2d(m), rng.standard_normal(m * m), rtol=1e-10) for m in (3, 6)]
    solve = cg_batched if method == "cg" else bicgstab_batched
    narrow = PackedBatch.pack(systems, device=device)
    wide = PackedBatch.pack(systems, device=device, index_dtype=np.int64)
    assert narrow.indices.dtype == np.int32 and wide.indices.dtype == np.int64
    a, c = solve(narrow), solve(wide)
    assert a.iterations.tolist() == c.iterations.tolist() and (c.status == 0).all()
    np.testing.assert_allclose(host(c.x), host(a.x), rtol=1e-12, atol=1e-14)


@pytest.fixture
def row_parallel():
    """The row-parallel CPU layout for one system, whatever this host's size (the policy keeps
    it for large systems on hosts of four cores or more)."""
    with config.override(host_row_parallel_min_rows=0, host_row_parallel_min_cores=1):
        yield


@pytest.mark.usefixtures("row_parallel")
def test_from_csr_single_system_row_layout(device):
    """One large system takes the row-parallel CPU layout; same iterates as SciPy."""
    m = int(np.ceil(np.sqrt(ROWS_LAYOUT_MIN))) + 1
    A = poisson2d(m)
    b = np.ones(A.shape[0])
    if device != "cpu":
        import cupy as cp
        import cupyx.scipy.sparse as csp

        A_d, b_d = csp.csr_matrix(A), cp.asarray(b)
    else:
        A_d, b_d = A, b
    for solve, ref in ((cg_batched, spla.cg), (bicgstab_batched, spla.bicgstab)):
        out = solve(PackedBatch.from_csr(A_d, b_d, rtol=1e-6, maxiter=2000))
        x_ref, info, its = scipy_reference(ref, A, b, rtol=1e-6, maxiter=2000)
        assert out.status[0] == 0 and info == 0
        # Over 100+ iterations BiCGStab's iterates feel the summation order of
        # the parallel dot products (112 vs SciPy's 121 seen on an H200); CG's
        # stay within two iterations.
        assert abs(int(out.iterations[0]) - its) <= max(2, (0.05 if solve is cg_batched else 0.1) * its)
        np.testing.assert_allclose(host(out.x), x_ref, atol=1e-4 * np.linalg.norm(x_ref))


def test_bad_arguments():
    A = poisson2d(3)
    with pytest.raises(TypeError, match="PackedBatch"):
        cg_batched((A, np.ones(9)))
    with pytest.raises(ValueError, match="check_every"):
        bicgstab_batched(PackedBatch.from_csr(A, np.ones(9)), check_every=0)


# -- GPU only: memory and synchronisation behaviour ----------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_gpu_no_allocation_inside_the_loop(method):
    import cupy as cp

    pool = cp.get_default_memory_pool()
    A = poisson2d(128)
    b = np.ones(A.shape[0])
    # rtol 1e-30 is out of reach and 300 iterations stay well above rounding
    # level here (on 64 x 64, BiCGStab reached it and broke down at 297 once):
    # both solves stop at maxiter.
    batch = PackedBatch.from_csr(*_to_gpu(A, b), rtol=1e-30, maxiter=40)
    batch_long = PackedBatch.from_csr(*_to_gpu(A, b), rtol=1e-30, maxiter=300)
    solve = cg_batched if method == "cg" else bicgstab_batched
    out = solve(batch)  # compiles, warms the pool
    del out
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    used0, total0 = pool.used_bytes(), pool.total_bytes()
    short = solve(batch)
    cp.cuda.Device().synchronize()
    short_total = pool.total_bytes() - total0
    del short
    pool.free_all_blocks()
    total1 = pool.total_bytes()
    long = solve(batch_long)
    cp.cuda.Device().synchronize()
    long_total = pool.total_bytes() - total1
    assert long.iterations[0] == 300 and long.status[0] == 1
    # 8x the iterations, the same bytes: nothing is allocated per iteration.
    assert long_total == short_total
    # The workspace is the solution plus at most 3 (CG) or 5 (BiCGStab) vectors.
    vec = A.shape[0] * 8
    assert short_total <= (1 + (3 if method == "cg" else 5)) * (vec + 512) + 64 * 1024
    del long
    assert pool.used_bytes() == used0


@pytest.mark.gpu
def test_gpu_maxiter_reached_drains_the_queue_once():
    A = poisson2d(256)  # rtol 1e-30 needs about 1,400 CG iterations here
    b = np.ones(A.shape[0])
    out_a = cg_batched(PackedBatch.from_csr(*_to_gpu(A, b), rtol=1e-30, atol=0.0, maxiter=100))
    out_b = cg_batched(PackedBatch.from_csr(*_to_gpu(A, b), rtol=1e-30, atol=0.0, maxiter=1000))
    assert out_a.iterations[0] == 100 and out_b.iterations[0] == 1000
    assert out_a.status[0] == 1 and out_b.status[0] == 1
    # One checkpoint per 24 iterations (two replays of one system's 12-iteration graph;
    # 100 -> 108, 1000 -> 1008), each read while the next replays are queued; only the
    # last wait has nothing behind it.
    assert out_a.host_syncs == 1 and out_a.checkpoints == 5
    assert out_b.host_syncs == 1 and out_b.checkpoints == 42
    fixed = cg_batched(PackedBatch.from_csr(*_to_gpu(A, b), rtol=1e-30, maxiter=1000), check_every=1000)
    assert fixed.host_syncs == 1 and fixed.checkpoints == 1 and fixed.iterations[0] == 1000
    # Atomic sums make the last bits differ from run to run; both are solutions.
    np.testing.assert_allclose(host(fixed.x), host(out_b.x), rtol=1e-8, atol=1e-8)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cg", "bicgstab"])
@pytest.mark.parametrize("maxiter", [1, 11, 12, 13, 25, 50])
def test_gpu_one_system_stops_at_maxiter_inside_a_graph_replay(method, maxiter):
    """One system replays shorter graphs than a batch; a limit inside one stops x there."""
    from managed_solve.solvers.batched.gpu import GRAPH_CHUNK, SINGLE_GRAPH_CHUNK

    assert GRAPH_CHUNK % SINGLE_GRAPH_CHUNK == 0  # checkpoints fall between replays
    A = poisson2d(24)
    b = np.random.default_rng(11).standard_normal(A.shape[0])
    solve = cg_batched if method == "cg" else bicgstab_batched
    gpu = solve(PackedBatch.from_csr(*_to_gpu(A, b), rtol=1e-30, maxiter=maxiter))
    cpu = solve(PackedBatch.from_csr(A, b, rtol=1e-30, maxiter=maxiter))
    assert int(gpu.iterations[0]) == int(cpu.iterations[0]) == maxiter
    assert gpu.status[0] == cpu.status[0] == 1
    # The host twin's iterate after the same iterations. Reductions sum in other orders,
    # which BiCGStab amplifies (4e-4 of an entry after 50 iterations here) where CG's
    # iterates agree to 1e-7; a step more or less moves CG's x by far more than that.
    err = np.linalg.norm(host(gpu.x) - cpu.x) / np.linalg.norm(cpu.x)
    assert err <= (1e-7 if method == "cg" else 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_gpu_converged_solve_never_drains_the_queue(method):
    """Convergence is seen at a checkpoint while later iterations are queued (masked)."""
    A = poisson2d(64)
    b = np.random.default_rng(3).standard_normal(A.shape[0])
    solve = cg_batched if method == "cg" else bicgstab_batched
    out = solve(PackedBatch.from_csr(*_to_gpu(A, b), rtol=1e-8, maxiter=5000))
    ref = solve(PackedBatch.from_csr(A, b, rtol=1e-8, maxiter=5000))
    assert out.status[0] == 0 and out.host_syncs == 0
    # BiCGStab's jagged residual history turns rounding differences into a few
    # iterations more or less (149 on the CPU, 144 on an H200).
    its = int(ref.iterations[0])
    assert abs(int(out.iterations[0]) - its) <= (2 if method == "cg" else 2 + 0.1 * its)
    # Seen at the checkpoint of the chunk it converged in, or a later one when the
    # host came late and skipped to the newest the GPU had passed.
    assert out.checkpoints >= -(-int(out.iterations[0]) // 24)
    # The masked iterations queued after convergence did not move x.
    assert true_residual(A, host(out.x), b) <= 1.5e-8 * np.linalg.norm(b)


def _skewed_systems(rng):
    """Many fast systems (most rows) and two slow ones: compaction's case."""
    fast = [LinearSystem(poisson2d(32), rng.standard_normal(1024), rtol=1e-6) for _ in range(40)]
    slow = [LinearSystem(poisson2d(64), rng.standard_normal(4096), rtol=1e-11) for _ in range(2)]
    return fast + slow


@pytest.mark.gpu
@pytest.mark.parametrize("vector", [False, True], ids=["thread-rows", "warp-rows"])
@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_gpu_compaction_gives_the_same_iterates(settings, method, vector):
    settings(batched_block_max_rows=0)  # CG's row kernels (not a block per system)
    if vector:
        settings(batched_vector_min_nnz_per_row=0)
    systems = _skewed_systems(np.random.default_rng(12))
    solve = cg_batched if method == "cg" else bicgstab_batched
    out = solve(PackedBatch.pack(systems, device="cuda:0"))
    assert out.compactions >= 1 and (out.status == 0).all()
    settings(batched_compact_min_rows=1 << 40)  # compaction off
    plain = solve(PackedBatch.pack(systems, device="cuda:0"))
    assert plain.compactions == 0 and (plain.status == 0).all()
    # Atomic sums change the rounding from run to run: CG's counts move by at
    # most one; BiCGStab's by up to 9 of 60 seen, with compaction or without.
    margin = 1 if method == "cg" else 2 + 0.2 * plain.iterations
    assert (np.abs(out.iterations - plain.iterations) <= margin).all()
    batch = PackedBatch.pack(systems)
    for s, x, y in zip(systems, batch.unpack(host(out.x)), batch.unpack(host(plain.x)), strict=True):
        assert true_residual(s.A, x, s.b) <= 1.5 * s.rtol * np.linalg.norm(s.b)
        if method == "cg":  # BiCGStab's counts differ, so its x differ within rtol
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-6 * np.linalg.norm(y))


@pytest.mark.gpu
def test_gpu_many_systems_each_meets_its_rtol():
    """Enough systems that warps straddle system boundaries and most systems finish early."""
    rng = np.random.default_rng(9)
    sizes = rng.integers(3, 20, size=150)
    systems = [LinearSystem(poisson2d(int(m)), rng.standard_normal(int(m) ** 2),
                            rtol=10.0 ** rng.uniform(-10, -4)) for m in sizes]
    for solve in (cg_batched, bicgstab_batched):
        batch = PackedBatch.pack(systems, device="cuda:0")
        out = solve(batch)
        cpu = solve(PackedBatch.pack(systems))
        assert (out.status == 0).all()
        # Atomic sums change the rounding; BiCGStab's jagged residual history
        # turns that into a few iterations more or less (up to 5 of 27 seen).
        margin = 2 if solve is cg_batched else 2 + 0.2 * cpu.iterations
        assert (np.abs(out.iterations - cpu.iterations) <= margin).all()
        for s, x in zip(systems, batch.unpack(host(out.x)), strict=True):
            assert true_residual(s.A, x, s.b) <= 10 * s.rtol * np.linalg.norm(s.b)


def _to_gpu(A, b):
    import cupy as cp
    import cupyx.scipy.sparse as csp

    return csp.csr_matrix(A), cp.asarray(b)


@pytest.mark.gpu
@pytest.mark.parametrize("force", [False, True], ids=["long-rows", "forced"])
@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_gpu_warp_per_row_products(settings, method, force):
    """Long rows take the warp-per-row products; forcing them on short rows gives the same answers."""
    rng = np.random.default_rng(10)
    if force:
        settings(batched_vector_min_nnz_per_row=0)
        mats, bs = mixed_spd(rng)
    else:
        mats = [random_gram_spd(70, rng, 0.5), random_gram_spd(33, rng, 0.6), random_gram_spd(1, rng, 1.0)]
        bs = [rng.standard_normal(A.shape[0]) for A in mats]
    systems = [LinearSystem(A, b, rtol=1e-9, maxiter=500) for A, b in zip(mats, bs, strict=True)]
    batch = PackedBatch.pack(systems, device="cuda:0")
    assert force or batch.nnz >= config.current().batched_vector_min_nnz_per_row * batch.n
    solve = cg_batched if method == "cg" else bicgstab_batched
    ref_solver = spla.cg if method == "cg" else spla.bicgstab
    out = solve(batch)
    assert (out.status == 0).all()
    for k, (A, b, x) in enumerate(zip(mats, bs, batch.unpack(host(out.x)), strict=True)):
        x_ref, info, its = scipy_reference(ref_solver, A, b, rtol=1e-9, maxiter=500)
        if not np.linalg.norm(b):
            assert out.iterations[k] == 0 and not x.any()
            continue
        assert info == 0 and abs(int(out.iterations[k]) - its) <= 2
        np.testing.assert_allclose(x, x_ref, atol=1e-7 * np.linalg.norm(x_ref))


@pytest.mark.usefixtures("row_parallel")
@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_row_layout_with_jacobi_and_x0(device, method):
    """The row-parallel CPU layout (one large system) with both options, against SciPy."""
    rng = np.random.default_rng(11)
    m = int(np.ceil(np.sqrt(ROWS_LAYOUT_MIN))) + 1
    A = symmetrically_scaled(poisson2d(m), 10.0 ** rng.uniform(-1, 1, m * m))
    b = rng.standard_normal(m * m)
    x0 = rng.standard_normal(m * m)
    batch = PackedBatch.pack([LinearSystem(A, b, x0=x0, rtol=1e-7, maxiter=3000)], device=device,
                             jacobi=True)
    solve = cg_batched if method == "cg" else bicgstab_batched
    out = solve(batch)
    ref_solver = spla.cg if method == "cg" else spla.bicgstab
    x_ref, info, its = scipy_reference(ref_solver, A, b, rtol=1e-7, maxiter=3000, x0=x0,
                                       M=sp.diags(1.0 / A.diagonal()))
    assert out.status[0] == 0 and info == 0
    # BiCGStab's count feels the order of the GPU's atomic sums (226 and 234 vs
    # SciPy's 211 seen on H200s); CG's stays within 5%.
    assert abs(int(out.iterations[0]) - its) <= max(2, (0.05 if method == "cg" else 0.15) * its)
    np.testing.assert_allclose(host(out.x), x_ref, atol=1e-5 * np.linalg.norm(x_ref))
    assert true_residual(A, host(out.x), b) <= 1.01e-7 * np.linalg.norm(b)


def test_first_check_validated():
    A = laplacian1d(8)
    batch = PackedBatch.from_csr(A, np.ones(8))
    with pytest.raises(ValueError, match="first_check"):
        cg_batched(batch, first_check=0)
    with pytest.raises(ValueError, match="first_check"):
        bicgstab_batched(batch, first_check=2.5)
    assert cg_batched(batch, first_check=1000).status.tolist() == [0]  # ignored on the CPU


@pytest.mark.gpu
def test_gpu_first_check_at_the_predicted_count_reads_the_host_once():
    A = poisson2d(128)
    b = np.ones(A.shape[0])
    first = cg_batched(PackedBatch.from_csr(*_to_gpu(A, b), rtol=1e-8))
    its = int(first.iterations[0])
    assert first.status[0] == 0 and first.host_syncs == 0
    again = cg_batched(PackedBatch.from_csr(*_to_gpu(A, b), rtol=1e-8), first_check=its)
    # Every chunk up to the predicted count is queued before the host reads anything.
    assert again.host_syncs <= 1 and int(again.iterations[0]) == its and again.status[0] == 0
    capped = cg_batched(PackedBatch.from_csr(*_to_gpu(A, b), rtol=1e-30, maxiter=200), first_check=200)
    assert capped.host_syncs == 1 and capped.iterations[0] == 200 and capped.status[0] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [1, 37])
def test_gpu_fused_residual_norms_match_the_host(dtype, count):
    from managed_solve.solvers.batched import residual_norms

    rng = np.random.default_rng(13)
    systems = [LinearSystem(poisson2d(int(m), dtype), rng.standard_normal(int(m) ** 2).astype(dtype))
               for m in rng.integers(3, 40, size=count)]
    batch = PackedBatch.pack(systems, device="cuda:0")
    import cupy as cp

    x = cp.asarray(rng.standard_normal(batch.n).astype(dtype))
    rn, bn = residual_norms(batch, x)
    xs = PackedBatch.pack(systems).unpack(host(x))
    for k, (s, xk) in enumerate(zip(systems, xs, strict=True)):
        A = s.A.astype(np.float64)
        ref_r = np.linalg.norm(s.b.astype(np.float64) - A @ xk.astype(np.float64))
        assert rn[k] == pytest.approx(ref_r, rel=1e-12)
        assert bn[k] == pytest.approx(np.linalg.norm(s.b.astype(np.float64)), rel=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_gpu_batches_with_and_without_graphs_agree_and_report_gpu_time(settings, method):
    """A multi-system batch past batched_graph_max_rows replays graphs (batched_graph_batches)."""
    import time

    systems = _skewed_systems(np.random.default_rng(5))
    solve = cg_batched if method == "cg" else bicgstab_batched
    settings(batched_graph_max_rows=0, batched_block_max_rows=0)  # every batch counts as large
    t0 = time.perf_counter()
    graphs = solve(PackedBatch.pack(systems, device="cuda:0"))
    wall = time.perf_counter() - t0
    settings(batched_graph_batches=False)
    launches = solve(PackedBatch.pack(systems, device="cuda:0"))
    assert (graphs.status == 0).all() and (launches.status == 0).all()
    # Graph replays read statuses every 24 iterations, launches every CHECK_EVERY.
    assert graphs.checkpoints <= -(-int(graphs.iterations.max()) // 24) + 2
    assert launches.checkpoints > graphs.checkpoints
    # BiCGStab's count moves with the rounding of its reductions (graphs and launches sum
    # in other orders): a third either way on these skewed systems.
    margin = 1 if method == "cg" else 2 + 0.4 * launches.iterations
    assert (np.abs(graphs.iterations - launches.iterations) <= margin).all()
    assert 0 < graphs.gpu_seconds <= wall
    for out in (graphs, launches):
        xs = PackedBatch.pack(systems).unpack(host(out.x))
        for s, x in zip(systems, xs, strict=True):
            assert true_residual(s.A, x, s.b) <= 10 * s.rtol * np.linalg.norm(s.b)


def test_cpu_batches_report_no_gpu_time():
    systems = _skewed_systems(np.random.default_rng(6))[:3]
    out = cg_batched(PackedBatch.pack(systems))
    assert out.gpu_seconds is None and (out.status == 0).all()


@pytest.mark.gpu
def test_gpu_prepared_workspace_is_used_once_and_gives_the_same_solve(settings):
    """solve_many's stagers build a batch's workspace ahead (``batched.prepare``)."""
    import weakref

    settings(batched_block_max_rows=0)  # the row kernels, whose first graph is captured ahead

    systems = _skewed_systems(np.random.default_rng(8))
    plain = cg_batched(PackedBatch.pack(systems, device="cuda:0"))
    batch = PackedBatch.pack(systems, device="cuda:0")
    batched.prepare(batch, "cg")
    ws = weakref.ref(batch.workspace)
    assert batch.workspace.batch is None  # no batch <-> workspace cycle while it waits
    out = cg_batched(batch)
    assert batch.workspace is None  # used once
    assert (out.status == 0).all() and (np.abs(out.iterations - plain.iterations) <= 1).all()
    np.testing.assert_allclose(host(out.x), host(plain.x), rtol=1e-6, atol=1e-9)
    # A workspace prepared for another method is not used; a dropped batch frees its own.
    other = PackedBatch.pack(systems, device="cuda:0")
    batched.prepare(other, "cg")
    assert (bicgstab_batched(other).status == 0).all()
    dropped = PackedBatch.pack(systems, device="cuda:0")
    batched.prepare(dropped, "cg")
    gone = weakref.ref(dropped.workspace)
    del dropped
    assert gone() is None
    import cupy as cp

    cp.cuda.Device(0).synchronize()
    batched.release_done()  # masked iterations queued after convergence kept it until done
    assert ws() is None
    # On a stager's stream the first CUDA graph is captured ahead too, and used.
    staged = PackedBatch.pack(systems, device="cuda:0")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        batched.prepare(staged, "cg")
    stream.synchronize()
    solver = staged.workspace
    assert solver.uses_graph and solver.graph is not None
    out = cg_batched(staged)
    assert solver.graph is None  # taken by the solve
    assert (out.status == 0).all() and (np.abs(out.iterations - plain.iterations) <= 1).all()
    np.testing.assert_allclose(host(out.x), host(plain.x), rtol=1e-6, atol=1e-9)


# ------------------------------------------------- CG with a thread block per system (GPU)


def _block_cases(rng):
    """(name, systems): batches the block route takes, with what it must get right."""
    spd = [poisson2d(m) for m in (3, 9, 17, 40)] + [random_gram_spd(30, rng), laplacian1d(200)]
    plain = [LinearSystem(A, rng.standard_normal(A.shape[0]), rtol=10.0 ** -(6 + k % 5))
             for k, A in enumerate(spd)]
    zero_b = [LinearSystem(poisson2d(6), np.zeros(36), x0=np.ones(36)),
              LinearSystem(poisson2d(7), rng.standard_normal(49), x0=rng.standard_normal(49))]
    d = np.linspace(-1.0, 2.0, 30)
    d[np.abs(d) < 0.1] = 0.5
    indefinite = sp.diags(d).tocsr() + sp.diags([0.05, 0.05], [-1, 1], shape=(30, 30)).tocsr()
    mixed = [LinearSystem(poisson2d(5), rng.standard_normal(25)),
             LinearSystem(indefinite, rng.standard_normal(30), maxiter=500),
             LinearSystem(poisson2d(20), rng.standard_normal(400), rtol=1e-14, maxiter=7),
             LinearSystem(poisson2d(4), rng.standard_normal(16), rtol=1e-14, maxiter=1)]
    scaled = [LinearSystem(symmetrically_scaled(poisson2d(m), 10.0 ** rng.uniform(-2, 2, m * m)),
                           rng.standard_normal(m * m), rtol=1e-9, maxiter=5000) for m in (8, 15, 24)]
    return [("plain", plain, False), ("zero b and x0", zero_b, False),
            ("breakdown, maxiter", mixed, False), ("jacobi", scaled, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", range(4))
def test_gpu_block_route_gives_the_row_kernels_iterates(settings, case, dtype):
    """A block per system: the row kernels' statuses, counts and x; true norms as the host's."""
    name, systems, jacobi = _block_cases(np.random.default_rng(20 + case))[case]
    if dtype == np.float32:
        systems = [LinearSystem(s.A.astype(np.float32), s.b.astype(np.float32), rtol=max(s.rtol, 1e-5),
                                maxiter=s.maxiter,
                                x0=None if s.x0 is None else s.x0.astype(np.float32))
                   for s in systems]

    def pack(device="cpu"):
        return PackedBatch.pack(systems, device=device, jacobi=jacobi)

    batch = pack("cuda:0")
    batched.prepare(batch, "cg")
    assert batch.workspace.blocks and not batch.workspace.uses_graph, name
    blocks = cg_batched(batch)
    cpu = cg_batched(pack())
    settings(batched_block_max_rows=0)
    rows = cg_batched(pack("cuda:0"))
    assert blocks.status.tolist() == rows.status.tolist() == cpu.status.tolist(), name
    # Sums in another order: a count may move by one at a tolerance's edge.
    assert (np.abs(blocks.iterations - rows.iterations) <= 1).all(), name
    assert (np.abs(blocks.iterations - cpu.iterations) <= 1).all(), name
    assert blocks.host_syncs == 0 and blocks.checkpoints == 1 and blocks.compactions == 0
    assert blocks.gpu_seconds > 0
    host_batch = pack()
    xs = host_batch.unpack(host(blocks.x))
    rn, bn = blocks.true_norms
    for k, (s, x, y) in enumerate(zip(systems, xs, host_batch.unpack(host(rows.x)), strict=True)):
        A, b, x64 = s.A.astype(np.float64), s.b.astype(np.float64), x.astype(np.float64)
        # float64 sums in another order: the residual's rounding, eps (|b| + |A| |x|)
        # an entry, whatever the residual's own size.
        rounding = 1e-14 * (np.linalg.norm(b) + np.linalg.norm(abs(A) @ abs(x64)))
        assert abs(rn[k] - np.linalg.norm(b - A @ x64)) <= rounding, (name, k)
        assert bn[k] == pytest.approx(np.linalg.norm(b), rel=1e-12)
        if blocks.status[k] == 0 and dtype == np.float64:  # float32's true residual may lag
            assert rn[k] <= 1.5 * max(s.rtol * bn[k], s.atol), (name, k)
            if blocks.iterations[k] == rows.iterations[k]:
                scale = np.linalg.norm(y.astype(np.float64)) + 1.0
                assert np.linalg.norm(x.astype(np.float64) - y) <= (1e-3 if dtype == np.float32 else 1e-7) * scale
        if not bn[k]:
            assert not x.any()  # b = 0: x = 0 whatever x0
    # The recurrence residual at the stop, as the row kernels report it.
    same = blocks.iterations == rows.iterations
    np.testing.assert_allclose(blocks.residual_norms[same], rows.residual_norms[same],
                               rtol=1e-3 if dtype == np.float32 else 1e-6,
                               atol=1e-13 * float(bn.max()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", range(4))
def test_gpu_block_route_in_shared_memory_gives_the_same_bits(settings, case, dtype):
    """p, q and x in shared memory or in device memory: the same operations, the same bits."""
    from managed_solve.solvers.batched import cuda

    name, systems, jacobi = _block_cases(np.random.default_rng(40 + case))[case]
    systems = [LinearSystem(s.A.astype(dtype), s.b.astype(dtype), rtol=max(s.rtol, 1e-5)
                            if dtype == np.float32 else s.rtol, maxiter=s.maxiter,
                            x0=None if s.x0 is None else s.x0.astype(dtype)) for s in systems]
    largest = max(s.n for s in systems)
    assert cuda.block_shared_bytes(largest, np.dtype(dtype).itemsize, 0) == \
        3 * largest * np.dtype(dtype).itemsize  # these fit
    outs = []
    for shared in (True, False):
        settings(batched_block_shared_memory=shared)
        batch = PackedBatch.pack(systems, device="cuda:0", jacobi=jacobi)
        batched.prepare(batch, "cg")
        assert batch.workspace.blocks, name
        outs.append(cg_batched(batch))
    sh, dm = outs
    assert sh.status.tolist() == dm.status.tolist(), name
    assert sh.iterations.tolist() == dm.iterations.tolist(), name
    np.testing.assert_array_equal(host(sh.x), host(dm.x))
    np.testing.assert_array_equal(sh.residual_norms, dm.residual_norms)
    np.testing.assert_array_equal(sh.true_norms[0], dm.true_norms[0])
    cpu = cg_batched(PackedBatch.pack(systems, jacobi=jacobi))
    assert sh.status.tolist() == cpu.status.tolist(), name
    assert (np.abs(sh.iterations - cpu.iterations) <= 1).all(), name


@pytest.mark.gpu
def test_gpu_block_route_keeps_vectors_in_shared_memory_while_they_fit():
    """3 n values a system: W2's largest (9,216 rows) fit an H100's or H200's block in float64;
    what does not fit runs from device memory, and still converges."""
    from managed_solve.solvers.batched import cuda

    optin = cuda.shared_bytes_optin(0)
    fits = (optin - cuda.BLOCK_STATIC_SHARED) // 24  # float64 rows that fit
    assert cuda.block_shared_bytes(fits, 8, 0) == 24 * fits
    assert cuda.block_shared_bytes(fits + 1, 8, 0) == 0
    assert cuda.block_shared_bytes(fits + 1, 4, 0) == 12 * (fits + 1)
    if optin >= 227 * 1024:  # sm_90
        assert cuda.block_shared_bytes(9216, 8, 0) > 0
    m = int(np.ceil(np.sqrt(fits + 1)))  # a system too large for shared memory
    rng = np.random.default_rng(3)
    systems = [LinearSystem(poisson2d(k), rng.standard_normal(k * k)) for k in (m, 20)]
    out = cg_batched(PackedBatch.pack(systems, device="cuda:0"))
    assert (out.status == 0).all()
    for s, x in zip(systems, PackedBatch.pack(systems).unpack(host(out.x)), strict=True):
        assert true_residual(s.A, x, s.b) <= 1.5e-8 * np.linalg.norm(s.b)


@pytest.mark.gpu
def test_gpu_block_route_only_for_several_small_cg_systems(settings):
    """One system, BiCGStab, or a system above batched_block_max_rows: the row kernels."""
    rng = np.random.default_rng(9)
    small = [LinearSystem(poisson2d(m), rng.standard_normal(m * m)) for m in (10, 12)]
    big = small + [LinearSystem(poisson2d(40), rng.standard_normal(1600))]
    cases = [(small, "cg", True), (small[:1], "cg", False), (small, "bicgstab", False)]
    for systems, method, expect in cases:
        batch = PackedBatch.pack(systems, device="cuda:0")
        batched.prepare(batch, method)
        assert batch.workspace.blocks is expect
    settings(batched_block_max_rows=1599)
    batch = PackedBatch.pack(big, device="cuda:0")
    batched.prepare(batch, "cg")
    assert not batch.workspace.blocks
    settings(batched_block_max_rows=1600)
    batch = PackedBatch.pack(big, device="cuda:0")
    batched.prepare(batch, "cg")
    assert batch.workspace.blocks
    out = cg_batched(batch)
    assert (out.status == 0).all() and out.true_norms is not None


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [32, 96, 1024])
def test_gpu_block_route_any_block_size(settings, threads):
    """Blocks of one warp, of three (not a power of two) and the largest: the same answers."""
    settings(batched_block_threads=threads)
    rng = np.random.default_rng(31)
    systems = [LinearSystem(poisson2d(m), rng.standard_normal(m * m), rtol=1e-10)
               for m in (2, 7, 33, 50)]
    out = cg_batched(PackedBatch.pack(systems, device="cuda:0"))
    cpu = cg_batched(PackedBatch.pack(systems))
    assert (out.status == 0).all() and (np.abs(out.iterations - cpu.iterations) <= 1).all()
    for s, x in zip(systems, PackedBatch.pack(systems).unpack(host(out.x)), strict=True):
        assert true_residual(s.A, x, s.b) <= 1.5e-10 * np.linalg.norm(s.b)


def test_block_threads_setting_is_checked():
    with pytest.raises(ValueError, match="batched_block_threads"):
        with config.override(batched_block_threads=100):
            pass
    with pytest.raises(ValueError, match="batched_block_threads"):
        with config.override(batched_block_threads=2048):
            pass
    for rows in (-1, 1.5, True):
        with pytest.raises(ValueError, match="batched_block_max_rows"):
            with config.override(batched_block_max_rows=rows):
                pass
    for shared in ("no", 0, None):
        with pytest.raises(ValueError, match="batched_block_shared_memory"):
            with config.override(batched_block_shared_memory=shared):
                pass
    with config.override(batched_block_shared_memory=False):
        assert config.current().batched_block_shared_memory is False


@pytest.mark.multi_gpu
def test_block_route_on_the_second_gpu_is_the_firsts_bit_for_bit():
    """Sums in a fixed order: the same batch gives the same bits on either GPU (launched on its own)."""
    rng = np.random.default_rng(0)
    systems = [LinearSystem(poisson2d(m), rng.standard_normal(m * m), rtol=1e-10)
               for m in (5, 17, 40, 63, 90)]
    outs = []
    for dev in ("cuda:0", "cuda:1"):
        batch = PackedBatch.pack(systems, device=dev, jacobi=True)
        batched.prepare(batch, "cg")
        assert batch.workspace.blocks
        out = cg_batched(batch)
        assert out.x.device.id == int(dev[-1]) and (out.status == 0).all()
        outs.append(out)
    cpu = cg_batched(PackedBatch.pack(systems, jacobi=True))
    assert (np.abs(outs[1].iterations - cpu.iterations) <= 1).all()
    assert outs[0].iterations.tolist() == outs[1].iterations.tolist()
    np.testing.assert_array_equal(host(outs[0].x), host(outs[1].x))
    np.testing.assert_array_equal(outs[0].true_norms[0], outs[1].true_norms[0])
