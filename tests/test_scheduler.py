"""solve_many: results against SciPy, order, invalid inputs, admission, OOM recovery, learning.

Simulated GPUs (``DeviceManager(simulate=...)``) run the batched core on the
host with a memory budget, so placement, admission and recovery are tested
here; the ``gpu`` / ``multi_gpu`` cases run the same on real GPUs.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

import managed_solve as ms
from managed_solve import LinearSystem, Status
from managed_solve import config as ms_config
from managed_solve import scheduler as sched
from managed_solve.devices import SimulatedOutOfMemory
from managed_solve.manager import DeviceManager
from managed_solve.packing import Estimate, bytes_per_iteration, predict_iterations, solve_bytes
from managed_solve.scheduler import SolveManyError, solve_many


def poisson2d(m: int, dtype=np.float64) -> sp.csr_matrix:
    T = sp.diags([-1.0, 4.0, -1.0], [-1, 0, 1], shape=(m, m))
    S = sp.diags([-1.0, -1.0], [-1, 1], shape=(m, m))
    return (sp.kron(sp.identity(m), T) + sp.kron(S, sp.identity(m))).tocsr().astype(dtype)


def convection(m: int) -> sp.csr_matrix:
    """Poisson plus a skew-symmetric (convection) part: non-symmetric, positive definite.

    ``x^T A x = x^T P x > 0``, so BiCGStab and GMRES converge on it.
    """
    U = sp.diags([0.5], [1], shape=(m * m, m * m))
    return (poisson2d(m) + U - U.T).tocsr()


def mixed_systems(count: int, seed: int = 0, lo: int = 3, hi: int = 16):
    rng = np.random.default_rng(seed)
    out = []
    for k, m in enumerate(rng.integers(lo, hi, size=count)):
        m = int(m)
        A = convection(m) if k % 5 == 4 else poisson2d(m)
        out.append(LinearSystem(A, rng.standard_normal(m * m), rtol=10.0 ** -rng.integers(6, 11),
                                name=f"s{k}"))
    return out


def assert_solves(systems, results):
    """Each result is the system's own, meets its rtol by the TRUE residual, and matches SciPy."""
    assert len(results) == len(systems)
    for s, r in zip(systems, results, strict=True):
        assert r.name == s.name
        assert r.status is Status.CONVERGED, (s.name, r.status, r.message)
        A, b = s.A, s.b
        x = r.to_numpy()
        assert np.linalg.norm(b - A @ x) <= s.rtol * np.linalg.norm(b)
        # The residual is computed where x lies (a GPU sums in another order): the two
        # agree to the rounding of b - A x, about eps * (|b| + |A| |x|) per entry.
        rounding = 8 * np.finfo(x.dtype).eps * np.linalg.norm(np.abs(b) + abs(A) @ np.abs(x))
        assert r.residual_norm == pytest.approx(np.linalg.norm(b - A @ x), rel=1e-6, abs=rounding)
        ref = spla.spsolve(A.tocsc(), b)
        cond_margin = 1e4  # the error is at most cond(A) times the relative residual
        assert np.linalg.norm(x - ref) <= cond_margin * s.rtol * np.linalg.norm(ref)


def assert_converged(systems, results, rtol=1e-8):
    """Each result converged and meets ``rtol`` by its true residual (unnamed systems too)."""
    for s, r in zip(systems, results, strict=True):
        assert r.converged
        assert np.linalg.norm(s.b - s.A @ r.to_numpy()) <= rtol * np.linalg.norm(s.b)


@pytest.fixture
def sims():
    return DeviceManager(simulate="2x64MiB")


def test_results_in_input_order_each_meeting_its_own_rtol(sims):
    systems = mixed_systems(60)
    # Without work stealing every batch runs where the plan put it, so the
    # devices seen depend on the plan alone, not on which thread ran first.
    with ms_config.override(work_stealing=False):
        results = solve_many(systems, manager=sims)
    assert_solves(systems, results)
    assert {r.device for r in results} == {"sim:0", "sim:1"}  # dispersed
    assert any(r.info["batch_size"] > 1 for r in results)  # batched
    assert {r.method for r in results} == {"cg", "bicgstab"}  # auto: by symmetry
    assert sims.reserved_bytes("sim:0") == sims.reserved_bytes("sim:1") == 0  # all released


def test_pairs_dtypes_and_rtol_override(sims):
    A32 = poisson2d(6, np.float32)
    pairs = [(poisson2d(5), np.ones(25)), (A32, np.ones(36, dtype=np.float32)),
             (poisson2d(7), np.arange(49.0))]
    results = solve_many(pairs, rtol=1e-5, manager=sims, return_on="host")
    for (A, b), r in zip(pairs, results, strict=True):
        assert isinstance(r.x, np.ndarray) and r.x.dtype == A.dtype
        assert r.converged
        assert np.linalg.norm(b - A @ r.x) <= 1e-5 * np.linalg.norm(b) * (1 + 1e-3)
    assert [r.name for r in results] == ["systems[0]", "systems[1]", "systems[2]"]


def test_invalid_systems_are_reported_and_the_rest_go_on(sims):
    good = mixed_systems(6, seed=1)
    nan_b = np.ones(16)
    nan_b[3] = np.nan
    items = [good[0], (sp.random(4, 5, density=0.5, format="csr"), np.ones(4)), good[1],
             (poisson2d(4), nan_b), "not a system", good[2], (poisson2d(4), np.ones(15)),
             (poisson2d(4).astype(np.complex128), np.ones(16)), *good[3:]]
    results = solve_many(items, manager=sims)
    bad = {1: "square", 3: "NaN", 4: "LinearSystem or an (A, b) pair", 6: "shape (16,)",
           7: "complex"}
    for i, words in bad.items():
        assert results[i].status is Status.INVALID_INPUT
        assert results[i].x is None
        assert words in results[i].message, results[i].message
    rest = [i for i in range(len(items)) if i not in bad]
    assert_solves([items[i] for i in rest], [results[i] for i in rest])


def test_cpu_only_uses_the_host_lu_and_matches_scipy():
    systems = mixed_systems(30, seed=2)
    results = solve_many(systems, manager=DeviceManager(["cpu"]))
    assert_solves(systems, results)
    assert {r.method for r in results} == {"direct"}
    assert {r.device for r in results} == {"cpu"}


def test_explicit_method_on_the_cpu_runs_the_batched_core():
    systems = mixed_systems(12, seed=3)
    results = solve_many(systems, method="bicgstab", manager=DeviceManager(["cpu"]))
    assert_solves(systems, results)
    assert {r.method for r in results} == {"bicgstab"}
    assert max(r.iterations for r in results) > 1


def test_jacobi_preconditioner_batches():
    rng = np.random.default_rng(4)
    systems = []
    for k in range(8):
        m = 6 + k
        D = sp.diags(rng.uniform(1, 100, m * m))  # badly scaled: Jacobi helps
        A = (D @ poisson2d(m) @ D).tocsr()
        systems.append(LinearSystem(A, rng.standard_normal(m * m), name=f"j{k}"))
    results = solve_many(systems, M="jacobi", manager=DeviceManager(simulate="1x64MiB"))
    assert_solves(systems, results)


def test_systems_the_batched_core_cannot_take_go_through_solve(sims):
    A = sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(50, 50), format="csr")
    b = np.linspace(1.0, 2.0, 50)
    items = [LinearSystem(A, b, method="minres", name="minres"), (A.toarray(), b),
             (spla.aslinearoperator(A), b), LinearSystem(A, b, method="direct", name="direct"),
             LinearSystem(A, b, M="neumann", name="neumann"), (A, b)]
    results = solve_many(items, manager=sims)
    ref = spla.spsolve(A.tocsc(), b)
    for r in results:
        assert r.converged, r
        assert np.linalg.norm(b - A @ r.to_numpy()) <= 1e-8 * np.linalg.norm(b)
        np.testing.assert_allclose(r.to_numpy(), ref, rtol=1e-6)
    assert [r.info["batch_size"] for r in results[:5]] == [1] * 5
    assert results[0].method == "minres" and results[3].method == "direct"
    assert results[5].method == "cg"


@pytest.mark.parametrize("where", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gmres_systems_are_batched(where):
    """method="gmres": many non-symmetric systems share batches, each to its own rtol."""
    rng = np.random.default_rng(8)
    systems = []
    for k in range(24):
        m = 4 + k % 9
        A = convection(m) if k % 2 else (poisson2d(m) + sp.diags([0.9], [1], shape=(m * m, m * m))).tocsr()
        systems.append(LinearSystem(A, rng.standard_normal(m * m), rtol=10.0 ** -(6 + k % 5),
                                    method="gmres", name=f"g{k}"))
    dm = DeviceManager(simulate="2x256MiB") if where == "sim" else DeviceManager(["cuda:0"])
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert {r.method for r in results} == {"gmres"}
    assert max(r.info["batch_size"] for r in results) > 1  # batched, not one solve() each


@pytest.mark.parametrize("where", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_auto_on_an_indefinite_matrix_recovers_from_cg_breakdown(where):
    # Symmetric with a positive diagonal, so "auto" tries CG, but indefinite.
    A = sp.csr_matrix(np.array([[1.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 3.0]]))
    b = np.array([1.0, -1.0, 1.0])
    spd = poisson2d(5)
    dm = DeviceManager(simulate="2x64MiB") if where == "sim" else DeviceManager(["cuda:0"])
    results = solve_many([(A, b), (spd, np.ones(25))], manager=dm)
    assert all(r.converged for r in results)
    np.testing.assert_allclose(A @ results[0].to_numpy(), b, atol=1e-10)
    assert results[0].method == "minres" and results[0].info["fallback_from"] == "cg"
    assert results[1].method == "cg" and "fallback_from" not in results[1].info


@pytest.mark.parametrize("where", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_auto_on_a_skew_matrix_recovers_from_bicgstab_breakdown(where, monkeypatch):
    # Non-symmetric, so "auto" tries BiCGStab; r0 . A r0 = 0 for a skew-symmetric A,
    # so it breaks down at once, and goes again through the batched GMRES. The
    # batch's other systems are not touched.
    import importlib

    solve_mod = importlib.import_module("managed_solve._solve")
    alone = []
    real_prepare = solve_mod.prepare
    monkeypatch.setattr(solve_mod, "prepare",
                        lambda system, method, *a, **k: (alone.append(method), real_prepare(system, method, *a, **k))[1])
    rot = sp.csr_matrix(np.array([[0.0, 1.0], [-1.0, 0.0]]))
    A = sp.block_diag([rot, 2 * rot, 3 * rot], format="csr")
    b = np.ones(6)
    conv = convection(6)
    dm = DeviceManager(simulate="2x64MiB") if where == "sim" else DeviceManager(["cuda:0"])
    results = solve_many([(A, b), (conv, np.ones(36))], manager=dm)
    assert all(r.converged for r in results), [r.message for r in results]
    assert {r.device for r in results} <= {"sim:0", "sim:1", "cuda:0"}
    np.testing.assert_allclose(A @ results[0].to_numpy(), b, atol=1e-10)
    assert results[0].method == "gmres" and results[0].info["fallback_from"] == "bicgstab"
    assert results[0].iterations >= 1  # the broken-down attempt's iterations are counted
    assert alone == []  # solved again as a GMRES batch, not alone through solve()
    assert results[1].method == "bicgstab" and "fallback_from" not in results[1].info
    x = spla.spsolve(conv.tocsc(), np.ones(36))
    np.testing.assert_allclose(results[1].to_numpy(), x, rtol=1e-6)


def test_disperse_false_keeps_everything_on_one_device(sims):
    systems = mixed_systems(20, seed=5)
    results = solve_many(systems, disperse=False, manager=sims)
    assert_solves(systems, results)
    assert len({r.device for r in results}) == 1


def test_devices_argument_selects_devices():
    dm = DeviceManager(simulate="3x64MiB")
    systems = mixed_systems(20, seed=6)
    results = solve_many(systems, devices="sim:2", manager=dm)
    assert {r.device for r in results} == {"sim:2"}
    with pytest.raises(ValueError, match="sim:7"):
        solve_many(systems, devices=["sim:7"], manager=dm)


class LedgerWatch(DeviceManager):
    """A DeviceManager that records the ledger's high-water mark per device."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.high: dict[str, int] = {}

    def reserve(self, nbytes, device=None, **kw):
        r = super().reserve(nbytes, device, **kw)
        d = str(r.device)
        self.high[d] = max(self.high.get(d, 0), self.reserved_bytes(d))
        return r


def test_admission_never_over_budget_and_oversized_systems_spill_to_the_cpu():
    dm = LedgerWatch(simulate="2x1MiB")  # room for a few thousand unknowns per batch
    systems = mixed_systems(40, seed=7, lo=3, hi=20)
    # about 3.4 MB: fits no sim, nor both together (so it is not sharded either)
    big = LinearSystem(poisson2d(150), np.ones(22_500), name="big")
    systems.insert(5, big)
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    for d in dm.accelerators:
        assert 0 < dm.high[str(d)] <= dm.capacity(d)
    assert results[5].device == "cpu"
    assert max(r.info["batch_size"] for r in results if r.device != "cpu") > 1


def fail_every_second(counter):
    def fault(dev, nbytes):
        counter[0] += 1
        if counter[0] % 2 == 0:
            raise SimulatedOutOfMemory(f"{dev}: simulated out of memory for {nbytes} bytes")

    return fault


@pytest.mark.parametrize("spec", ["2x64MiB", "1x64MiB"])
def test_out_of_memory_every_second_batch_loses_and_duplicates_nothing(spec, monkeypatch):
    dm = DeviceManager(simulate=spec)
    counter = [0]
    dm.accelerators[0].fault = fail_every_second(counter)
    delivered: list[int] = []
    real, real_many = sched._Runner._deliver, sched._Runner._deliver_many

    def spy(self, i, res):
        delivered.append(i)
        return real(self, i, res)

    def spy_many(self, indices, out):
        delivered.extend(indices)
        return real_many(self, indices, out)

    monkeypatch.setattr(sched._Runner, "_deliver", spy)
    monkeypatch.setattr(sched._Runner, "_deliver_many", spy_many)
    systems = mixed_systems(80, seed=8, lo=3, hi=12)
    results = solve_many(systems, manager=dm)
    assert counter[0] >= 2  # the fault fired
    assert sorted(delivered) == list(range(len(systems)))  # each exactly once
    assert_solves(systems, results)
    assert dm.reserved_bytes("sim:0") == 0


def test_a_device_that_always_fails_ends_on_the_cpu():
    dm = DeviceManager(simulate="1x64MiB")

    def fault(dev, nbytes):
        raise MemoryError("always")

    dm.accelerators[0].fault = fault
    systems = mixed_systems(10, seed=9)
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert {r.device for r in results} == {"cpu"}


# The device part of a batch (the core, true residuals) and its results, on an
# accelerator (results built on the finisher thread) and in one piece.
@pytest.mark.parametrize("where, beside", [("_run_packed", True), ("_results", True),
                                           ("_run_packed", False), ("_results", False),
                                           ("_solve_packed", False)])
def test_a_non_device_error_is_a_device_error_result_not_a_crash(where, beside, monkeypatch):
    dm = DeviceManager(simulate="1x64MiB")
    monkeypatch.setattr(sched, "FINISH_BESIDE", beside)

    def broken(*a, **k):
        raise ZeroDivisionError("bug in a solver")

    monkeypatch.setattr(sched, where, broken)
    systems = mixed_systems(5, seed=10)
    results = solve_many(systems, manager=dm)
    assert all(r.status is Status.DEVICE_ERROR for r in results)
    assert all("ZeroDivisionError" in r.message for r in results)


def test_on_error_raise_lists_the_failures_after_solving_the_rest(sims):
    systems = mixed_systems(6, seed=11)
    stubborn = LinearSystem(poisson2d(12), np.ones(144), maxiter=2, name="stubborn")
    items = [systems[0], stubborn, (np.ones((3, 2)), np.ones(3)), *systems[1:]]
    with pytest.raises(SolveManyError) as info:
        solve_many(items, on_error="raise", manager=sims)
    err = info.value
    assert err.failed == [1, 2]
    assert "systems[1] (stubborn): MAXITER" in str(err)
    assert "systems[2]" in str(err) and "INVALID_INPUT" in str(err)
    assert err.results[1].iterations == 2
    assert_solves(systems, [err.results[i] for i in (0, 3, 4, 5, 6, 7)])
    ok = solve_many(systems, on_error="raise", manager=sims)
    assert all(r.converged for r in ok)


def test_torch_inputs():
    torch = pytest.importorskip("torch")
    dm = DeviceManager(simulate="1x64MiB")
    A = poisson2d(8)
    At = torch.sparse_csr_tensor(torch.from_numpy(A.indptr.astype(np.int64)),
                                 torch.from_numpy(A.indices.astype(np.int64)),
                                 torch.from_numpy(A.data), size=A.shape)
    b = torch.linspace(0, 1, 64, dtype=torch.float64)
    results = solve_many([(At, b), (A, b.numpy())], manager=dm)
    assert all(r.converged for r in results)
    np.testing.assert_allclose(results[0].to_numpy(), spla.spsolve(A.tocsc(), b.numpy()), rtol=1e-6)
    t = results[0].to_torch()
    assert isinstance(t, torch.Tensor) and t.shape == (64,)


def test_progress_bar_counts_every_system(sims, capsys):
    pytest.importorskip("tqdm")
    systems = [*mixed_systems(12, seed=12), ("bad", None)]
    solve_many(systems, progress=True, manager=sims)
    err = capsys.readouterr().err
    assert "13/13" in err and "system" in err


def test_argument_errors_name_the_argument(sims):
    for kw, words in [({"method": "lu"}, "method='lu'"), ({"return_on": "gpu"}, "return_on"),
                      ({"on_error": "ignore"}, "on_error"), ({"rtol": -1.0}, "rtol"),
                      ({"M": "ilu"}, "M='ilu'")]:
        with pytest.raises(ValueError, match=words):
            solve_many([], manager=sims, **kw)
    assert solve_many([], manager=sims) == []


def skewed_estimates(n_large=10, n_tiny=2000):
    rng = np.random.default_rng(13)
    sizes = [200] * n_large + [int(m) for m in rng.integers(16, 65, size=n_tiny)]
    out = []
    for i, m in enumerate(sizes):
        n, nnz = m * m, 5 * m * m - 4 * m
        cost = bytes_per_iteration(n, nnz) * predict_iterations(n)
        out.append(Estimate(i, n, nnz, solve_bytes(n, nnz), cost, "batch", ("cg", "float64", False)))
    return out


def test_plan_of_a_skewed_mix_is_balanced_over_four_devices():
    dm = DeviceManager(simulate="4x8GiB")
    es = skewed_estimates()
    plan = sched.plan_work(es, dm.accelerators, dm)
    ideal = sum(e.cost for e in es) / sum(dm.speed(d) for d in dm.accelerators)
    for name, t in plan.finish_times().items():
        assert abs(t - ideal) <= 0.10 * ideal, (name, t, ideal)
    assert sorted(i for q in plan.queues.values() for b in q for i in b.indices) == list(range(len(es)))


def true_finish(plan, true_speed):
    return {name: sum(b.cost for b in q) / true_speed[name] for name, q in plan.queues.items()}


def test_learned_speeds_balance_the_second_call_better():
    """sim:1 is 2x slower than predicted; after one call's records the plan shifts work off it."""
    dm = DeviceManager(simulate="2x8GiB")
    true_speed = {"sim:0": dm.speed(dm.accelerators[0]), "sim:1": dm.speed(dm.accelerators[1]) / 2}
    es = skewed_estimates(4, 400)

    def run(plan):
        # What the workers do after each batch: record its measured time, here
        # the time the batch takes at the device's true speed.
        for name, q in plan.queues.items():
            for b in q:
                dm.record(("solve_many", b.route, b.group), b.cost / true_speed[name], b.nbytes,
                          device=name, cost=b.cost)
        t = true_finish(plan, true_speed)
        return max(t.values()) / (sum(t.values()) / len(t)) - 1.0

    first = run(sched.plan_work(es, dm.accelerators, dm))
    second = run(sched.plan_work(es, dm.accelerators, dm))
    assert first > 0.25  # the naive plan gives both devices the same work
    assert second < 0.05 < first
    assert dm.speed(dm.accelerators[1]) == pytest.approx(true_speed["sim:1"], rel=0.01)


def test_a_real_call_records_measured_speed():
    dm = DeviceManager(simulate="1x64MiB")
    before = dm.speed(dm.accelerators[0])
    solve_many(mixed_systems(10, seed=14), manager=dm)
    # NumPy on this host streams far less than the 2 TB/s a simulated GPU assumes.
    assert dm.speed(dm.accelerators[0]) < before
    assert any(k.startswith("('solve_many'") for k in dm.hints())


# ----------------------------------------------------------------------------- GPUs
def _cupy():
    from managed_solve import _backend

    return _backend.cupy()


@pytest.mark.gpu
def test_gpu_batches_stay_on_the_gpu_and_meet_rtol():
    cp = _cupy()
    dm = DeviceManager(["cuda:0"])
    systems = mixed_systems(200, seed=20, lo=8, hi=40)
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert {r.device for r in results} == {"cuda:0"}
    assert all(isinstance(r.x, cp.ndarray) and r.x.device.id == 0 for r in results)
    assert max(r.info["batch_size"] for r in results) > 1


@pytest.mark.gpu
def test_gpu_inputs_already_on_the_gpu_and_host_return():
    cp = _cupy()
    cpx = pytest.importorskip("cupyx.scipy.sparse")
    dm = DeviceManager(["cuda:0"])
    A = poisson2d(20)
    pairs = [(cpx.csr_matrix(A), cp.ones(400)), (A, np.ones(400))]
    results = solve_many(pairs, manager=dm, return_on="host")
    for r in results:
        assert isinstance(r.x, np.ndarray)
        assert np.linalg.norm(np.ones(400) - A @ r.x) <= 1e-8 * 20


@pytest.mark.gpu
def test_gpu_out_of_memory_recovery_on_a_real_gpu():
    dm = DeviceManager(["cuda:0"])
    counter = [0]
    dm.accelerators[0].fault = fail_every_second(counter)
    systems = mixed_systems(100, seed=21, lo=8, hi=30)
    results = solve_many(systems, manager=dm)
    assert counter[0] >= 2
    assert_solves(systems, results)


@pytest.mark.multi_gpu
def test_two_gpus_share_the_work_and_results_stay_where_solved():
    cp = _cupy()
    dm = DeviceManager(["cuda:0", "cuda:1"])
    systems = mixed_systems(400, seed=22, lo=20, hi=60)
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert {r.device for r in results} == {"cuda:0", "cuda:1"}
    for r in results:
        assert r.x.device.id == int(r.device.split(":")[1])
    one = solve_many(systems, disperse=False, manager=dm)
    assert len({r.device for r in one}) == 1
    del cp


def test_package_exports_solve_many():
    assert ms.solve_many is solve_many


def test_symmetry_check_sorted_unsorted_and_cached():
    A = poisson2d(6)
    assert sched.is_symmetric(A)
    assert not sched.is_symmetric(convection(6))
    B = A.copy()
    B.data[3] += 1e-6  # breaks symmetry beyond the 1e-12 tolerance
    assert not sched.is_symmetric(B)
    U = sp.csr_matrix((A.data[::-1].copy(), A.indices[::-1].copy(), A.indptr), shape=A.shape)
    U2 = sp.csr_matrix((np.ones(4), [1, 0, 1, 0], [0, 2, 4]), shape=(2, 2))
    U2.has_sorted_indices = False
    assert sched.is_symmetric(U2)
    assert sched.is_symmetric(U) == sched.is_symmetric(U.sorted_indices())
    cache: dict = {}
    assert sched.is_symmetric(A, cache) and cache[id(A)] == (A, True)
    cache[id(A)] = (A, False)  # a cached answer is reused for the same object only
    assert not sched.is_symmetric(A, cache)
    assert sched.is_symmetric(A.copy(), cache)


@pytest.mark.parametrize("where", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_true_residual_check_restarts_drifted_systems(monkeypatch, where):
    """A batch whose recurrence says converged but whose true residual misses rtol runs again.

    On a GPU the restart packs host systems with their x0 on the GPU.
    """
    PackedBatch, cores = sched._core()
    cg_batched = cores["cg"]
    calls = []

    def drifting_cg(batch, **kw):
        out = cg_batched(batch, **kw)
        calls.append(batch.nsys)
        if len(calls) == 1:  # first batch: spoil every other system's answer, claim convergence
            for name, v in zip(batch.names, batch.unpack(out.x), strict=True):
                if int(name[1:]) % 2:  # odd grid sizes
                    v *= 1.01
        return out

    monkeypatch.setattr(sched, "_core", lambda: (PackedBatch, {**cores, "cg": drifting_cg}))
    systems = [LinearSystem(poisson2d(m), np.ones(m * m), name=f"p{m}") for m in range(4, 12)]
    dm = DeviceManager(simulate="1x64MiB") if where == "sim" else DeviceManager(["cuda:0"])
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert calls[:2] == [8, 4]  # one batch, then the 4 spoiled systems together
    assert [bool(r.info.get("restarted")) for r in results] == [m % 2 == 1 for m in range(4, 12)]


@pytest.mark.parametrize("chunk_nnz", [1 << 21, 40])  # one piece; many pieces on the pool
@pytest.mark.parametrize("jacobi", [False, True])
def test_vectorised_host_pack_matches_block_diagonal(jacobi, chunk_nnz):
    from managed_solve.solvers.batched import default_maxiter, pack_host

    rng = np.random.default_rng(30)
    systems = []
    for k, m in enumerate(rng.integers(2, 9, size=7)):
        m = int(m)
        x0 = rng.standard_normal(m * m) if k % 3 == 0 else None
        systems.append(LinearSystem(convection(m) if k % 2 else poisson2d(m), rng.standard_normal(m * m),
                                    x0=x0, rtol=1e-6 * (k + 1), maxiter=50 if k == 2 else None,
                                    name=f"h{k}"))
    # Matrices shared by several systems (read once by the packer), one of them
    # with 64-bit indices (that family is then concatenated, casting).
    wide = poisson2d(4)
    wide.indices, wide.indptr = wide.indices.astype(np.int64), wide.indptr.astype(np.int64)
    for k, A in enumerate([systems[1].A, wide, systems[0].A, wide, systems[1].A]):
        systems.append(LinearSystem(A, rng.standard_normal(A.shape[0]), name=f"shared{k}"))
    assert systems[-1].A is systems[1].A and systems[-2].A is systems[-4].A
    assert systems[-2].A.indices.dtype == np.int64
    made = []

    def empty(size, dtype):  # stands in for the pinned allocator used towards GPUs
        made.append(np.full(size, -1, dtype=dtype))
        return made[-1]

    ours = pack_host(systems, jacobi=jacobi, empty=empty, chunk_nnz=chunk_nnz)
    for attr in ("indptr", "indices", "data", "b", "x0", "row_sys") + (("dinv",) if jacobi else ()):
        assert any(getattr(ours, attr) is m for m in made), attr
    # Reference: SciPy's block diagonal and plain concatenations.
    ref = sp.block_diag([s.A for s in systems], format="csr")
    np.testing.assert_array_equal(ours.indptr, ref.indptr)
    np.testing.assert_array_equal(ours.indices, ref.indices)
    np.testing.assert_array_equal(ours.data, ref.data)
    assert ours.indptr.dtype == ours.indices.dtype == np.int32
    np.testing.assert_array_equal(ours.b, np.concatenate([s.b for s in systems]))
    np.testing.assert_array_equal(
        ours.x0, np.concatenate([s.x0 if s.x0 is not None else np.zeros(s.n) for s in systems]))
    sizes = [s.n for s in systems]
    np.testing.assert_array_equal(ours.offsets, np.concatenate([[0], np.cumsum(sizes)]))
    np.testing.assert_array_equal(ours.row_sys, np.repeat(np.arange(len(systems)), sizes))
    np.testing.assert_array_equal(ours.rtol, [s.rtol for s in systems])
    np.testing.assert_array_equal(ours.maxiter, [s.maxiter or default_maxiter(s.n) for s in systems])
    if jacobi:
        np.testing.assert_allclose(ours.dinv, 1.0 / ref.diagonal())
    else:
        assert ours.dinv is None
    assert ours.names == [s.name for s in systems]


def test_backend_argument_is_checked(sims):
    pairs = [(poisson2d(3), np.ones(9))]
    with pytest.raises(ValueError, match="backend='mpi'"):
        solve_many(pairs, backend="mpi", manager=sims)
    with pytest.raises(TypeError, match="address"):
        solve_many(pairs, address="auto", manager=sims)
    with pytest.raises(TypeError, match="manager"):
        solve_many(pairs, backend="ray", manager=sims)


@pytest.mark.parametrize("chunk_nnz", [1 << 21, 30])
def test_host_pack_names_a_system_jacobi_cannot_scale(chunk_nnz):
    systems = [LinearSystem(poisson2d(4), np.ones(16), name=f"z{k}") for k in range(5)]
    A = poisson2d(4).tolil()
    A[2, 2] = 0.0
    systems[3] = LinearSystem(A.tocsr(), np.ones(16), name="zero-diagonal")
    from managed_solve.solvers.batched import pack_host

    with pytest.raises(ValueError, match="zero-diagonal has a zero on its diagonal"):
        pack_host(systems, jacobi=True, chunk_nnz=chunk_nnz)


def test_an_idle_device_takes_queued_batches_from_a_slow_one(monkeypatch):
    """Work stealing: the plan splits the batches evenly, one device is slow, the other drains it."""
    dm = DeviceManager(simulate="2x1GiB")
    slow = dm.accelerators[0]
    runners = runners_started(monkeypatch)

    def stalled_until_stolen_from(dev, nbytes):
        # The slow device holds its first batch until the other device has
        # taken one of its queued batches: the outcome depends on no timing.
        deadline = time.monotonic() + 60
        while not (runners and runners[0].stolen) and time.monotonic() < deadline:
            time.sleep(0.005)

    monkeypatch.setattr(slow, "fault", stalled_until_stolen_from)
    systems = [LinearSystem(poisson2d(m), np.ones(m * m), rtol=1e-8, method="cg", name=f"s{k}")
               for k, m in enumerate([24] * 48)]
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    (runner,) = runners
    planned = {name: len(q) for name, q in runner.plan.queues.items() if q}
    assert planned.get(str(slow), 0) >= 3  # the plan gave the slow device its share
    ran = {}
    for dev, _bid, _n in runner.batches_run:
        ran[dev] = ran.get(dev, 0) + 1
    assert runner.stolen and all(thief != str(slow) for thief, _v, _b in runner.stolen)
    assert ran[str(slow)] < planned[str(slow)]
    assert sum(ran.values()) == sum(planned.values())  # nothing run twice or lost


def test_large_matrices_method_found_beside_the_estimates(monkeypatch):
    """The prefetch of large matrices' method gives the same routes and results."""
    monkeypatch.setattr(sched, "PREFETCH_MIN_NNZ", 100)
    seen = []
    real = sched._krylov_method

    def spy(s, cache):
        seen.append(threading.current_thread().name)
        return real(s, cache)

    monkeypatch.setattr(sched, "_krylov_method", spy)
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


def test_every_matrix_method_found_beside_the_estimates_on_many_cores(monkeypatch):
    """With enough cores every distinct host matrix is tested on the helper threads, once."""
    monkeypatch.setattr(sched, "PREFETCH_ALL_CORES", 1)
    monkeypatch.setattr(sched, "PREFETCH_SMALL_NNZ", 1)
    calls: dict[int, list[str]] = {}
    real = sched._krylov_method

    def spy(s, cache):
        calls.setdefault(id(s.A), []).append(threading.current_thread().name)
        return real(s, cache)

    monkeypatch.setattr(sched, "_krylov_method", spy)
    mats = [poisson2d(m) for m in (4, 5, 6)] + [convection(7)]
    systems = [LinearSystem(mats[k % 4], np.ones(mats[k % 4].shape[0]), rtol=1e-8) for k in range(12)]
    results = solve_many(systems, manager=DeviceManager(simulate="1x1GiB"))
    assert set(calls) == {id(A) for A in mats}
    for threads in calls.values():  # each matrix's method found once, on a helper thread
        assert threads[0].startswith("managed_solve-prefetch")
    assert [r.method for r in results[:4]] == ["cg", "cg", "cg", "bicgstab"]
    assert_converged(systems, results)


def test_large_matrices_are_tested_alone_before_the_small_ones(monkeypatch):
    """The large matrices' tests run first, alone; the small ones start once they are done."""
    import time as _time

    monkeypatch.setattr(sched, "PREFETCH_ALL_CORES", 1)
    monkeypatch.setattr(sched, "PREFETCH_SMALL_NNZ", 1)
    monkeypatch.setattr(sched, "PREFETCH_MIN_NNZ", 1000)
    spans: dict[int, tuple[float, float]] = {}
    real = sched._krylov_method

    def spy(s, cache):
        if s.nnz in spans:  # the estimate loop asking again (answered from the cache)
            return real(s, cache)
        t0 = _time.perf_counter()
        if s.nnz >= 1000:
            _time.sleep(0.05)  # a long test: small ones started beside it would overlap
        out = real(s, cache)
        spans.setdefault(s.nnz, (t0, _time.perf_counter()))
        return out

    monkeypatch.setattr(sched, "_krylov_method", spy)
    big, bigger = poisson2d(20), convection(22)
    smalls = [poisson2d(m) for m in (4, 5, 6)] + [convection(7)]
    mats = smalls + [big, bigger]
    systems = [LinearSystem(A, np.ones(A.shape[0]), rtol=1e-8) for A in mats for _ in range(2)]
    results = solve_many(systems, manager=DeviceManager(simulate="1x1GiB"))
    assert len(spans) == len(mats)
    large_end = max(spans[A.nnz][1] for A in (big, bigger))
    assert all(spans[A.nnz][0] >= large_end for A in smalls)
    assert [results[2 * k].method for k in range(len(mats))] == \
        ["cg", "cg", "cg", "bicgstab", "cg", "bicgstab"]
    assert_converged(systems, results)


def test_a_failed_method_test_reaches_the_system_it_was_for(monkeypatch):
    """A small matrix's test raising on a helper thread: that system is invalid, the rest solve."""
    monkeypatch.setattr(sched, "PREFETCH_ALL_CORES", 1)
    monkeypatch.setattr(sched, "PREFETCH_SMALL_NNZ", 1)
    monkeypatch.setattr(sched, "PREFETCH_MIN_NNZ", 1000)
    bad = poisson2d(5)
    real = sched._krylov_method

    def spy(s, cache):
        if s.A is bad:
            raise ValueError("this matrix cannot be tested")
        return real(s, cache)

    monkeypatch.setattr(sched, "_krylov_method", spy)
    mats = [poisson2d(20), bad, poisson2d(4)]
    systems = [LinearSystem(A, np.ones(A.shape[0]), rtol=1e-8) for A in mats]
    results = solve_many(systems, manager=DeviceManager(simulate="1x1GiB"))
    assert results[1].status is Status.INVALID_INPUT and "cannot be tested" in results[1].message
    assert results[0].converged and results[2].converged


def spy_on_start(monkeypatch, probe) -> tuple[list, object, object]:
    """Record ``probe()`` each time a solve_many call starts its workers.

    Returns the records, the real ``_Runner.start`` and the spy (to set again).
    """
    seen: list = []
    run = sched._Runner.start

    def spying(self):
        seen.append(probe())
        return run(self)

    monkeypatch.setattr(sched._Runner, "start", spying)
    return seen, run, spying


def test_garbage_collection_is_paused_during_the_call_and_restored_after(sims, monkeypatch):
    import gc

    seen, run, spying = spy_on_start(monkeypatch, gc.isenabled)
    systems = mixed_systems(4, seed=12)
    assert gc.isenabled()
    assert_solves(systems, solve_many(systems, manager=sims))
    assert seen == [False] and gc.isenabled()

    # A caller that disabled collection keeps it disabled.
    gc.disable()
    try:
        solve_many(systems, manager=sims)
        assert not gc.isenabled()
    finally:
        gc.enable()

    # Concurrent calls: collection resumes only when the last one returns.
    inside, release = threading.Event(), threading.Event()

    def slow(self):
        inside.set()
        release.wait(30)
        return run(self)

    monkeypatch.setattr(sched._Runner, "start", slow)
    t = threading.Thread(target=solve_many, args=(systems,), kwargs={"manager": sims})
    t.start()
    assert inside.wait(30)
    monkeypatch.setattr(sched._Runner, "start", run)
    solve_many(systems, manager=sims)
    assert not gc.isenabled()  # the other call is still running
    release.set()
    t.join(30)
    assert gc.isenabled()

    # An error inside restores it too; PAUSE_GC=False leaves it alone.
    def broken(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(sched._Runner, "start", broken)
    with pytest.raises(RuntimeError, match="boom"):
        solve_many(systems, manager=sims)
    assert gc.isenabled()
    monkeypatch.setattr(sched._Runner, "start", spying)
    monkeypatch.setattr(sched, "PAUSE_GC", False)
    seen.clear()
    solve_many(systems, manager=sims)
    assert seen == [True]


def test_device_time_of_a_batch_comes_from_its_own_results():
    from managed_solve.result import SolveResult

    def res(**info):
        return SolveResult(None, Status.CONVERGED, info=info)

    assert sched._device_seconds([res(), res(gpu_seconds=None)]) is None  # host batches: none
    # A restarted or polished result carries another solve's time; the batch's own counts.
    out = [res(gpu_seconds=0.001, restarted=True), res(gpu_seconds=0.5, polished=True),
           res(gpu_seconds=0.04), res(gpu_seconds=0.04)]
    assert sched._device_seconds(out) == 0.04


def test_a_device_error_while_building_results_retries_the_batch_and_loses_nothing(monkeypatch):
    """A failure while building results goes through the same split-and-retry as the solve's."""
    dm = DeviceManager(simulate="2x64MiB")
    real = sched._results
    calls = [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == 1:
            raise SimulatedOutOfMemory("injected while building results")
        return real(*a, **k)

    monkeypatch.setattr(sched, "_results", flaky)
    systems = mixed_systems(40, seed=13, lo=3, hi=12)
    finishers = []
    real_submit = sched.ThreadPoolExecutor.submit

    def submit(self, fn, *a, **k):  # the results are built on the finisher threads
        if getattr(fn, "__name__", "") == "_complete":
            finishers.append(threading.current_thread().name)
        return real_submit(self, fn, *a, **k)

    monkeypatch.setattr(sched.ThreadPoolExecutor, "submit", submit)
    results = solve_many(systems, manager=dm)
    assert finishers and all(t.startswith("solve_many-sim:") for t in finishers)
    assert calls[0] >= 2
    assert_solves(systems, results)
    assert all(dm.reserved_bytes(d) == 0 for d in ("sim:0", "sim:1"))


def test_switch_interval_is_shortened_while_two_gpus_are_fed_and_restored_after(monkeypatch):
    import sys

    seen = spy_on_start(monkeypatch, sys.getswitchinterval)[0]
    before = sys.getswitchinterval()
    systems = mixed_systems(4, seed=14)
    solve_many(systems, manager=DeviceManager(simulate="2x64MiB"))
    solve_many(systems, manager=DeviceManager(simulate="1x64MiB"))
    monkeypatch.setattr(sched, "SWITCH_INTERVAL", None)
    solve_many(systems, manager=DeviceManager(simulate="2x64MiB"))
    assert seen == [pytest.approx(5e-4), before, before]
    assert sys.getswitchinterval() == before


def test_results_cut_x_from_the_batch_when_first_read():
    """solve_many's batched results hold the batch's solution and slice x on first use."""
    import copy
    import pickle

    from managed_solve.result import SolveResult, _SlicedResult

    systems = [(poisson2d(m), np.ones(m * m)) for m in (3, 4, 5)]
    out = solve_many(systems, devices=["cpu"], method="cg")
    sliced = [r for r in out if isinstance(r, _SlicedResult)]
    assert sliced, "the batched path made no results"
    r = sliced[0]
    assert "_src" in r.__dict__ and "_x" not in r.__dict__  # nothing cut yet
    # No tuple per result: one object fewer for the collector to scan.
    assert not any(isinstance(v, tuple) for v in vars(r).values())
    for (A, b), res in zip(systems, out, strict=True):
        np.testing.assert_allclose(A @ res.x, b, rtol=1e-6, atol=1e-6)
    assert not {"_src", "_lo", "_hi"} & set(r.__dict__)
    again = pickle.loads(pickle.dumps(r))
    assert type(again) is SolveResult and np.array_equal(again.x, r.x) and again.info == r.info
    c = copy.copy(r)
    assert type(c) is SolveResult and c.x is r.x
    import dataclasses

    swapped = dataclasses.replace(r, message="replaced")
    assert swapped.message == "replaced" and np.array_equal(swapped.x, r.x) and swapped.status is r.status
    r.x = np.zeros(3)  # assignable, as on any result
    assert r.x.tolist() == [0.0, 0.0, 0.0] and repr(r).startswith("SolveResult(")


def head_start_mix(n_small=300, seed=21, big=160):
    """Two large grids (each runs alone, the longest batches) and many small ones.

    ``big`` (the grid side): 160 runs alone on simulated GPUs; on a real GPU a
    system runs alone from 262,144 rows (a quarter of a GPU batch): 540 there.
    """
    rng = np.random.default_rng(seed)
    systems = [LinearSystem(poisson2d(big), np.ones(big * big), rtol=1e-8, name=f"big{k}")
               for k in range(2)]
    for k, m in enumerate(rng.integers(6, 17, size=n_small)):
        systems.append(LinearSystem(poisson2d(int(m)), rng.standard_normal(int(m) ** 2),
                                    rtol=1e-8, name=f"s{k}"))
    return systems


def batch_started(monkeypatch, of=None) -> threading.Event:
    """An event set when a worker starts computing a batch (one holding a system of ``of``)."""
    started = threading.Event()
    real_finish = sched._Runner._finish

    def finish(self, st, dev):
        if of is None or set(st.batch.indices) & set(of):
            started.set()
        return real_finish(self, st, dev)

    monkeypatch.setattr(sched._Runner, "_finish", finish)
    return started


def runners_started(monkeypatch) -> list:
    """The runners solve_many starts, recorded (``_Runner.start`` spied on)."""
    runners = []
    real_start = sched._Runner.start
    monkeypatch.setattr(sched._Runner, "start", lambda self: (runners.append(self), real_start(self))[1])
    return runners


def test_large_systems_start_while_the_others_are_still_estimated(monkeypatch):
    """Head start: the large systems compute before the last small system is even estimated."""
    dm = DeviceManager(simulate="2x1GiB")
    systems = head_start_mix()
    started = batch_started(monkeypatch, of=(0, 1))
    seen_running = []
    real_estimate = sched.estimate

    def estimate(s, i, **kw):
        if i == len(systems) - 1:  # the last system: a large one must be running by now
            seen_running.append(started.wait(10))
        return real_estimate(s, i, **kw)

    monkeypatch.setattr(sched, "estimate", estimate)
    runners = runners_started(monkeypatch)
    with ms_config.override(work_stealing=False):  # both devices run their planned share
        results = solve_many(systems, manager=dm)
    assert seen_running == [True]
    assert_solves(systems, results)
    (runner,) = runners  # one runner, extended with the rest of the plan
    batches = [b for q in runner.plan.queues.values() for b in q]
    assert sorted(i for b in batches for i in b.indices) == list(range(len(systems)))
    assert len({b.id for b in batches}) == len(batches)
    assert sorted(b.indices for b in batches if b.nsys == 1 and b.indices[0] < 2) == [[0], [1]]
    assert {str(d) for d, *_ in runner.batches_run} == {"sim:0", "sim:1"}
    assert sorted(bid for _d, bid, _n in runner.batches_run) == sorted(b.id for b in batches)


def test_head_start_plans_what_one_plan_would(monkeypatch):
    """When the large batches are the longest, planning them first changes no placement."""
    def placement(head_start):
        monkeypatch.setattr(sched, "HEAD_START_SYSTEMS", 256 if head_start else 10**9)
        with monkeypatch.context() as m:
            runners = runners_started(m)
            systems = head_start_mix(seed=5)
            assert_solves(systems, solve_many(systems, manager=DeviceManager(simulate="2x1GiB")))
        (runner,) = runners
        return {name: sorted(tuple(b.indices) for b in q) for name, q in runner.plan.queues.items() if q}

    assert placement(True) == placement(False)


def test_an_error_while_the_rest_is_estimated_stops_the_started_workers(monkeypatch):
    """A failure after the large systems started: raised, and no worker is left waiting."""
    dm = DeviceManager(simulate="2x1GiB")
    systems = head_start_mix()
    started = batch_started(monkeypatch)
    real_estimate = sched.estimate

    def estimate(s, i, **kw):
        if i == len(systems) - 1:
            assert started.wait(10), "no batch started before the last estimate"
            raise RuntimeError("estimator broke")
        return real_estimate(s, i, **kw)

    monkeypatch.setattr(sched, "estimate", estimate)
    before = set(threading.enumerate())
    raised = []

    def call():
        try:
            solve_many(systems, manager=dm)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            raised.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "solve_many hung after the error"
    assert len(raised) == 1 and "estimator broke" in str(raised[0])
    left = [x for x in set(threading.enumerate()) - before if x.name.startswith("solve_many-")]
    assert not [x for x in left if x.is_alive()]
    # The manager holds no reservation of the abandoned call.
    assert all(dm.reserved_bytes(d) == 0 for d in dm.accelerators)


def test_head_start_shortens_the_switch_interval_beside_the_started_workers(monkeypatch):
    """On one GPU too, while the rest is estimated beside the started workers (then restored)."""
    import sys

    # Only 1M-entry matrices' methods beside the loop (on any host): the large
    # ones here then go through estimate() (not a deferred method).
    monkeypatch.setattr(sched, "PREFETCH_ALL_CORES", 1 << 30)
    systems = head_start_mix(n_small=260)
    seen = {}
    real_estimate = sched.estimate

    def estimate(s, i, **kw):
        seen[i] = sys.getswitchinterval()
        return real_estimate(s, i, **kw)

    monkeypatch.setattr(sched, "estimate", estimate)
    before = sys.getswitchinterval()
    assert_solves(systems, solve_many(systems, manager=DeviceManager(simulate="1x1GiB")))
    assert seen[0] == before  # a large system, estimated before any worker ran
    assert seen[len(systems) - 1] == pytest.approx(sched.HEAD_SWITCH_INTERVAL)
    assert sys.getswitchinterval() == before
    seen.clear()  # two GPUs: 0.5 ms for the call, shorter still beside the started workers
    assert_solves(systems, solve_many(systems, manager=DeviceManager(simulate="2x1GiB")))
    assert seen[0] == pytest.approx(sched.SWITCH_INTERVAL)
    assert seen[len(systems) - 1] == pytest.approx(sched.HEAD_SWITCH_INTERVAL)
    assert sys.getswitchinterval() == before


def test_a_process_setting_holds_the_smallest_value_asked_and_restores_the_callers():
    values = [7.0]
    setting = sched._ProcessSetting(lambda: values[-1], values.append)
    outer = setting.held(5.0)
    outer.__enter__()
    inner = setting.held(1.0)
    inner.__enter__()
    larger = setting.held(3.0)
    larger.__enter__()
    assert values[-1] == 1.0
    inner.__exit__(None, None, None)  # out of order: the smallest left is 3
    assert values[-1] == 3.0
    outer.__exit__(None, None, None)
    assert values[-1] == 3.0
    larger.__exit__(None, None, None)
    assert values[-1] == 7.0
    with setting.held(2.0, active=False):
        assert values[-1] == 7.0


def test_a_batch_computes_while_the_results_of_the_one_before_are_built(monkeypatch):
    """On an accelerator the worker does not wait for a batch's results to start the next one."""
    dm = DeviceManager(simulate="1x1GiB")
    monkeypatch.setattr(sched, "target_rows", lambda *a, **k: 200)  # several batches
    release = threading.Event()
    ran_while_blocked = []
    real_results, real_run = sched._results, sched._run_packed
    blocked = threading.Event()

    def results(*a, **k):
        if not blocked.is_set():  # the first batch's results wait for the second batch
            blocked.set()
            ran_while_blocked.append(release.wait(10))
        return real_results(*a, **k)

    def run(*a, **k):
        if blocked.is_set():
            release.set()
        return real_run(*a, **k)

    monkeypatch.setattr(sched, "_results", results)
    monkeypatch.setattr(sched, "_run_packed", run)
    systems = mixed_systems(30, seed=17, lo=6, hi=10)
    out = solve_many(systems, manager=dm)
    assert ran_while_blocked == [True]
    assert_solves(systems, out)
    assert len({r.info["batch"] for r in out}) >= 3


@pytest.mark.parametrize("where", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_large_systems_method_is_found_while_its_batch_is_copied(monkeypatch, where):
    """Head start: the large batch is staged before its matrix's method is known, then resolved.

    On a GPU the stager resolves the method between the copy and the
    workspace/graph set-up (``solvers.batched.prepare``); on simulated GPUs the
    worker does.
    """
    import time as _time

    monkeypatch.setattr(sched, "PREFETCH_ALL_CORES", 1)
    monkeypatch.setattr(sched, "PREFETCH_MIN_NNZ", 10_000)
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
    real_method, real_pack = sched._krylov_method, sched._pack

    copy_started = threading.Event()

    def method(s, cache):
        if id(s.A) in big and id(s.A) not in method_done:
            # A slow test: it ends only once a large system's copy has started
            # (or after 60 s, and then the ordering assertion below fails).
            copy_started.wait(60)
            out = real_method(s, cache)
            method_done[id(s.A)] = _time.perf_counter()
            return out
        return real_method(s, cache)

    def pack(batch_systems, *a, **k):
        if any(id(s.A) in big for s in batch_systems):
            packed_at.append(_time.perf_counter())
            copy_started.set()
        return real_pack(batch_systems, *a, **k)

    monkeypatch.setattr(sched, "_krylov_method", method)
    monkeypatch.setattr(sched, "_pack", pack)
    recorded = []
    real_record = dm.record
    monkeypatch.setattr(dm, "record", lambda sig, *a, **k: (recorded.append(sig), real_record(sig, *a, **k))[1])
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert len(packed_at) == 2 and len(method_done) == 2
    assert min(packed_at) < min(method_done.values())  # the copy started before the method was known
    assert results[0].method == "cg" and results[1].method == "bicgstab"
    assert all(sched.DEFERRED not in sig[2] for sig in recorded if sig[0] == "solve_many")
    if where == "cuda":
        cp = _cupy()
        assert {r.device for r in results} == {"cuda:0"}
        assert all(isinstance(r.x, cp.ndarray) for r in results)


def test_a_large_system_whose_deferred_method_test_fails_is_invalid_input(monkeypatch):
    """As in the estimate loop: a method test raising ValueError makes that system INVALID_INPUT."""
    import time as _time

    monkeypatch.setattr(sched, "PREFETCH_ALL_CORES", 1)
    monkeypatch.setattr(sched, "PREFETCH_MIN_NNZ", 10_000)
    systems = head_start_mix()
    bad = systems[1].A
    real_method = sched._krylov_method

    def method(s, cache):
        if s.A is bad:
            _time.sleep(0.2)  # still running when the batch is planned: deferred
            raise ValueError("systems[1]: this matrix's symmetry cannot be tested")
        return real_method(s, cache)

    monkeypatch.setattr(sched, "_krylov_method", method)
    dm = DeviceManager(simulate="2x1GiB")
    results = solve_many(systems, manager=dm)
    assert results[1].status is Status.INVALID_INPUT
    assert "cannot be tested" in results[1].message
    assert_solves(systems[:1] + systems[2:], results[:1] + results[2:])
    assert all(dm.reserved_bytes(d) == 0 for d in dm.accelerators)
