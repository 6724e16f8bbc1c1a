"""Estimates: routes by the one auto policy (solve() agrees), the per-call memo, the early method tests, bytes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

import managed_solve as ms
from managed_solve import LinearSystem, Status
from managed_solve.manager import DeviceManager
from managed_solve.scheduling import estimate as estimation
from managed_solve.scheduling import runner, solve_many
from managed_solve.scheduling.estimate import estimate_system
from managed_solve.scheduling.plan import DEFERRED
from managed_solve.system import is_symmetric
from managed_solve.system.method import choose_method
from tests._problems import helmholtz2d, poisson2d
from tests._problems import poisson2d_skew as convection
from tests.scheduling._helpers import assert_converged, assert_solves, head_start_mix


def banded(m: int, diagonal: float, width: int = 7) -> sp.csr_matrix:
    """Symmetric, ``2 * width + 1`` entries a row (past the host LU's 2D-like row test)."""
    n = m * m
    offsets = [k for k in range(-width, width + 1) if k]
    A = sp.diags([-0.5] * len(offsets), offsets, shape=(n, n)) + sp.identity(n) * diagonal
    return A.tocsr()


def policy_systems() -> list[LinearSystem]:
    """Sizes, shapes, symmetry, diagonal signs, dtypes, preconditioners and given methods."""
    rng = np.random.default_rng(5)
    P = poisson2d(12)
    heat = (sp.identity(144) * 10.0 + P * 0.1).tocsr()  # easy for CG: no host LU
    mats = {
        "poisson-small": poisson2d(5), "poisson": P, "poisson32": poisson2d(9, np.float32),
        "convection": convection(10), "heat": heat,
        "negative-definite": (-P).tocsr(),  # symmetric, diagonal negative: MINRES, or the host LU
        "banded-spd": banded(12, 9.0),  # CG wherever (the row test keeps it off the host LU)
        "banded-negative": banded(12, -9.0),  # MINRES wherever
        "dense": P[:49, :49].toarray(), "dense-convection": convection(5).toarray(),
    }
    out = []
    for name, A in mats.items():
        n = A.shape[0]
        b = rng.standard_normal(n).astype(A.dtype)
        out.append(LinearSystem(A, b, rtol=1e-6, name=name))
        if sp.issparse(A) and "negative" not in name:  # MINRES takes no Jacobi of a negative diagonal
            out.append(LinearSystem(A, b, rtol=1e-6, M="jacobi", name=f"{name}+jacobi"))
    out.append(LinearSystem(spla.aslinearoperator(P), rng.standard_normal(144), name="operator"))
    out.append(LinearSystem(P, rng.standard_normal(144), method="gmres", name="gmres"))
    out.append(LinearSystem(P, rng.standard_normal(144), method="minres", name="minres"))
    return out


@pytest.mark.parametrize("spec", [["cpu"], "1x1GiB", "2x1GiB"])
def test_solve_many_chooses_the_method_solve_chooses(spec):
    """For every system and manager, solve_many's method is solve()'s (one auto policy)."""
    dm = DeviceManager(spec) if isinstance(spec, list) else DeviceManager(simulate=spec)
    systems = policy_systems()
    many = solve_many(systems, manager=dm)
    one = [ms.solve(s, manager=dm) for s in systems]
    assert [(r.name, r.method) for r in many] == [(s.name, r.method) for s, r in zip(systems, one, strict=True)]
    assert all(r.converged for r in many), [(r.name, r.message) for r in many if not r.converged]
    methods = {r.name: r.method for r in many}
    assert methods["banded-negative"] == "minres" and methods["banded-spd"] == "cg"
    assert methods["negative-definite"] == ("direct" if spec == ["cpu"] else "minres")
    assert methods["convection"] == ("direct" if spec == ["cpu"] else "bicgstab")
    assert methods["convection+jacobi"] == "bicgstab"  # a preconditioner: no host LU


def mesh_sweep(level: int) -> list[LinearSystem]:
    """Heat steps and screened Poisson problems on an icosphere, as the demo's sweep builds them."""
    from managed_solve import pde
    from managed_solve.mesh import icosphere

    mesh = icosphere(level)
    v = mesh.vertices
    u0 = np.exp(-((v - v[0]) ** 2).sum(axis=1) / 0.1)
    f = v[:, 0] * v[:, 1] + 0.5 * v[:, 2]
    out = [pde.heat_step(mesh, u0, dt=dt, device="cpu") for dt in (1e-3, 1e-2, 3e-2)]
    out += [pde.screened_poisson(mesh, f, alpha=a, device="cpu") for a in (0.1, 1.0, 100.0)]
    for k, s in enumerate(out):
        s.name = f"mesh{level}-{k}"
    return out


@pytest.mark.parametrize("spec", [["cpu"], "1x1GiB"])
def test_solve_many_chooses_the_method_solve_chooses_on_mesh_systems(spec):
    """The demo's sweep: solve_many and solve agree, and on the CPU CG is predicted sooner than an LU."""
    dm = DeviceManager(spec) if isinstance(spec, list) else DeviceManager(simulate=spec)
    systems = mesh_sweep(3)
    many = solve_many(systems, manager=dm)
    one = [ms.solve(s, manager=dm) for s in systems]
    assert [r.method for r in many] == [r.method for r in one] == ["cg"] * len(systems)
    assert_converged(systems, many, rtol=1e-8)


def test_the_cpu_policy_sends_a_10k_mesh_system_to_cg_not_the_lu():
    """icosphere(5), 10,242 unknowns: CG takes a few milliseconds, SuperLU tens."""
    from managed_solve.system.method import choose_method

    for s in mesh_sweep(5):
        assert s.n == 10_242
        assert choose_method(s, "cpu") == "cg", s.name
        assert estimate_system(s, 0, device_kind="cpu", cache={}).route == "batch"


def test_host_matrix_tests_of_a_cpu_call_run_first_on_every_core_and_agree():
    """The tests run on the host threads beforehand give the estimates the loop finds alone."""
    systems = [s for s in policy_systems() + mesh_sweep(2) if s.kind != "operator"]
    cache: dict = {}
    with ms.config.override(host_parallel_min_work=0.0):  # threads even for these small ones
        estimation.check_host_matrices(systems, cache)
    tested = [s for s in systems if s.kind == "csr" and s.method == "auto"]
    assert tested and all(cache[id(s.A)][1] == is_symmetric(s.A) for s in tested)
    assert all(("gershgorin", id(s.A)) in cache for s in tested if is_symmetric(s.A))
    ahead = [estimate_system(s, i, device_kind="cpu", cache=cache) for i, s in enumerate(systems)]
    alone = [estimate_system(s, i, device_kind="cpu") for i, s in enumerate(systems)]
    assert ahead == alone


def test_auto_minres_systems_run_alone_through_solve():
    """The batched core has no MINRES: such "auto" systems take the SINGLE route."""
    dm = DeviceManager(simulate="1x1GiB")
    s = LinearSystem(banded(10, -9.0), np.ones(100), rtol=1e-8, name="minres-alone")
    e = estimate_system(s, 0, device_kind="sim", manager=dm)
    assert e.route == "single"
    (r,) = solve_many([s], manager=dm)
    assert r.method == "minres" and r.converged and r.info["batch_size"] == 1


def shared_matrix_systems() -> list[LinearSystem]:
    """Systems sharing a few matrices, with every option the estimate depends on varied."""
    rng = np.random.default_rng(21)
    P = poisson2d(9)
    mats = {
        "poisson": P,
        "convection": convection(9, 0.5),  # non-symmetric: BiCGStab
        "heat": (sp.identity(81) * 10.0 + P * 0.1).tocsr(),  # easy for CG: no host LU
        "indefinite": helmholtz2d(9, 4.5),
    }
    mats["poisson32"] = mats["poisson"].astype(np.float32)
    out = []
    for k in range(200):
        name = list(mats)[k % len(mats)]
        A = mats[name]
        n = A.shape[0]
        out.append(LinearSystem(
            A, rng.standard_normal(n), x0=rng.standard_normal(n) if k % 7 == 0 else None,
            rtol=10.0 ** -(6 + k % 3), maxiter=[None, 30, 5000][k % 3 if k % 11 == 0 else 0],
            method=["auto", "gmres", "cg", "bicgstab", "minres"][k % 5 if k % 4 == 0 else 0],
            M="jacobi" if k % 6 == 0 else None, name=f"{name}{k}"))
    return out


@pytest.mark.parametrize("host_only", [False, True])
def test_estimate_memo_gives_the_estimates_computed_one_by_one(host_only):
    dm = DeviceManager(simulate="2x1GiB")
    kind = "cpu" if host_only else "sim"
    systems = shared_matrix_systems()
    cache: dict = {}
    memoised = [estimate_system(s, i, device_kind=kind, manager=dm, cache=cache)
                for i, s in enumerate(systems)]
    alone = [estimate_system(s, i, device_kind=kind, manager=dm) for i, s in enumerate(systems)]
    assert memoised == alone
    # A call whose systems each hold their own matrix leaves the memo out: the same estimates.
    assert estimation.shares_matrices(systems)
    assert not estimation.shares_matrices([systems[0], None, systems[1]])
    unkept = [estimate_system(s, i, device_kind=kind, manager=dm, cache={}, memo=False)
              for i, s in enumerate(systems)]
    assert unkept == alone
    assert {e.route for e in alone} >= ({"batch", "single", "direct"} if host_only else {"batch", "single"})
    assert len({e.group for e in alone}) >= 4
    # The memo keys on the matrix object: an equal copy is estimated on its own, the same.
    one = systems[1]
    twin = LinearSystem(one.A.copy(), one.b, rtol=one.rtol, name="twin")
    assert estimate_system(twin, 1, device_kind=kind, manager=dm, cache=cache) == alone[1]


def test_symmetry_check_sorted_unsorted_and_cached():
    A = poisson2d(6)
    assert is_symmetric(A)
    assert not is_symmetric(convection(6))
    B = A.copy()
    B.data[3] += 1e-6  # breaks symmetry beyond the 1e-12 tolerance
    assert not is_symmetric(B)
    U = sp.csr_matrix((A.data[::-1].copy(), A.indices[::-1].copy(), A.indptr), shape=A.shape)
    U2 = sp.csr_matrix((np.ones(4), [1, 0, 1, 0], [0, 2, 4]), shape=(2, 2))
    U2.has_sorted_indices = False
    assert is_symmetric(U2)
    assert is_symmetric(U) == is_symmetric(U.sorted_indices())
    cache: dict = {}
    assert is_symmetric(A, cache) and cache[id(A)] == (A, True)
    cache[id(A)] = (A, False)  # a cached answer is reused for the same object only
    assert not is_symmetric(A, cache)
    assert is_symmetric(A.copy(), cache)


# ----------------------------------------------------------------------------- early method tests
def _cupy():
    from managed_solve import _backend

    return _backend.cupy()


def test_large_matrices_method_found_beside_the_estimates(monkeypatch, settings):
    """The prefetch of large matrices' method gives the same routes and results."""
    settings(prefetch_min_nnz=100)
    seen = []
    real = estimation.resolve_method

    def spy(s, kind, cache):
        seen.append(threading.current_thread().name)
        return real(s, kind, cache)

    monkeypatch.setattr(estimation, "resolve_method", spy)
    big = poisson2d(20)  # 400 rows, about 2,000 entries: "large" here
    systems = [LinearSystem(big, np.ones(400), rtol=1e-8, name="big")]
    systems += [LinearSystem(poisson2d(4), np.ones(16), rtol=1e-8, name=f"s{k}") for k in range(5)]
    systems.append(LinearSystem(convection(12), np.ones(144), rtol=1e-8, name="nonsym"))
    dm = DeviceManager(simulate="1x1GiB")
    results = solve_many(systems, manager=dm)
    assert all(r.converged for r in results)
    assert any(name.startswith("managed_solve-prefetch") for name in seen)
    assert results[0].method == "cg" and results[-1].method == "bicgstab"
    for s, r in zip(systems, results, strict=True):
        assert np.linalg.norm(s.b - s.A @ r.to_numpy()) <= 1e-8 * np.linalg.norm(s.b)


def test_every_small_matrix_tested_in_few_kernel_calls_on_an_accelerator_call(monkeypatch, settings):
    """A call with accelerators: each distinct small host matrix tested once, many a kernel call.

    No per-matrix test on the prefetch threads (each of those took the GIL
    back beside the estimate loop); the methods are those ``solve`` picks.
    """
    from managed_solve.kernels import checks, symmetry

    settings(prefetch_all_cores=1)
    settings(prefetch_small_nnz=1)
    settings(host_threads=2)
    settings(host_parallel_min_work=0.0)  # threads even for these small matrices
    many_calls, one_calls, threads = [], [], []
    real_many, real_one = checks.csr_symmetry_gershgorin_many, symmetry.csr_symmetry_gershgorin
    real_resolve = estimation.resolve_method

    def spy_many(lo, hi, *args):
        many_calls.append(hi - lo)
        return real_many(lo, hi, *args)

    def spy_one(*args):
        one_calls.append(1)
        return real_one(*args)

    def spy_resolve(s, kind, cache):
        threads.append(threading.current_thread().name)
        return real_resolve(s, kind, cache)

    monkeypatch.setattr(checks, "csr_symmetry_gershgorin_many", spy_many)
    monkeypatch.setattr(symmetry, "csr_symmetry_gershgorin", spy_one)
    monkeypatch.setattr(estimation, "resolve_method", spy_resolve)
    mats = [poisson2d(m) for m in range(4, 24)] + [convection(k) for k in range(5, 25)]
    systems = [LinearSystem(A, np.ones(A.shape[0]), rtol=1e-8) for A in mats for _ in range(2)]
    results = solve_many(systems, manager=DeviceManager(simulate="1x1GiB"))
    assert sum(many_calls) == len(mats) and not one_calls  # each matrix once, none alone
    assert 2 <= len(many_calls) <= 8 * 2  # ranges of matrices: RANGES_PER_THREAD per thread
    assert not any(t.startswith("managed_solve-prefetch") for t in threads)
    assert [r.method for r in results] == [choose_method(s, "cuda") for s in systems]
    assert_converged(systems, results)


def test_large_matrices_are_tested_beside_the_pass_of_the_small_ones(monkeypatch, settings):
    """Matrices from ``prefetch_min_nnz`` entries are tested on the prefetch threads, the rest in the pass."""
    from managed_solve.kernels import checks

    settings(prefetch_all_cores=1)
    settings(prefetch_small_nnz=1)
    settings(prefetch_min_nnz=1000)
    tested: dict[int, str] = {}
    real = estimation.resolve_method
    real_many = checks.csr_symmetry_gershgorin_many
    in_pass = []

    def spy(s, kind, cache):
        tested.setdefault(s.nnz, threading.current_thread().name)
        return real(s, kind, cache)

    def spy_many(lo, hi, *args):
        in_pass.append(hi - lo)
        return real_many(lo, hi, *args)

    monkeypatch.setattr(estimation, "resolve_method", spy)
    monkeypatch.setattr(checks, "csr_symmetry_gershgorin_many", spy_many)
    big, bigger = poisson2d(20), convection(22)
    smalls = [poisson2d(m) for m in (4, 5, 6)] + [convection(7)]
    mats = smalls + [big, bigger]
    systems = [LinearSystem(A, np.ones(A.shape[0]), rtol=1e-8) for A in mats for _ in range(2)]
    results = solve_many(systems, manager=DeviceManager(simulate="1x1GiB"))
    assert all(tested[A.nnz].startswith("managed_solve-prefetch") for A in (big, bigger))
    assert sum(in_pass) == len(smalls)
    assert [results[2 * k].method for k in range(len(mats))] == \
        ["cg", "cg", "cg", "bicgstab", "cg", "bicgstab"]
    assert_converged(systems, results)


def test_a_failed_method_test_reaches_the_system_it_was_for(monkeypatch, settings):
    """A small matrix's test raising on a helper thread: that system is invalid, the rest solve."""
    settings(prefetch_all_cores=1)
    settings(prefetch_small_nnz=1)
    settings(prefetch_min_nnz=1000)
    bad = poisson2d(5)
    real = estimation.resolve_method

    def spy(s, kind, cache):
        if s.A is bad:
            raise ValueError("this matrix cannot be tested")
        return real(s, kind, cache)

    monkeypatch.setattr(estimation, "resolve_method", spy)
    mats = [poisson2d(20), bad, poisson2d(4)]
    systems = [LinearSystem(A, np.ones(A.shape[0]), rtol=1e-8) for A in mats]
    results = solve_many(systems, manager=DeviceManager(simulate="1x1GiB"))
    assert results[1].status is Status.INVALID_INPUT and "cannot be tested" in results[1].message
    assert results[0].converged and results[2].converged


@pytest.mark.parametrize("where", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_large_systems_method_is_found_while_its_batch_is_copied(monkeypatch, where, settings):
    """Head start: the large batch is staged before its matrix's method is known, then resolved.

    On a GPU the stager resolves the method between the copy and the
    workspace/graph set-up (the batched engine's ``prepare``); on simulated GPUs the
    worker does.
    """
    import time as _time

    settings(prefetch_all_cores=1)
    settings(prefetch_min_nnz=10_000)
    dm = DeviceManager(simulate="2x1GiB") if where == "sim" else DeviceManager(["cuda:0"])
    side = 160 if where == "sim" else 540  # both above 262,144 rows on a GPU
    systems = head_start_mix(big=side)
    # A large non-symmetric one, resolved to BiCGStab. The unit shift puts every
    # eigenvalue's real part at >= 1: unshifted, the 530^2 operator has nearly
    # imaginary eigenvalues near zero, BiCGStab's iteration count swings with the
    # summation order, and on an H100 it broke down (solve() fell back to GMRES).
    conv = (convection(side - 10) + sp.identity((side - 10) ** 2)).tocsr()
    systems[1] = LinearSystem(conv, np.ones(conv.shape[0]), rtol=1e-8, name="big-convection")
    big = {id(systems[0].A), id(conv)}
    method_done: dict[int, float] = {}
    packed_at: list[float] = []
    real_method, real_pack = estimation.resolve_method, runner.pack_batch

    copy_started = threading.Event()

    def method(s, kind, cache):
        if id(s.A) in big and id(s.A) not in method_done:
            # A slow test: it ends only once a large system's copy has started
            # (or after 60 s, and then the ordering assertion below fails).
            copy_started.wait(60)
            out = real_method(s, kind, cache)
            method_done[id(s.A)] = _time.perf_counter()
            return out
        return real_method(s, kind, cache)

    def pack(batch_systems, *a, **k):
        if any(id(s.A) in big for s in batch_systems):
            packed_at.append(_time.perf_counter())
            copy_started.set()
        return real_pack(batch_systems, *a, **k)

    monkeypatch.setattr(estimation, "resolve_method", method)
    monkeypatch.setattr(runner, "pack_batch", pack)
    recorded = []
    real_record = dm.record
    monkeypatch.setattr(dm, "record", lambda sig, *a, **k: (recorded.append(sig), real_record(sig, *a, **k))[1])
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert len(packed_at) == 2 and len(method_done) == 2
    assert min(packed_at) < min(method_done.values())  # the copy started before the method was known
    assert results[0].method == "cg" and results[1].method == "bicgstab"
    assert all(DEFERRED not in sig[2] for sig in recorded if sig[0] == "solve_many")
    if where == "cuda":
        cp = _cupy()
        assert {r.device for r in results} == {"cuda:0"}
        assert all(isinstance(r.x, cp.ndarray) for r in results)


def test_a_large_system_whose_deferred_method_test_fails_is_invalid_input(monkeypatch, settings):
    """As in the estimate loop: a method test raising ValueError makes that system INVALID_INPUT."""
    import time as _time

    settings(prefetch_all_cores=1)
    settings(prefetch_min_nnz=10_000)
    systems = head_start_mix()
    bad = systems[1].A
    real_method = estimation.resolve_method

    def method(s, kind, cache):
        if s.A is bad:
            _time.sleep(0.2)  # still running when the batch is planned: deferred
            raise ValueError("systems[1]: this matrix's symmetry cannot be tested")
        return real_method(s, kind, cache)

    monkeypatch.setattr(estimation, "resolve_method", method)
    dm = DeviceManager(simulate="2x1GiB")
    results = solve_many(systems, manager=dm)
    assert results[1].status is Status.INVALID_INPUT
    assert "cannot be tested" in results[1].message
    assert_solves(systems[:1] + systems[2:], results[:1] + results[2:])
    assert all(dm.reserved_bytes(d) == 0 for d in dm.accelerators)


# ----------------------------------------------------------------------------- bytes
def test_results_carry_the_reserved_bytes():
    systems = [LinearSystem(poisson2d(m), np.ones(m * m)) for m in (4, 5, 6)]
    dm = DeviceManager(["cpu"])
    res = solve_many(systems, manager=dm, method="cg")
    assert all(r.converged for r in res)
    assert all(r.info["reserved_bytes"] > 8 * r.x.size for r in res)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_gpu_peak_memory_within_10_percent_of_the_reservation(method):
    """Peak pool bytes while one batch is staged, solved and checked vs its reservation."""
    import cupy as cp

    rng = np.random.default_rng(4)
    sizes = rng.integers(32, 65, size=60)
    mats = {int(m): poisson2d(int(m)) for m in set(sizes.tolist())}
    systems = [LinearSystem(mats[int(m)], np.ones(int(m) ** 2), rtol=1e-8, method=method)
               for m in sizes]
    dm = DeviceManager(["cuda:0"])
    solve_many(systems, manager=dm)  # compiles the kernels, creates library handles
    cp.cuda.Device(0).synchronize()
    pool = cp.get_default_memory_pool()
    base = pool.used_bytes()
    peak = [base]

    def tracking_malloc(size):
        mem = pool.malloc(size)
        peak[0] = max(peak[0], pool.used_bytes())
        return mem

    cp.cuda.set_allocator(tracking_malloc)
    try:
        res = solve_many(systems, manager=dm)
        cp.cuda.Device(0).synchronize()
    finally:
        cp.cuda.set_allocator(pool.malloc)
    assert all(r.converged for r in res)
    assert len({r.info["batch"] for r in res}) == 1  # one batch: its reservation is the whole call
    reserved = res[0].info["reserved_bytes"]
    used = peak[0] - base
    assert 0.9 * reserved <= used <= 1.1 * reserved, (used, reserved)


def test_m_auto_batches_below_the_devices_amg_threshold_and_runs_alone_above():
    """A large Poisson system with M="auto" batches on a GPU (AMG from 1M unknowns there)
    and is solved alone on the CPU, where the policy may set up AMG."""
    from managed_solve.scheduling.estimate import BATCH, SINGLE, route
    from managed_solve.system.method import amg_min_n
    from tests._problems import poisson2d

    A = poisson2d(450)
    s = LinearSystem(A, np.ones(A.shape[0]))
    assert s.M == "auto" and amg_min_n("cpu") <= s.n < amg_min_n("cuda")
    assert route(s, "cuda")[0] == BATCH
    assert route(s, "sim")[0] == BATCH
    assert route(s, "cpu")[0] == SINGLE
