"""Lanes: several batches of one call computing at once on an accelerator (scheduling/lanes.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from managed_solve import LinearSystem, Status, config
from managed_solve.manager import DeviceManager
from managed_solve.scheduling import routes, solve_many
from managed_solve.scheduling.lanes import Held, ShareClock
from tests._problems import poisson2d
from tests.scheduling._helpers import LedgerWatch, assert_solves, mixed_systems, runners_started


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


def test_a_held_reservation_counts_until_released_once():
    released = []

    class Res:
        def release(self):
            released.append(1)

    cond = threading.Condition()
    counts, releases = {}, {}
    a = Held(Res(), "sim:0", counts, releases, cond)
    with Held(Res(), "sim:0", counts, releases, cond):
        assert counts == {"sim:0": 2}
    assert counts == {"sim:0": 1} and releases == {"sim:0": 1}
    a.release()
    a.release()  # idempotent, like the reservation itself
    assert counts == {"sim:0": 0} and releases == {"sim:0": 2} and len(released) == 3


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
    second_started = threading.Event()
    waited = []
    real = routes.compute_batch
    calls = [0]
    lock = threading.Lock()

    def compute(prepared, method, dev):
        with lock:
            calls[0] += 1
            first = calls[0] == 1
        if first:
            waited.append(second_started.wait(10))
        else:
            second_started.set()
        return real(prepared, method, dev)

    monkeypatch.setattr(routes, "compute_batch", compute)
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


def test_lanes_on_a_device_with_room_for_two_batches_wait_for_room(settings):
    """Two lanes and a staged batch would need three batches' bytes; the third waits, none is split."""
    settings(batch_rows=1000, lanes_per_device=2, work_stealing=False)
    systems = [LinearSystem(poisson2d(10), np.ones(100), rtol=1e-8, name=f"s{k}") for k in range(48)]
    dm = RefusingWatch(simulate="1x330KiB")  # batches of 119-131 kB: two fit, three do not
    out = solve_many(systems, manager=dm)
    assert dm.refused >= 1  # a third batch found no room at least once
    assert all(r.status is Status.CONVERGED and r.device == "sim:0" for r in out)
    assert len({r.info["batch"] for r in out}) == 5  # as planned: nothing split
    assert dm.high["sim:0"] <= dm.capacity(dm.accelerators[0])
    assert dm.reserved_bytes("sim:0") == 0
    assert_solves(systems, out)


@pytest.mark.gpu
def test_two_lanes_compute_on_one_gpu_at_once_and_meet_rtol(settings, monkeypatch):
    """The first batch's compute is held until the second's has started, so both run on the GPU together."""
    settings(batch_rows=20_000, lanes_per_device=2)
    second_started = threading.Event()
    waited, streams = [], []
    real = routes.compute_batch
    calls = [0]
    lock = threading.Lock()

    def compute(prepared, method, dev):
        from managed_solve import _backend

        streams.append(_backend.cupy().cuda.get_current_stream().ptr)
        with lock:
            calls[0] += 1
            first = calls[0] == 1
        if first:
            waited.append(second_started.wait(30))
        else:
            second_started.set()
        return real(prepared, method, dev)

    monkeypatch.setattr(routes, "compute_batch", compute)
    systems = mixed_systems(120, seed=33, lo=20, hi=48)
    out = solve_many(systems, manager=DeviceManager(["cuda:0"]))
    assert waited == [True]
    assert len(set(streams[:2])) == 2 and 0 not in streams  # each lane its own stream, not the null one
    assert_solves(systems, out)
    assert {r.device for r in out} == {"cuda:0"} and len({r.info["batch"] for r in out}) >= 3
