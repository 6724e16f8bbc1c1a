"""The runner: admission by the ledger, split-and-retry recovery, work stealing, results beside compute, lanes."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import numpy as np
import pytest
import scipy.sparse.linalg as sla

from managed_solve import LinearSystem, Status, config
from managed_solve.devices import SimulatedOutOfMemory
from managed_solve.manager import DeviceManager
from managed_solve.scheduling import routes, solve_many
from managed_solve.scheduling.runner import Runner, ShareClock
from tests._problems import helmholtz2d, poisson2d
from tests.scheduling._helpers import (
    HoldingWatch,
    LedgerWatch,
    assert_solves,
    fail_every_second,
    hold_first_compute,
    mixed_systems,
    runners_started,
    watch_solves_alone,
)


def test_admission_never_over_budget_and_oversized_systems_spill_to_the_cpu(settings):
    # The plan alone places the batches: with stealing, a host thread that runs
    # ahead on a loaded machine can take a simulated device's share, and the
    # assertion that every device held work would then depend on timing.
    settings(work_stealing=False)
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


@pytest.mark.parametrize("spec", ["2x64MiB", "1x64MiB"])
def test_out_of_memory_every_second_batch_loses_and_duplicates_nothing(spec, monkeypatch):
    dm = DeviceManager(simulate=spec)
    counter = [0]
    dm.accelerators[0].fault = fail_every_second(counter)
    delivered: list[int] = []
    real, real_many = Runner.deliver, Runner.deliver_many

    def spy(self, i, res):
        delivered.append(i)
        return real(self, i, res)

    def spy_many(self, indices, out):
        delivered.extend(indices)
        return real_many(self, indices, out)

    monkeypatch.setattr(Runner, "deliver", spy)
    monkeypatch.setattr(Runner, "deliver_many", spy_many)
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


def test_an_unnamed_system_of_a_split_batch_is_named_by_its_input_position(monkeypatch):
    """Messages name an unnamed system ``systems[i]`` by the caller's list, not by its batch."""
    dm = DeviceManager(simulate="1x64MiB")
    fired = [0]

    def first_fails(dev, nbytes):  # the first batch fails: split, the halves go elsewhere
        fired[0] += 1
        if fired[0] == 1:
            raise SimulatedOutOfMemory(f"{dev}: simulated out of memory for {nbytes} bytes")

    dm.accelerators[0].fault = first_fails
    rng = np.random.default_rng(41)
    A = poisson2d(6)
    systems = [LinearSystem(A, rng.standard_normal(36), rtol=1e-10, M="jacobi") for _ in range(8)]
    tiny = A.tolil()
    tiny[3, 3] = 1e-320  # non-zero, but 1 / d overflows: Jacobi refuses it when packing
    systems[5] = LinearSystem(tiny.tocsr(), rng.standard_normal(36), rtol=1e-10, M="jacobi")
    systems[2] = LinearSystem(A, rng.standard_normal(36), rtol=1e-10, M="jacobi", maxiter=2)
    runners = runners_started(monkeypatch)
    results = solve_many(systems, manager=dm)
    assert fired[0] >= 1
    (runner,) = runners
    assert max(n for _dev, _b, n in runner.batches_run) < len(systems)  # no batch held them all
    bad = results[5]
    assert bad.status is Status.INVALID_INPUT
    assert "systems[5] (M='jacobi')" in bad.message, bad.message
    assert bad.message.count("systems[") == 1, bad.message
    assert results[2].status is Status.MAXITER and "systems[" not in results[2].message
    good = [k for k in range(len(systems)) if k not in (2, 5)]
    for k in good:
        assert results[k].status is Status.CONVERGED, (k, results[k].message)
        ref = sla.spsolve(systems[k].A.tocsc(), systems[k].b)
        assert np.allclose(results[k].to_numpy(), ref, rtol=1e-7, atol=1e-9), k


def test_a_pinned_batch_that_hits_a_device_error_is_split_on_its_device_never_moved(monkeypatch):
    """Recovery of pinned systems: halves on the same device (smaller ones may fit), not elsewhere."""
    dm = DeviceManager(simulate="2x64MiB")
    sim1 = dm.accelerators[1]
    systems = [LinearSystem(poisson2d(8), np.arange(64.0) + k, rtol=1e-8, name=f"s{k}")
               for k in range(6)]
    for s in systems:
        dm.pin(s, "sim:1")
    calls = [0]

    def first_fails(dev, nbytes):
        calls[0] += 1
        if calls[0] == 1:
            raise SimulatedOutOfMemory(f"{dev}: simulated out of memory for {nbytes} bytes")

    sim1.fault = first_fails
    runners = runners_started(monkeypatch)
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert {r.device for r in results} == {"sim:1"}
    (runner,) = runners
    assert sorted(n for dev, _b, n in runner.batches_run) == [3, 3]  # one batch of 6, split there
    assert {dev for dev, _b, _n in runner.batches_run} == {"sim:1"}


def test_pinned_systems_on_a_device_that_always_fails_come_back_device_error_the_rest_solved():
    dm = DeviceManager(simulate="2x64MiB")

    def fault(dev, nbytes):
        raise SimulatedOutOfMemory(f"{dev}: simulated out of memory for {nbytes} bytes")

    dm.accelerators[1].fault = fault
    systems = mixed_systems(10, seed=15)
    pinned = (1, 4, 6)
    for k in pinned:
        dm.pin(systems[k], "sim:1")
    results = solve_many(systems, manager=dm)
    for k in pinned:
        r = results[k]
        assert r.status is Status.DEVICE_ERROR and r.device == "sim:1", (k, r.status, r.device)
        assert "simulated out of memory" in r.message and "not moved elsewhere" in r.message
    rest = [k for k in range(10) if k not in pinned]
    assert_solves([systems[k] for k in rest], [results[k] for k in rest])
    assert all(results[k].device != "sim:1" for k in rest)  # moved off the failing device


def test_work_stealing_leaves_pinned_batches_where_they_are_pinned(settings, monkeypatch):
    """An idle device takes queued batches from a busy one, never a pinned one.

    sim:0 holds its first batch until sim:1, with nothing of its own, has
    looked for work while sim:0 still had batches queued: the test does not
    depend on how the threads interleave. Pinned batches are never taken.
    """
    settings(batch_rows=600)  # a batch a system: twelve queued on sim:0
    dm = DeviceManager(simulate="2x64MiB")
    sim0 = dm.accelerators[0]
    systems = [LinearSystem(poisson2d(24), np.ones(576), method="cg", name=f"s{k}")
               for k in range(12)]
    for s in systems:
        dm.pin(s, "sim:0")
    looked = threading.Event()  # sim:1 tried to steal from a non-empty sim:0 queue
    real_steal = Runner.steal

    def steal(self, name):
        if name == "sim:1" and self.queues.get("sim:0"):
            looked.set()
        return real_steal(self, name)

    monkeypatch.setattr(Runner, "steal", steal)
    first = [True]

    def hold_the_first(dev, nbytes):
        if first[0]:
            first[0] = False
            assert looked.wait(60), "sim:1 never looked for work to steal"

    sim0.fault = hold_the_first
    runners = runners_started(monkeypatch)
    results = solve_many(systems, manager=dm)
    assert_solves(systems, results)
    assert {r.device for r in results} == {"sim:0"}
    (runner,) = runners
    assert len(runner.plan.queues["sim:0"]) == 12 and not runner.plan.queues.get("sim:1")
    assert runner.stolen == [] and looked.is_set()


# The device part of a batch (the core, true residuals) and its results: on an
# accelerator the results are built on the finisher thread; on the CPU in one piece.
@pytest.mark.parametrize("where, beside", [("run_packed", True), ("packed_results", True),
                                           ("run_packed", False), ("packed_results", False),
                                           ("solve_packed", False)])
def test_a_non_device_error_is_a_device_error_result_not_a_crash(where, beside, monkeypatch):
    # On the CPU (method given: "auto" would take the host LU) batches finish on their worker.
    dm = DeviceManager(simulate="1x64MiB") if beside else DeviceManager(["cpu"])
    method = "auto" if beside else "cg"

    def broken(*a, **k):
        raise ZeroDivisionError("bug in a solver")

    monkeypatch.setattr(routes, where, broken)
    systems = mixed_systems(5, seed=10)
    results = solve_many(systems, manager=dm, method=method)
    assert all(r.status is Status.DEVICE_ERROR for r in results)
    assert all("ZeroDivisionError" in r.message for r in results)


def test_a_device_error_while_building_results_retries_the_batch_and_loses_nothing(monkeypatch):
    """A failure while building results goes through the same split-and-retry as the solve's."""
    dm = DeviceManager(simulate="2x64MiB")
    real = routes.packed_results
    calls = [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == 1:
            raise SimulatedOutOfMemory("injected while building results")
        return real(*a, **k)

    monkeypatch.setattr(routes, "packed_results", flaky)
    systems = mixed_systems(40, seed=13, lo=3, hi=12)
    finishers = []
    real_submit = concurrent.futures.ThreadPoolExecutor.submit

    def submit(self, fn, *a, **k):  # the results are built on the finisher threads
        if getattr(fn, "__name__", "") == "complete":
            finishers.append(threading.current_thread().name)
        return real_submit(self, fn, *a, **k)

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", submit)
    results = solve_many(systems, manager=dm)
    assert finishers and all(t.startswith("solve_many-sim:") for t in finishers)
    assert calls[0] >= 2
    assert_solves(systems, results)
    assert all(dm.reserved_bytes(d) == 0 for d in ("sim:0", "sim:1"))


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


def test_a_batch_computes_while_the_results_of_the_one_before_are_built(monkeypatch, settings):
    """On an accelerator the worker does not wait for a batch's results to start the next one."""
    dm = DeviceManager(simulate="1x1GiB")
    settings(batch_rows=200)  # several batches
    release = threading.Event()
    ran_while_blocked = []
    real_results, real_run = routes.packed_results, routes.run_packed
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

    monkeypatch.setattr(routes, "packed_results", results)
    monkeypatch.setattr(routes, "run_packed", run)
    systems = mixed_systems(30, seed=17, lo=6, hi=10)
    out = solve_many(systems, manager=dm)
    assert ran_while_blocked == [True]
    assert_solves(systems, out)
    assert len({r.info["batch"] for r in out}) >= 3


def test_a_real_call_records_measured_speed():
    dm = DeviceManager(simulate="1x64MiB")
    before = dm.speed(dm.accelerators[0])
    solve_many(mixed_systems(10, seed=14), manager=dm)
    # NumPy on this host streams far less than the 2 TB/s a simulated GPU assumes.
    assert dm.speed(dm.accelerators[0]) < before
    assert any(k.startswith("('solve_many'") for k in dm.hints())


@pytest.mark.parametrize("host_threads", [1, 2])
def test_host_lu_workers_keep_to_the_host_thread_setting(host_threads, settings, monkeypatch):
    """A caller who holds the host to one thread gets one LU worker, not one per core."""
    settings(host_threads=host_threads)
    runners = runners_started(monkeypatch)
    systems = mixed_systems(10, seed=2)  # every fifth one non-symmetric: the host LU's
    results = solve_many(systems, manager=DeviceManager(["cpu"]))
    assert_solves(systems, results)
    assert "direct" in {r.method for r in results}
    (runner,) = runners
    assert len(runner.threads) == host_threads


# ----------------------------------------------------------------------------- lanes
def test_share_clock_counts_each_moment_of_the_device_once():
    """Three overlapping batches: their own shares add up to the time the device was busy."""
    ticks = iter([0.0, 2.0, 3.0, 5.0, 9.0, 10.0, 11.0, 14.0])
    clock = ShareClock(lambda: next(ticks))
    clock.begin("cuda:0", "a")  # 0
    clock.begin("cuda:0", "b")  # 2
    clock.begin("cuda:0", "c")  # 3
    own = {"a": clock.end("cuda:0", "a") * 5.0}  # 5: alone 2, two for 1, three for 2
    own["c"] = clock.end("cuda:0", "c") * 6.0  # 9: three for 2, two for 4
    own["b"] = clock.end("cuda:0", "b") * 8.0  # 10: two for 1, three for 2, two for 4, alone 1
    assert own == pytest.approx({"a": 2 + 1 / 2 + 2 / 3, "c": 2 / 3 + 2, "b": 1 / 2 + 2 / 3 + 2 + 1})
    assert sum(own.values()) == pytest.approx(10.0)  # busy from 0 to 10, each moment once
    clock.begin("cuda:1", "d")  # 11: another device keeps its own count
    assert clock.end("cuda:1", "d") == 1.0  # 14: alone


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_lanes_give_the_same_solutions_and_lose_nothing(lanes, settings, monkeypatch):
    settings(batch_rows=300, lanes_per_device=lanes)
    runners = runners_started(monkeypatch)
    systems = mixed_systems(40, seed=31, lo=4, hi=14)
    out = solve_many(systems, manager=DeviceManager(simulate="2x64MiB"))
    assert_solves(systems, out)
    (runner,) = runners
    assert len(runner.threads) == 2 * lanes + 1  # each accelerator's lanes, and the host's worker
    assert len({r.info["batch"] for r in out}) >= 4
    with config.override(lanes_per_device=1):
        ref = solve_many(systems, manager=DeviceManager(simulate="2x64MiB"))
    for r, q in zip(out, ref, strict=True):  # the same batches, so the same arithmetic
        np.testing.assert_array_equal(r.to_numpy(), q.to_numpy())


def test_a_second_lane_starts_a_batch_while_the_first_computes(settings, monkeypatch):
    """With two lanes the first batch's compute can wait for the second's to start; with one it could not."""
    settings(batch_rows=300, lanes_per_device=2)
    waited = hold_first_compute(monkeypatch, 10)
    systems = mixed_systems(30, seed=17, lo=6, hi=10)
    out = solve_many(systems, manager=DeviceManager(simulate="1x1GiB"))
    assert waited == [True]
    assert_solves(systems, out)


class RefusingWatch(LedgerWatch):
    """A LedgerWatch that also counts the reservations the ledger refused."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.refused = 0

    def reserve(self, nbytes, device=None, **kw):
        try:
            return super().reserve(nbytes, device, **kw)
        except MemoryError:
            self.refused += 1
            raise


def test_lanes_on_a_device_with_room_for_two_batches_wait_for_room(settings, monkeypatch):
    """Two lanes and a staged batch would need three batches' bytes; the third waits, none is split."""
    settings(batch_rows=1000, lanes_per_device=2, work_stealing=False)
    systems = [LinearSystem(poisson2d(10), np.ones(100), rtol=1e-8, name=f"s{k}") for k in range(48)]
    dm = RefusingWatch(simulate="1x330KiB")  # batches of 119-131 kB: two fit, three do not
    # The first batch's results (and so its bytes) are held until a third
    # batch was refused: whichever lane asks next, it asks beside two held.
    real, first = routes.packed_results, []

    def results(*a, **k):
        if not first:
            first.append(True)
            deadline = time.monotonic() + 10
            while dm.refused == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
        return real(*a, **k)

    monkeypatch.setattr(routes, "packed_results", results)
    out = solve_many(systems, manager=dm)
    assert dm.refused >= 1  # a third batch found no room, and waited
    assert all(r.status is Status.CONVERGED and r.device == "sim:0" for r in out)
    assert len({r.info["batch"] for r in out}) == 5  # as planned: nothing split
    assert dm.high["sim:0"] <= dm.capacity(dm.accelerators[0])
    assert dm.reserved_bytes("sim:0") == 0
    assert_solves(systems, out)


@pytest.mark.gpu
def test_two_lanes_compute_on_one_gpu_at_once_and_meet_rtol(settings, monkeypatch):
    """The first batch's compute is held until the second's has started, so both run on the GPU together."""
    settings(batch_rows=20_000, lanes_per_device=2)
    streams = []

    def seen():
        from managed_solve import _backend

        streams.append(_backend.cupy().cuda.get_current_stream().ptr)

    waited = hold_first_compute(monkeypatch, 30, seen)
    systems = mixed_systems(120, seed=33, lo=20, hi=48)
    out = solve_many(systems, manager=DeviceManager(["cuda:0"]))
    assert waited == [True]
    assert len(set(streams[:2])) == 2 and 0 not in streams  # each lane its own stream, not the null one
    assert_solves(systems, out)
    assert {r.device for r in out} == {"cuda:0"} and len({r.info["batch"] for r in out}) >= 3


@pytest.mark.parametrize("lanes", [0, -1, 1.5, True])
def test_a_lane_count_below_one_or_not_an_integer_is_refused_naming_the_setting(lanes):
    with pytest.raises(ValueError, match=r"lanes_per_device=.*expected an integer >= 1"):
        with config.override(lanes_per_device=lanes):
            pass


# ----------------------------------------------------------------------------- systems solved alone
def alone_system(how, rng):
    """A system of route SINGLE, with the method and preconditioner its solver takes."""
    if how == "minres":  # symmetric indefinite: MINRES
        A, method, M = helmholtz2d(12, shift=1.0), "minres", None
    elif how == "direct":
        A, method, M = poisson2d(12), "direct", None
    else:
        A, method, M = poisson2d(12), "cg", "amg"
    s = LinearSystem(A, rng.standard_normal(A.shape[0]), method=method, M=M, name="alone")
    return s, method, M


def assert_ledger_kept(dm, caplog):
    """(b) never over capacity, (c) every reservation released, the ledger empty everywhere."""
    for d in dm.accelerators:
        assert dm.high.get(str(d), 0) <= dm.capacity(d)
    assert all(r.released for _, r in dm.made)
    assert all(dm.reserved_bytes(d) == 0 for d in dm.inventory)
    assert "beyond the ledger" not in caplog.text


def alone_manager(where, nbytes):
    """A HoldingWatch over one simulated GPU of ``nbytes``, or over cuda:0 (whatever its size)."""
    if where == "sim":
        return HoldingWatch(simulate=f"1x{nbytes}B", reserved=0.0)
    return HoldingWatch(["cuda:0"], reserved=0.0)


@pytest.mark.parametrize("where", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("how", ["minres", "direct", "amg"])
def test_a_system_solved_alone_waits_for_its_bytes_in_the_ledger_never_runs_beyond_it(
        how, where, settings, caplog):
    """The simulated device holds the system alone or the small systems' batch alone, not both.

    The system alone comes first in the plan, the batch is staged behind it:
    its solver's bytes are held (by the thread that solves it) before it
    computes, so the batch waits for them instead of taking the room. A GPU
    has room for both: the solver's bytes are held there all the same.
    """
    settings(lanes_per_device=1, work_stealing=False)  # one worker: the plan's order
    rng = np.random.default_rng(4)
    alone, method, M = alone_system(how, rng)
    small = [LinearSystem(poisson2d(4), rng.standard_normal(16), name=f"small{k}")
             for k in range(2)]
    need = DeviceManager(["cpu"]).size_of(alone.nbytes + alone.workspace_bytes(method, M))
    dm = alone_manager(where, need + 6000)  # the batch takes more than the 6000
    dev = dm.accelerators[0]
    seen = watch_solves_alone(dm, dev, {alone.nbytes: ("alone", need)})
    systems = [*small, alone]
    try:
        with caplog.at_level(logging.WARNING, logger="managed_solve"):
            results = solve_many(systems, manager=dm)
    finally:
        dev.fault = None
    assert_solves(systems, results)
    assert results[2].device == str(dev) and results[2].method == method
    ((_, _, held, ledger),) = seen  # solved once, on the simulated device
    assert held >= need and ledger >= need
    assert_ledger_kept(dm, caplog)


@pytest.mark.parametrize("where", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_fallback_solved_alone_draws_on_the_bytes_of_its_batch(where, caplog):
    """"auto" takes CG for a symmetric matrix with a positive diagonal; an indefinite one
    breaks it and MINRES solves it alone, while its batch still holds its bytes: the simulated
    device holds the batch or the solve alone, not both, and the solve draws on the batch's."""
    rng = np.random.default_rng(5)
    s = LinearSystem(helmholtz2d(12, shift=1.0), rng.standard_normal(144), name="indefinite")
    dm = alone_manager(where, 40_000)
    dev = dm.accelerators[0]
    need = dm.size_of(s.nbytes + s.workspace_bytes("minres"))
    seen = watch_solves_alone(dm, dev, {s.nbytes: ("indefinite", need)})
    try:
        with caplog.at_level(logging.WARNING, logger="managed_solve"):
            (r,) = solve_many([s], manager=dm)
    finally:
        dev.fault = None
    assert_solves([s], [r])
    assert r.method == "minres" and r.info["fallback_from"] == "cg" and r.device == str(dev)
    ((_, _, held, ledger),) = seen
    assert held >= need and ledger >= need
    assert_ledger_kept(dm, caplog)


def test_a_fallback_too_large_for_the_room_left_is_retried_on_the_cpu(caplog):
    """MINRES alone needs more than the device holds: never solved there, retried on the CPU."""
    rng = np.random.default_rng(6)
    s = LinearSystem(helmholtz2d(30, shift=1.0), rng.standard_normal(900), name="indefinite")
    need = DeviceManager(["cpu"]).size_of(s.nbytes + s.workspace_bytes("minres"))
    dm = HoldingWatch(simulate=f"1x{need - 2000}B", reserved=0.0)  # its CG batch fits
    sim = dm.accelerators[0]
    seen = watch_solves_alone(dm, sim, {s.nbytes: ("indefinite", need)})
    with caplog.at_level(logging.WARNING, logger="managed_solve"):
        (r,) = solve_many([s], manager=dm)
    assert any(str(res.device) == "sim:0" for _, res in dm.made)  # its batch ran there first
    assert seen == []  # no solve alone on the simulated device
    assert_solves([s], [r])
    assert r.method == "minres" and r.info["fallback_from"] == "cg" and r.device == "cpu"
    assert_ledger_kept(dm, caplog)


@pytest.mark.parametrize("how", ["minres", "direct", "amg"])
@pytest.mark.parametrize("where", ["admission", "solve"])
def test_a_system_solved_alone_that_runs_out_of_memory_is_retried_on_the_cpu(how, where, caplog):
    """Out of memory as its batch is admitted, or inside its solve: every byte released,
    the system solved on the CPU, once."""
    rng = np.random.default_rng(7)
    alone, method, _M = alone_system(how, rng)
    small = LinearSystem(poisson2d(6), rng.standard_normal(36), name="small")
    dm = HoldingWatch(simulate="1x4MiB", reserved=0.0)
    failed = []

    def fault(dev, nbytes):
        if where == "admission" or nbytes == alone.nbytes:
            failed.append(nbytes)
            raise SimulatedOutOfMemory(f"{dev}: out of memory for {nbytes} bytes")

    dm.accelerators[0].fault = fault
    systems = [small, alone]
    with caplog.at_level(logging.WARNING, logger="managed_solve"):
        results = solve_many(systems, manager=dm)
    assert failed
    assert_solves(systems, results)
    assert results[1].device == "cpu" and results[1].method == method
    assert results[0].device == ("cpu" if where == "admission" else "sim:0")
    assert_ledger_kept(dm, caplog)
