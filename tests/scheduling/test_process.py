"""Interpreter settings solve_many holds while it runs: only when the caller opts in, always restored."""

from __future__ import annotations

import threading

import pytest

from managed_solve import config as ms_config
from managed_solve._backend import ProcessSetting
from managed_solve.manager import DeviceManager
from managed_solve.scheduling import estimate as estimation
from managed_solve.scheduling import solve_many
from managed_solve.scheduling.runner import Runner
from tests.scheduling._helpers import assert_solves, head_start_mix, mixed_systems, spy_on_start


@pytest.fixture
def sims():
    return DeviceManager(simulate="2x64MiB")


def test_garbage_collection_is_paused_during_the_call_and_restored_after(sims, monkeypatch, settings):
    import gc

    settings(pause_gc=True)  # the caller opts in (process-wide)
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

    monkeypatch.setattr(Runner, "start", slow)
    t = threading.Thread(target=solve_many, args=(systems,), kwargs={"manager": sims})
    t.start()
    assert inside.wait(30)
    monkeypatch.setattr(Runner, "start", run)
    solve_many(systems, manager=sims)
    assert not gc.isenabled()  # the other call is still running
    release.set()
    t.join(30)
    assert gc.isenabled()

    # An error inside restores it too; without the setting, collection is left alone.
    def broken(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(Runner, "start", broken)
    with pytest.raises(RuntimeError, match="boom"):
        solve_many(systems, manager=sims)
    assert gc.isenabled()
    monkeypatch.setattr(Runner, "start", spying)
    seen.clear()
    with ms_config.override(pause_gc=False):
        solve_many(systems, manager=sims)
    assert seen == [True]


def test_switch_interval_is_shortened_while_two_gpus_are_fed_and_restored_after(monkeypatch):
    import sys

    seen = spy_on_start(monkeypatch, sys.getswitchinterval)[0]
    before = sys.getswitchinterval()
    systems = mixed_systems(4, seed=14)
    with ms_config.override(switch_interval=5e-4):  # the caller opts in
        solve_many(systems, manager=DeviceManager(simulate="2x64MiB"))
        solve_many(systems, manager=DeviceManager(simulate="1x64MiB"))
    solve_many(systems, manager=DeviceManager(simulate="2x64MiB"))  # the default: unchanged
    assert seen == [pytest.approx(5e-4), before, before]
    assert sys.getswitchinterval() == before


def test_head_start_shortens_the_switch_interval_beside_the_started_workers(monkeypatch, settings):
    """On one GPU too, while the rest is estimated beside the started workers (then restored)."""
    import sys

    # Only 1M-entry matrices' methods beside the loop (on any host): the large
    # ones here then go through estimate_system() (not a deferred method).
    # The caller opts in to both switch intervals.
    settings(prefetch_all_cores=1 << 30, switch_interval=5e-4, head_switch_interval=1e-4)
    systems = head_start_mix(n_small=260)
    seen = {}
    real_estimate = estimation.estimate_system

    real_deferred = estimation.deferred_estimate

    def estimate(s, i, **kw):
        seen[i] = sys.getswitchinterval()
        return real_estimate(s, i, **kw)

    def deferred(s, i):  # small systems: their methods found by the host pass beside the plan
        seen[i] = sys.getswitchinterval()
        return real_deferred(s, i)

    monkeypatch.setattr(estimation, "estimate_system", estimate)
    monkeypatch.setattr(estimation, "deferred_estimate", deferred)
    before = sys.getswitchinterval()
    assert_solves(systems, solve_many(systems, manager=DeviceManager(simulate="1x1GiB")))
    assert seen[0] == before  # a large system, estimated before any worker ran
    assert seen[len(systems) - 1] == pytest.approx(1e-4)
    assert sys.getswitchinterval() == before
    seen.clear()  # two GPUs: 0.5 ms for the call, shorter still beside the started workers
    assert_solves(systems, solve_many(systems, manager=DeviceManager(simulate="2x1GiB")))
    assert seen[0] == pytest.approx(5e-4)
    assert seen[len(systems) - 1] == pytest.approx(1e-4)
    assert sys.getswitchinterval() == before


def test_head_start_leaves_the_switch_interval_alone_by_default(monkeypatch):
    import sys

    systems = head_start_mix(n_small=260)
    seen = set()
    real_estimate = estimation.estimate_system

    real_deferred = estimation.deferred_estimate

    def estimate(s, i, **kw):
        seen.add(sys.getswitchinterval())
        return real_estimate(s, i, **kw)

    def deferred(s, i):
        seen.add(sys.getswitchinterval())
        return real_deferred(s, i)

    monkeypatch.setattr(estimation, "estimate_system", estimate)
    monkeypatch.setattr(estimation, "deferred_estimate", deferred)
    before = sys.getswitchinterval()
    assert_solves(systems, solve_many(systems, manager=DeviceManager(simulate="2x1GiB")))
    assert seen == {before}


def test_scipy_s_blas_threads_are_held_during_the_call_only_when_asked_and_restored_after(monkeypatch):
    """SciPy's OpenBLAS on one thread while the host LU workers run, when the caller opts in."""
    from managed_solve import _backend

    found = _backend.scipy_blas_threads()
    if found is None:
        pytest.skip("SciPy's BLAS is not an OpenBLAS this package finds")
    get, put = found
    before = get()
    put(2)  # a threaded BLAS, whatever this process started with
    try:
        seen = spy_on_start(monkeypatch, get)[0]
        systems = mixed_systems(10, seed=2)  # every fifth one non-symmetric: the host LU's
        cpu = DeviceManager(["cpu"])
        with ms_config.override(host_blas_threads=1):  # the caller opts in
            results = solve_many(systems, manager=cpu)
        assert_solves(systems, results)
        assert "direct" in {r.method for r in results}
        assert get() == 2
        solve_many(systems, manager=cpu)  # the default: unchanged
        assert seen == [1, 2] and get() == 2
    finally:
        put(before)


def test_a_process_setting_holds_the_smallest_value_asked_and_restores_the_callers():
    values = [7.0]
    setting = ProcessSetting(lambda: values[-1], values.append)
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
