"""Routes: the batched core's true-residual check and restarts, the host LU, the sharded route."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import DeviceManager, LinearSystem, Status
from managed_solve.scheduling import estimate as estimation
from managed_solve.scheduling import routes, runner, solve_many
from managed_solve.solvers.direct import direct
from tests._problems import convection_diffusion, poisson2d
from tests.scheduling._helpers import assert_solves


@pytest.mark.parametrize("where", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_true_residual_check_restarts_drifted_systems(monkeypatch, where):
    """A batch whose recurrence says converged but whose true residual misses rtol runs again.

    On a GPU the restart packs host systems with their x0 on the GPU.
    """
    from managed_solve.solvers.batched import engine

    run_core = engine.run_core
    calls = []

    def drifting_cg(batch, method, *, true_norms=False, **kw):
        out = run_core(batch, method, **kw)
        calls.append(batch.nsys)
        if len(calls) == 1:  # first batch: spoil every other system's answer, claim convergence
            for name, v in zip(batch.names, batch.unpack(out.x), strict=True):
                if int(name[1:]) % 2:  # odd grid sizes
                    v *= 1.01
            out.true_norms = None  # the host kernels' norms are of the unspoiled x
        if true_norms and out.true_norms is None:  # the true norms of the x returned
            out.true_norms = engine.system_norms(batch, out.x, method)
        return out

    monkeypatch.setattr(engine, "run_core", drifting_cg)  # the batched engine's core (CG here)
    systems = [LinearSystem(poisson2d(m), np.ones(m * m), name=f"p{m}") for m in range(4, 12)]
    dm = DeviceManager(simulate="1x64MiB") if where == "sim" else DeviceManager(["cuda:0"])
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert calls[:2] == [8, 4]  # one batch, then the 4 spoiled systems together
    assert [bool(r.info.get("restarted")) for r in results] == [m % 2 == 1 for m in range(4, 12)]


def test_device_time_of_a_batch_comes_from_its_own_results():
    from managed_solve.result import SolveResult

    def res(**info):
        return SolveResult(None, Status.CONVERGED, info=info)

    assert runner.device_seconds([res(), res(gpu_seconds=None)]) is None  # host batches: none
    # A restarted or polished result carries another solve's time; the batch's own counts.
    out = [res(gpu_seconds=0.001, restarted=True), res(gpu_seconds=0.5, polished=True),
           res(gpu_seconds=0.04), res(gpu_seconds=0.04)]
    assert runner.device_seconds(out) == 0.04


def test_host_lu_matches_the_packages_sparse_lu_and_meets_the_tolerance():
    """The DIRECT route is solvers.direct (the one sparse LU), checked by the verify rule."""
    A = poisson2d(12)
    b = np.linspace(1.0, 2.0, 144)
    s = LinearSystem(A, b, rtol=1e-10, name="lu")
    res = routes.host_lu(s, symmetric=True)
    assert res.status is Status.CONVERGED and res.method == "direct" and res.iterations == 1
    np.testing.assert_array_equal(res.x, direct(A, b, symmetric=True).x)
    assert np.linalg.norm(b - A @ res.x) <= 1e-10 * np.linalg.norm(b)


def test_host_lu_of_a_singular_matrix_is_a_breakdown_naming_the_fix():
    A = sp.csr_matrix(np.array([[1.0, 1.0], [1.0, 1.0]]))
    given = LinearSystem(A, np.ones(2), method="direct", name="singular")
    res = routes.host_lu(given, symmetric=True)
    assert res.status is Status.BREAKDOWN and res.x is None and "singular" in res.message


def test_host_lu_of_a_consistent_singular_system_falls_back_to_krylov_under_auto():
    """b lies in A's range: CG converges where the LU meets a zero pivot."""
    A = sp.csr_matrix(np.array([[1.0, 1.0], [1.0, 1.0]]))
    res = routes.host_lu(LinearSystem(A, np.ones(2), name="singular"), symmetric=True)
    assert res.status is Status.CONVERGED and res.info["fallback_from"] == "direct"
    assert res.method == "cg"
    np.testing.assert_allclose(A @ res.x, np.ones(2), atol=1e-12)


# ----------------------------------------------------------------------------- sharded
@pytest.fixture
def mix():
    big = poisson2d(100)  # 10,000 unknowns: about 1.3 MB with its CG workspace
    small = [poisson2d(n) for n in (8, 12, 16)]
    rng = np.random.default_rng(3)
    return [LinearSystem(A, rng.standard_normal(A.shape[0]), name=f"s{k}")
            for k, A in enumerate([small[0], big, small[1], small[2]])]


def test_oversized_system_is_sharded_over_two_devices(mix):
    dm = DeviceManager(simulate="2x1MiB", reserved=0.0)
    res = solve_many(mix, manager=dm, rtol=1e-10)
    big = res[1]
    assert big.converged and big.info.get("shards") == 2 and big.name == "s1"
    assert big.info["devices"] == ["sim:0", "sim:1"]
    for s, r in zip(mix, res, strict=True):
        assert r.converged and r.name == s.name
        np.testing.assert_allclose(r.to_numpy(), spla.spsolve(s.A.tocsc(), s.b), rtol=1e-6, atol=1e-8)


def test_oversized_system_with_one_device_goes_to_the_cpu(mix):
    dm = DeviceManager(simulate="1x1MiB", reserved=0.0)
    res = solve_many(mix, manager=dm, rtol=1e-10)
    assert res[1].converged and res[1].device == "cpu" and "shards" not in res[1].info


def test_a_failing_sharded_solve_loses_nothing_else(mix, monkeypatch):
    """A sharded solve that raises (not a device error) gives that system a failed result only."""
    import sys

    solve_module = sys.modules["managed_solve._solve"]
    real = solve_module.solve

    def broken(system, *args, devices=None, **kwargs):
        if devices is not None:
            raise RuntimeError("halo exchange went wrong")
        return real(system, *args, **kwargs)

    monkeypatch.setattr(solve_module, "solve", broken)
    dm = DeviceManager(simulate="2x1MiB", reserved=0.0)
    res = solve_many(mix, manager=dm, rtol=1e-10)
    assert not res[1].converged and res[1].status.name == "DEVICE_ERROR" and res[1].name == "s1"
    assert "RuntimeError: halo exchange went wrong" in res[1].message
    for k in (0, 2, 3):
        assert res[k].converged and res[k].name == mix[k].name
    with pytest.raises(Exception, match="s1"):
        solve_many(mix, manager=dm, rtol=1e-10, on_error="raise")


def test_a_sharded_system_holds_its_shards_bytes_in_the_ledger_while_it_runs(mix, monkeypatch):
    from managed_solve.sharded import ShardedSystem, predict_shard_bytes

    dm = DeviceManager(simulate="2x1MiB", reserved=0.0)
    held = []  # the ledger on each device as the sharded system is built there
    real = ShardedSystem.__init__

    def spying(self, *args, **kwargs):
        held.append([dm.reserved_bytes(d) for d in dm.accelerators])
        real(self, *args, **kwargs)

    monkeypatch.setattr(ShardedSystem, "__init__", spying)
    res = solve_many(mix, manager=dm, rtol=1e-10)
    assert res[1].converged and res[1].info.get("shards") == 2
    big = mix[1]
    shard = dm.size_of(predict_shard_bytes(big.n, big.nnz, 2))  # CG's, the method it runs
    assert len(held) == 1 and all(shard <= b <= dm.capacity(d)
                                  for b, d in zip(held[0], dm.accelerators, strict=True))
    assert all(dm.reserved_bytes(d) == 0 for d in dm.inventory)


def test_a_sharded_system_whose_devices_filled_up_after_the_plan_runs_on_the_cpu(mix):
    """Other work takes the devices' room as the call's first batch starts: the shards
    cannot hold their bytes there any more, so the system is solved on the CPU."""
    dm = DeviceManager(simulate="2x1MiB", reserved=0.0)
    taken = []

    def fill(dev, nbytes):
        if not taken:
            taken.extend(dm.reserve(dm.available_bytes(d), device=d) for d in dm.accelerators)

    for d in dm.accelerators:
        d.fault = fill
    res = solve_many(mix, manager=dm, rtol=1e-10)
    assert res[1].device == "cpu" and "MemoryError" in res[1].info["sharded_failure"]
    for s, r in zip(mix, res, strict=True):
        assert r.converged and r.name == s.name
        np.testing.assert_allclose(r.to_numpy(), spla.spsolve(s.A.tocsc(), s.b), rtol=1e-6, atol=1e-8)
    assert [dm.reserved_bytes(d) for d in dm.accelerators] == [r.nbytes for r in taken]
    for r in taken:
        r.release()
    assert all(dm.reserved_bytes(d) == 0 for d in dm.inventory)


def test_an_oversized_gmres_system_goes_to_the_cpu_not_to_the_sharded_solver(mix):
    """The sharded solver runs CG and BiCGStab only: a GMRES system too large for one device runs on the CPU."""
    # GMRES's 33 vectors a row: the big system (about 3.4 MB) fits no device, but
    # would fit two as shards.
    dm = DeviceManager(simulate="2x2MiB", reserved=0.0)
    res = solve_many(mix, manager=dm, rtol=1e-10, method="gmres")
    assert all(r.converged and r.method == "gmres" for r in res), [r.message for r in res]
    assert res[1].device == "cpu" and "shards" not in res[1].info
    assert {r.device for r in res[::2]} <= {"sim:0", "sim:1"}
    for s, r in zip(mix, res, strict=True):
        ref = spla.spsolve(s.A.tocsc(), s.b)
        np.testing.assert_allclose(r.to_numpy(), ref, rtol=0, atol=1e-6 * np.abs(ref).max())


def test_systems_sharing_a_matrix_are_factorised_once_on_the_host(monkeypatch):
    """One operator, many right-hand sides (a time loop, a sweep): one LU for all of them."""
    from managed_solve.solvers.direct import DirectEngine

    made = []
    real = DirectEngine.prepare
    monkeypatch.setattr(DirectEngine, "prepare",
                        lambda self, A, *a, **k: (made.append(id(A)), real(self, A, *a, **k))[1])
    A, other = poisson2d(20), poisson2d(15)
    rng = np.random.default_rng(5)
    pairs = [(A, rng.standard_normal(400)) for _ in range(12)] + [(other, np.ones(225))] * 10
    # Alone, each would go to CG; shared, one LU each is predicted sooner.
    from managed_solve.system.method import cg_beats_lu

    assert cg_beats_lu(A, 1e-10) and cg_beats_lu(other, 1e-10)
    assert not cg_beats_lu(A, 1e-10, rhs=12) and not cg_beats_lu(other, 1e-10, rhs=10)
    res = solve_many(pairs, manager=DeviceManager(["cpu"]), rtol=1e-10)
    assert all(r.converged and r.method == "direct" for r in res)
    assert sorted(made) == sorted([id(A), id(other)])
    for (M, b), r in zip(pairs, res, strict=True):
        assert np.linalg.norm(b - M @ r.x) <= 1e-10 * np.linalg.norm(b)


def test_solve_many_on_gpus_starts_the_cuda_modules_it_will_launch(monkeypatch):
    """The batched CUDA modules start compiling as a GPU call begins: the method's family,
    each value dtype, every GPU; nothing for host-only devices or non-batched methods."""
    import managed_solve.solvers.batched as batched
    from managed_solve.devices import Device, cpu_device

    calls = []
    monkeypatch.setattr(batched, "prefetch_kernels",
                        lambda ids, dt, it, fams: calls.append((list(ids), np.dtype(dt).name,
                                                                np.dtype(it).name, fams)))
    gpus = [Device("cuda", 0, "gpu0", 1 << 30), Device("cuda", 1, "gpu1", 1 << 30)]
    systems = [LinearSystem(poisson2d(5), np.ones(25)),
               LinearSystem(poisson2d(4).astype(np.float32), np.ones(16, np.float32)), None]
    estimation.prefetch_cuda_modules(systems, [cpu_device(), *gpus], "auto")
    assert calls == [([0, 1], "float32", "int32", ("cg",)), ([0, 1], "float64", "int32", ("cg",))]
    calls.clear()
    estimation.prefetch_cuda_modules(systems, gpus[1:], "gmres")
    assert calls == [([1], "float32", "int32", ("gmres",)), ([1], "float64", "int32", ("gmres",))]
    calls.clear()
    # Dtypes the call started before validation (many.start_cuda) are not started again.
    estimation.prefetch_cuda_modules(systems, gpus, "auto", skip={np.dtype(np.float64)})
    assert calls == [([0, 1], "float32", "int32", ("cg",))]
    estimation.prefetch_cuda_modules(systems, gpus, "auto",
                                     skip={np.dtype(np.float32), np.dtype(np.float64)})
    assert calls == [([0, 1], "float32", "int32", ("cg",))]
    calls.clear()
    estimation.prefetch_cuda_modules(systems, [cpu_device(), Device("sim", 0, "sim", 1 << 30)], "cg")
    estimation.prefetch_cuda_modules(systems, gpus, "direct")
    assert calls == []


def _spy_solve_to(monkeypatch):
    from managed_solve.solvers.direct import PreparedDirect

    shapes = []
    real = PreparedDirect.solve_to
    monkeypatch.setattr(PreparedDirect, "solve_to", lambda self, b, *a, **k: (
        shapes.append(b.shape), real(self, b, *a, **k))[1])
    return shapes


def test_systems_sharing_a_matrix_are_solved_as_blocks_each_to_its_own_tolerance(monkeypatch):
    """The systems of one matrix object in a batch are one block on its factors; each column is
    judged by its own system's tolerance, as solved alone, and gets a vector of its own."""
    shapes = _spy_solve_to(monkeypatch)
    A, other = poisson2d(20), poisson2d(15)
    rng = np.random.default_rng(6)
    tolerances = [(1e-10, 0.0), (1e-12, 0.0), (1e-11, 0.0), (1e-20, 0.0), (1e-20, 1e-3)] * 3
    systems = [LinearSystem(A, rng.standard_normal(400), rtol=r, atol=a, name=f"a{k}")
               for k, (r, a) in enumerate(tolerances)]
    systems += [LinearSystem(other, rng.standard_normal(225), rtol=1e-10, name=f"o{k}")
                for k in range(12)]
    res = solve_many(systems, manager=DeviceManager(["cpu"]))
    assert all(r.method == "direct" for r in res)
    assert any(len(s) == 2 and s[1] > 1 for s in shapes)  # blocks, not one column a call
    assert sum(s[1] if len(s) == 2 else 1 for s in shapes) == len(systems)
    refs = {id(A): spla.splu(A.tocsc()), id(other): spla.splu(other.tocsc())}
    symmetric = True
    for s, r in zip(systems, res, strict=True):
        x = r.to_numpy()
        assert x.flags.c_contiguous and x.shape == (s.n,)
        alone = routes.host_lu(s, symmetric)
        assert (r.status, r.name) == (alone.status, s.name)
        assert r.residual_norm == pytest.approx(np.linalg.norm(s.b - s.A @ x), rel=1e-3,
                                                abs=1e-14 * np.linalg.norm(s.b))
        tol = max(s.rtol * np.linalg.norm(s.b), s.atol)
        # Converged exactly when the true residual meets the system's own tolerance.
        assert r.converged == (np.linalg.norm(s.b - s.A @ x) <= tol * (1 + 1e-6)), s.name
        ref = refs[id(s.A)].solve(s.b)
        np.testing.assert_allclose(x, ref, rtol=1e-6, atol=1e-9 * np.abs(ref).max())
    # An rtol float64 cannot meet: x kept, an honest status; with an atol it converges.
    assert res[3].status is Status.MAXITER and res[4].converged
    xs = [r.to_numpy() for r in res]
    assert not any(np.shares_memory(xs[i], xs[j]) for i in range(len(xs)) for j in range(i))


def test_a_singular_shared_matrix_falls_back_for_every_system_of_its_block(monkeypatch):
    alone = []
    real = routes.host_lu
    monkeypatch.setattr(routes, "host_lu", lambda s, *a, **k: alone.append(s) or real(s, *a, **k))
    A = poisson2d(12).tolil()
    A[7, :] = 0.0
    A[:, 7] = 0.0
    A = A.tocsr()
    A.eliminate_zeros()
    rng = np.random.default_rng(7)
    systems = [LinearSystem(A, A @ rng.standard_normal(144), rtol=1e-9) for _ in range(6)]
    res = solve_many(systems, manager=DeviceManager(["cpu"]))
    assert alone == []  # none solved on its own: blocks
    for s, r in zip(systems, res, strict=True):
        assert r.converged and r.info.get("fallback_from") == "direct", r.message
        assert np.linalg.norm(s.b - A @ r.to_numpy()) <= 1e-9 * np.linalg.norm(s.b)


def test_gradients_through_a_block_of_systems_sharing_a_matrix(monkeypatch):
    """b's gradients of systems solved as one block: adjoints on the block's kept factors."""
    torch = pytest.importorskip("torch")
    shapes = _spy_solve_to(monkeypatch)
    A = poisson2d(9) + sp.diags(np.linspace(0.0, 0.5, 81), 1, shape=(81, 81))  # non-symmetric
    A = A.tocsr()
    rng = np.random.default_rng(8)
    bs = [torch.tensor(rng.standard_normal(81), requires_grad=True) for _ in range(5)]
    res = solve_many([LinearSystem(A, b, rtol=1e-12) for b in bs], manager=DeviceManager(["cpu"]))
    assert all(r.method == "direct" for r in res) and any(len(s) == 2 for s in shapes)
    w = torch.linspace(-1.0, 1.0, 81, dtype=torch.float64)
    sum((r.to_torch() * w * (k + 1)).sum() for k, r in enumerate(res)).backward()
    At = spla.splu(A.T.tocsc())
    for k, b in enumerate(bs):
        np.testing.assert_allclose(b.grad.numpy(), At.solve(w.numpy() * (k + 1)), rtol=1e-9,
                                   atol=1e-12)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("device", ["cpu", "sim:0", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_batched_system_that_fails_says_why_and_a_hopeless_start_is_dropped(device):
    """A batch's failures carry solve()'s message; a start far beyond the solution (its residual
    overflows) is judged as solve() judges it: dropped for x = 0, and the system solved."""
    A, C = poisson2d(8), convection_diffusion(8)
    n = A.shape[0]
    b = np.ones(n)
    systems = [LinearSystem(A, b, method="cg", x0=np.full(n, 1e300)),
               LinearSystem(A, b, method="cg", maxiter=2),
               LinearSystem(C, b, method="bicgstab", x0=np.full(n, 1e300)),
               LinearSystem(A, b, method="cg")]
    dm = DeviceManager([device]) if device != "sim:0" else DeviceManager([device], simulate="1x1GiB")
    res = solve_many(systems, manager=dm)
    for k in (0, 2, 3):
        M = C if k == 2 else A
        assert res[k].status is Status.CONVERGED, res[k].message
        x = spla.spsolve(M.tocsc(), b)
        assert np.linalg.norm(res[k].to_numpy() - x) <= 1e-6 * np.linalg.norm(x)
    assert "started from x = 0" in res[0].message and "started from x = 0" in res[2].message
    assert res[1].status is Status.MAXITER and "raise maxiter" in res[1].message
