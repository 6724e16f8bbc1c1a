"""solve_many end to end: results against SciPy, order, invalid inputs, routes, fallbacks, head start.

Simulated GPUs (``DeviceManager(simulate=...)``) run the batched core on the
host with a memory budget; the ``gpu`` / ``multi_gpu`` cases run the same on
real GPUs.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

import managed_solve as ms
from managed_solve import LinearSystem, Status
from managed_solve import config as ms_config
from managed_solve.devices import DeviceWarning, forget_warnings
from managed_solve.manager import DeviceManager
from managed_solve.scheduling import SolveManyError, many, solve_many
from managed_solve.scheduling import estimate as estimation
from tests._problems import poisson2d, poisson2d_plus_diagonal, symmetrically_scaled, tridiagonal
from tests._problems import poisson2d_skew as convection
from tests.scheduling._helpers import (
    assert_solves,
    batch_started,
    fail_every_second,
    head_start_mix,
    mixed_systems,
    runners_started,
)


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


def test_cpu_only_uses_the_host_lu_where_cg_is_not_predicted_sooner_and_matches_scipy():
    """On the CPU "auto" factorises the non-symmetric systems; the 2D Poisson ones go to CG."""
    systems = mixed_systems(30, seed=2)
    results = solve_many(systems, manager=DeviceManager(["cpu"]))
    assert_solves(systems, results)
    expected = ["direct" if k % 5 == 4 else "cg" for k in range(len(systems))]  # convection: k % 5 == 4
    assert [r.method for r in results] == expected
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
        A = symmetrically_scaled(poisson2d(m), rng.uniform(1, 100, m * m))  # badly scaled: Jacobi helps
        systems.append(LinearSystem(A, rng.standard_normal(m * m), name=f"j{k}"))
    results = solve_many(systems, M="jacobi", manager=DeviceManager(simulate="1x64MiB"))
    assert_solves(systems, results)


def test_systems_the_batched_core_cannot_take_go_through_solve(sims):
    A = tridiagonal(50, -1.0, 2.5, -1.0)
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
        A = convection(m) if k % 2 else poisson2d_plus_diagonal(m, 0.9)
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

    solver_mod = importlib.import_module("managed_solve.solver")
    alone = []
    real_prepare = solver_mod.prepare
    monkeypatch.setattr(solver_mod, "prepare",
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


def test_pinned_systems_are_solved_on_their_devices_beside_unpinned_ones():
    """A pinned system, a system whose A is pinned, a pair whose A is: each on its pinned device."""
    dm = DeviceManager(simulate="2x64MiB")
    systems = mixed_systems(24, seed=11)
    coo = poisson2d(9).tocoo()  # validation converts it to CSR: the pin is read off the input
    b = np.arange(81.0)
    dm.pin(coo, "sim:1")
    for k in (3, 7, 8):
        dm.pin(systems[k], "sim:1")
    dm.pin(systems[10].A, "sim:1")
    dm.pin(systems[12], "cpu")
    dm.pin(systems[13].b, "sim:0")
    results = solve_many([*systems, (coo, b)], manager=dm)
    assert_solves(systems, results[:24])
    assert results[24].converged
    np.testing.assert_allclose(results[24].to_numpy(), spla.spsolve(coo.tocsc(), b), rtol=1e-6)
    pinned = {3: "sim:1", 7: "sim:1", 8: "sim:1", 10: "sim:1", 12: "cpu", 13: "sim:0", 24: "sim:1"}
    assert {i: results[i].device for i in pinned} == pinned
    # Batched with the other systems pinned there, never with unpinned ones.
    assert max(results[i].info["batch_size"] for i in (3, 7, 8, 10, 24)) > 1
    assert all(results[i].device != "cpu" for i in range(24) if i not in pinned)
    assert dm.reserved_bytes("sim:0") == dm.reserved_bytes("sim:1") == dm.reserved_bytes("cpu") == 0
    # solve() places them alike (a LinearSystem pinned, or its A).
    assert ms.solve(systems[3], manager=dm).device == "sim:1"
    assert ms.solve(systems[10], manager=dm).device == "sim:1"
    assert ms.solve(systems[12], manager=dm).device == "cpu"


def test_pinned_systems_keep_their_device_without_dispersal_and_devices_named_win_with_a_warning():
    dm = DeviceManager(simulate="3x64MiB")
    systems = mixed_systems(12, seed=12)
    dm.pin(systems[0], "sim:2")
    dm.pin(systems[5].A, "sim:2")
    results = solve_many(systems, disperse=False, manager=dm)
    assert_solves(systems, results)
    assert results[0].device == results[5].device == "sim:2"
    assert len({r.device for k, r in enumerate(results) if k not in (0, 5)}) == 1  # the one device
    # devices= naming other devices wins, as solve(device=) does over a pin: said, not silent.
    with pytest.warns(UserWarning, match=r"systems\[0\] \(pinned to sim:2\), systems\[5\].*"
                                         r"Name the pinned device in devices="):
        results = solve_many(systems, devices=["sim:0", "sim:1"], manager=dm)
    assert_solves(systems, results)
    assert {r.device for r in results} <= {"sim:0", "sim:1"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named there: no warning
        results = solve_many(systems, devices=["sim:2", "sim:0"], manager=dm)
    assert results[0].device == results[5].device == "sim:2"


def test_a_pinned_system_its_device_cannot_hold_comes_back_device_error_naming_it():
    """solve() raises MemoryError there; solve_many returns that system DEVICE_ERROR, the rest solved."""
    dm = DeviceManager(simulate="2x64MiB", reserved=0.0)
    systems = mixed_systems(8, seed=13)
    dm.pin(systems[2], "sim:1")
    dm.pin(systems[4], "sim:1")
    held = dm.reserve(dm.available_bytes(dm.accelerators[1]) - 100, "sim:1")
    try:
        with pytest.raises(MemoryError, match="pinned to sim:1"):
            ms.solve(systems[2], manager=dm)
        results = solve_many(systems, manager=dm)
    finally:
        held.release()
    for k in (2, 4):
        assert results[k].status is Status.DEVICE_ERROR and results[k].device == "sim:1"
        assert "pinned (DeviceManager.pin)" in results[k].message
        assert "unpin it (manager.unpin)" in results[k].message
    rest = [k for k in range(8) if k not in (2, 4)]
    assert_solves([systems[k] for k in rest], [results[k] for k in rest])
    assert all(results[k].device == "sim:0" for k in rest)
    assert dm.reserved_bytes("sim:0") == dm.reserved_bytes("sim:1") == 0


def test_systems_that_fit_on_no_gpu_spill_with_one_device_warning_a_process():
    """Every system spills (simulated GPUs of 1 KiB): the manager's once-per-process DeviceWarning."""
    dm = DeviceManager(simulate="2x1KiB")
    systems = mixed_systems(4, seed=14)
    forget_warnings()
    try:
        with pytest.warns(DeviceWarning, match=r"fit on no GPU \(sim:0: .* free, sim:1: .*\)") as said:
            results = solve_many(systems, manager=dm)
        advice = str(said[0].message)
        assert said[0].filename == __file__  # the caller's line, not the planner's
        assert "manager.pin" in advice and "spill=False" not in advice  # solve_many has no spill=
        assert_solves(systems, results)
        assert {r.device for r in results} == {"cpu"}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process, whichever call spills
            solve_many(systems, manager=dm)
            dm.reserve(1 << 20).release()
    finally:
        forget_warnings()


def test_on_error_raise_lists_the_failures_after_solving_the_rest(sims):
    systems = mixed_systems(6, seed=11)
    stubborn = LinearSystem(poisson2d(12), np.ones(144), maxiter=2, name="stubborn")
    items = [systems[0], stubborn, (np.ones((3, 2)), np.ones(3)), *systems[1:]]
    with pytest.raises(SolveManyError) as info:
        solve_many(items, on_error="raise", manager=sims)
    err = info.value
    assert err.failed == [1, 2]
    assert "systems[1] (stubborn): MAXITER" in str(err)
    assert "systems[2]: INVALID_INPUT" in str(err)  # its name is its position: said once
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


def test_package_exports_solve_many_with_its_backends():
    """``ms.solve_many`` is this machine's solve_many plus the ``backend=`` choice (Ray)."""
    import inspect

    local = inspect.signature(solve_many).parameters
    public = inspect.signature(ms.solve_many).parameters
    assert list(public)[:len(local)] == list(local)
    assert set(public) - set(local) == {"backend", "cluster_options"}
    pairs = [(poisson2d(3), np.ones(9))]
    dm = DeviceManager(["cpu"])
    assert ms.solve_many(pairs, manager=dm)[0].x.tolist() == solve_many(pairs, manager=dm)[0].x.tolist()


def test_backend_argument_is_checked(sims):
    pairs = [(poisson2d(3), np.ones(9))]
    with pytest.raises(ValueError, match="backend='mpi'"):
        ms.solve_many(pairs, backend="mpi", manager=sims)
    with pytest.raises(TypeError, match="address"):
        ms.solve_many(pairs, address="auto", manager=sims)
    with pytest.raises(TypeError, match="manager"):
        ms.solve_many(pairs, backend="ray", manager=sims)


def test_results_cut_x_from_the_batch_when_first_read():
    """solve_many's batched results hold the batch's solution and slice x on first use."""
    import copy
    import pickle

    from managed_solve.result import SlicedResult, SolveResult

    systems = [(poisson2d(m), np.ones(m * m)) for m in (3, 4, 5)]
    out = solve_many(systems, devices=["cpu"], method="cg")
    sliced = [r for r in out if isinstance(r, SlicedResult)]
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
    with ms_config.override(work_stealing=False):  # the plan's share, not the threads' timing
        results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert {r.device for r in results} == {"cuda:0", "cuda:1"}
    for r in results:
        assert r.x.device.id == int(r.device.split(":")[1])
    one = solve_many(systems, disperse=False, manager=dm)
    assert len({r.device for r in one}) == 1
    del cp


# ----------------------------------------------------------------------------- head start


def test_large_systems_start_while_the_others_are_still_estimated(monkeypatch):
    """Head start: the large systems compute before the last small system is even estimated."""
    dm = DeviceManager(simulate="2x1GiB")
    systems = head_start_mix()
    started = batch_started(monkeypatch, of=(0, 1))
    seen_running = []
    real_estimate, real_deferred = estimation.estimate_system, estimation.deferred_estimate

    def estimate(s, i, **kw):
        if i == len(systems) - 1:  # the last system: a large one must be running by now
            seen_running.append(started.wait(10))
        return real_estimate(s, i, **kw)

    def deferred(s, i):  # a small system whose method the host pass finds beside the plan
        if i == len(systems) - 1:
            seen_running.append(started.wait(10))
        return real_deferred(s, i)

    monkeypatch.setattr(estimation, "estimate_system", estimate)
    monkeypatch.setattr(estimation, "deferred_estimate", deferred)
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
        with monkeypatch.context() as m, ms_config.override(head_start_systems=256 if head_start else 10**9):
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
    real_estimate, real_deferred = estimation.estimate_system, estimation.deferred_estimate

    def estimate(s, i, **kw):
        if i == len(systems) - 1:
            assert started.wait(10), "no batch started before the last estimate"
            raise RuntimeError("estimator broke")
        return real_estimate(s, i, **kw)

    def deferred(s, i):
        if i == len(systems) - 1:
            assert started.wait(10), "no batch started before the last estimate"
            raise RuntimeError("estimator broke")
        return real_deferred(s, i)

    monkeypatch.setattr(estimation, "estimate_system", estimate)
    monkeypatch.setattr(estimation, "deferred_estimate", deferred)
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


def test_a_gpu_call_opens_its_gpus_and_starts_their_modules_before_validation(monkeypatch):
    """start_cuda: the contexts of the GPUs the call will use and the modules of the inputs'
    dtypes (read off the raw inputs), nothing where the GPU is chosen later or none is used."""
    import managed_solve.solvers.batched as batched
    from managed_solve import _backend
    from managed_solve.devices import Device

    opened, calls = [], []
    monkeypatch.setattr(_backend, "open_cuda_context", opened.append)
    monkeypatch.setattr(batched, "prefetch_kernels",
                        lambda ids, dt, it, fams: calls.append((list(ids), np.dtype(dt).name, fams)))
    mgr = DeviceManager([Device("cuda", 0, "gpu0", 1 << 30), Device("cuda", 1, "gpu1", 1 << 30)])
    A32 = poisson2d(4).astype(np.float32)
    items = [(poisson2d(5), np.ones(25)), (A32, np.ones(16, np.float32)),
             (A32, np.ones(16)), ("not", "a system")]
    started = many.start_cuda(items, mgr, None, True, "auto")
    assert opened == [0, 1]
    assert calls == [([0, 1], "float32", ("cg",)), ([0, 1], "float64", ("cg",))]
    assert started == {np.dtype(np.float32), np.dtype(np.float64)}  # estimate skips these
    opened.clear(), calls.clear()
    many.start_cuda(items[:1], mgr, "cuda:1", False, "bicgstab")  # one GPU named
    assert opened == [1] and calls == [([1], "float64", ("bicgstab",))]
    opened.clear(), calls.clear()
    assert not many.start_cuda(items, mgr, None, False, "auto")  # disperse=False: chosen later
    assert not many.start_cuda(items, mgr, "cpu", True, "auto")
    assert not many.start_cuda(items, mgr, "cuda:7", True, "auto")  # the selection reports it
    assert opened == [] and calls == []
    many.start_cuda(items, mgr, "cuda:0", True, "minres")  # no batched module, still a GPU run
    assert opened == [0] and calls == []
    sim = DeviceManager(simulate="2x1GiB")
    many.start_cuda(items, sim, None, True, "auto")
    assert opened == [0] and calls == []


def test_input_dtypes_follow_validation():
    A = poisson2d(4)
    items = [(A.astype(np.float32), np.ones(16, np.float32)), (A.astype(np.float32), np.ones(16)),
             (A, np.ones(16, np.int64)), LinearSystem(A, np.ones(16))]
    validated = {np.dtype((s if isinstance(s, LinearSystem) else LinearSystem(*s)).dtype)
                 for s in items}
    assert many.input_dtypes(items) == validated == {np.dtype(np.float32), np.dtype(np.float64)}
    assert many.input_dtypes(items[1:]) == {np.dtype(np.float64)}
    assert many.input_dtypes([(A, np.ones(16, np.complex128)), (A,), 3]) == set()
