"""Systems, checks and spies shared by the ``solve_many`` tests (tests/scheduling/)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.sparse.linalg as spla

from managed_solve import LinearSystem, Status
from managed_solve.devices import SimulatedOutOfMemory
from managed_solve.manager import DeviceManager
from managed_solve.scheduling import routes
from managed_solve.scheduling.runner import Runner
from tests._problems import poisson2d
from tests._problems import poisson2d_skew as convection


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


class HoldingWatch(LedgerWatch):
    """A LedgerWatch that also keeps every reservation made, with the thread that made it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.made: list = []  # (thread ident, Reservation), released ones too

    def reserve(self, nbytes, device=None, **kw):
        r = super().reserve(nbytes, device, **kw)
        self.made.append((threading.get_ident(), r))
        return r

    def held_by_this_thread(self, device) -> int:
        """The largest reservation the calling thread holds on ``device`` now (0: none)."""
        me = threading.get_ident()
        return max((r.nbytes for t, r in list(self.made)
                    if t == me and not r.released and r.device == device), default=0)


def watch_solves_alone(dm: HoldingWatch, dev, needs: dict) -> list:
    """Records each solve alone on ``dev`` of a system in ``needs`` (its bytes -> (name, need)).

    ``solve()`` asks the device's fault hook with its system's bytes before it
    computes there. Each record: the name, ``need`` (the bytes its solver
    reserves), the largest reservation the solving thread holds on ``dev``, and
    the ledger there, at that moment.
    """
    seen: list = []

    def hook(d, nbytes):
        if nbytes in needs:
            name, need = needs[nbytes]
            seen.append((name, need, dm.held_by_this_thread(d), dm.reserved_bytes(d)))

    dev.fault = hook
    return seen


def fail_every_second(counter):
    def fault(dev, nbytes):
        counter[0] += 1
        if counter[0] % 2 == 0:
            raise SimulatedOutOfMemory(f"{dev}: simulated out of memory for {nbytes} bytes")

    return fault


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
    real_finish = Runner.finish

    def finish(self, st, dev):
        if of is None or set(st.batch.indices) & set(of):
            started.set()
        return real_finish(self, st, dev)

    monkeypatch.setattr(Runner, "finish", finish)
    return started


def runners_started(monkeypatch) -> list:
    """The runners solve_many starts, recorded (``Runner.start`` spied on)."""
    runners = []
    real_start = Runner.start
    monkeypatch.setattr(Runner, "start", lambda self: (runners.append(self), real_start(self))[1])
    return runners


def spy_on_start(monkeypatch, probe) -> tuple[list, object, object]:
    """Record ``probe()`` each time a solve_many call starts its workers.

    Returns the records, the real ``Runner.start`` and the spy (to set again).
    """
    seen: list = []
    run = Runner.start

    def spying(self):
        seen.append(probe())
        return run(self)

    monkeypatch.setattr(Runner, "start", spying)
    return seen, run, spying


def hold_first_compute(monkeypatch, timeout: float, seen=None) -> list:
    """Hold the first batch's compute until a second batch's compute has started.

    Returns a list that receives, once, whether the second started within
    ``timeout`` seconds (it cannot with one worker per device). ``seen()``,
    when given, is called at each compute's start (on its worker thread).
    """
    second_started = threading.Event()
    waited: list = []
    real = routes.compute_batch
    calls = [0]
    lock = threading.Lock()

    def compute(prepared, method, dev):
        if seen is not None:
            seen()
        with lock:
            calls[0] += 1
            first = calls[0] == 1
        if first:
            waited.append(second_started.wait(timeout))
        else:
            second_started.set()
        return real(prepared, method, dev)

    monkeypatch.setattr(routes, "compute_batch", compute)
    return waited
