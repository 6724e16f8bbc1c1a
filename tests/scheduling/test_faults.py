"""The fault campaign: out-of-memory and runtime failures inside every route lose no system.

2,000 mixed systems (batched CG/BiCGStab, MINRES and GMRES alone, direct,
dense, operators) on simulated GPUs whose fault hooks fail every Nth piece
of work, whether the piece is a batch or a single solve() inside a route,
with out-of-memory errors or plain RuntimeErrors. Every good system must come
back solved, exactly once, in input order.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve import DeviceManager, LinearSystem, Status, solve, solve_many
from managed_solve.devices import SimulatedOutOfMemory
from tests._problems import convection_diffusion, laplacian1d, poisson2d


def campaign_systems(count: int, seed: int = 0) -> list[LinearSystem]:
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        kind = k % 7
        m = int(rng.integers(3, 9))
        if kind in (0, 1, 2):  # batched CG
            A, method = poisson2d(m), "auto"
        elif kind == 3:  # batched BiCGStab
            A, method = convection_diffusion(m), "auto"
        elif kind == 4:  # MINRES alone (symmetric indefinite)
            A, method = (laplacian1d(m * m) - 0.5 * sp.identity(m * m)).tocsr(), "auto"
        elif kind == 5:  # GMRES
            A, method = convection_diffusion(m), "gmres"
        else:  # dense, LU alone
            A, method = poisson2d(m).toarray(), "direct"
        out.append(LinearSystem(A, rng.standard_normal(m * m), rtol=1e-8, method=method,
                                name=f"s{k}"))
    return out


def every_nth(n: int, error: type[Exception]):
    """A fault hook failing every n-th piece of work (thread-safe counter), with ``error``."""
    lock = threading.Lock()
    count = [0]

    def fault(dev, nbytes):
        with lock:
            count[0] += 1
            fire = count[0] % n == 0
        if fire:
            raise error(f"injected failure on {dev} ({nbytes} bytes)")

    fault.count = count
    return fault


@pytest.mark.parametrize("error, n", [(SimulatedOutOfMemory, 3), (SimulatedOutOfMemory, 7),
                                      (RuntimeError, 5)], ids=["oom-3", "oom-7", "runtime-5"])
def test_a_fault_campaign_loses_and_duplicates_nothing(error, n):
    systems = campaign_systems(2000)
    dm = DeviceManager(simulate="2x256MiB")
    hooks = [every_nth(n, error) for _ in dm.accelerators]
    for dev, hook in zip(dm.accelerators, hooks, strict=True):
        dev.fault = hook
    delivered = []
    results = solve_many(systems, manager=dm)
    assert len(results) == len(systems)
    assert [r.name for r in results] == [s.name for s in systems]  # in order, none missing
    bad = [(r.name, r.status, r.message) for r in results if r.status is not Status.CONVERGED]
    assert not bad, bad[:5]
    assert sum(h.count[0] for h in hooks) >= n  # the faults fired
    for s, r in zip(systems, results, strict=True):
        A = s.A
        x = r.to_numpy()
        assert np.linalg.norm(s.b - A @ x) <= 1e-8 * np.linalg.norm(s.b) * (1 + 1e-6), r.name
        delivered.append(r.name)
    assert len(set(delivered)) == len(systems)  # each exactly once
    assert all(dm.reserved_bytes(d) == 0 for d in dm.accelerators)


def test_memory_shrinking_during_the_call_moves_work_to_the_cpu():
    """A device whose memory fills up mid-call (another process): its work goes elsewhere."""
    systems = campaign_systems(300, seed=1)
    dm = DeviceManager(simulate="2x64MiB")
    full = dm.accelerators[1]
    calls = [0]

    def fills_up(dev, nbytes):
        calls[0] += 1
        if calls[0] > 3:
            dev.sim_used_bytes = dev.total_bytes  # nothing left
            raise SimulatedOutOfMemory(f"{dev} is full")

    full.fault = fills_up
    results = solve_many(systems, manager=dm)
    assert all(r.converged for r in results), [r.message for r in results if not r.converged][:3]
    assert [r.name for r in results] == [s.name for s in systems]


def test_a_sharded_system_whose_shards_fit_nowhere_runs_on_the_cpu():
    """Four 64 KiB devices cannot hold a 44^2 Poisson even in shards: the CPU solves it."""
    A = poisson2d(44)
    b = np.ones(A.shape[0])
    res = solve_many([(A, b)], manager=DeviceManager(simulate="4x64KiB"))[0]
    assert res.converged and res.device == "cpu", res.message
    np.testing.assert_allclose(res.to_numpy(), sla.spsolve(A.tocsc(), b), rtol=1e-6)


def _zero_on_diagonal(n: int, row: int):
    """A nonsingular tridiagonal matrix with one zero diagonal entry (Jacobi divides by it)."""
    A = laplacian1d(n).tolil()
    A[row, row] = 0.0
    return A.tocsr()


def _manager(device: str) -> DeviceManager:
    """A manager solving on ``device`` alone: the CPU, or one simulated GPU."""
    if device in ("cpu", "cuda:0"):
        return DeviceManager([device])
    return DeviceManager([device], simulate="1x1GiB")


@pytest.mark.parametrize("device", ["cpu", "sim:0", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_an_input_error_found_inside_a_batch_sinks_only_its_system(device):
    """A zero diagonal under M="jacobi" is found when the batch is packed: that system alone is refused."""
    rng = np.random.default_rng(5)
    bad = {2, 9, 10}
    pairs = [(_zero_on_diagonal(40, 7), rng.standard_normal(40)) if k in bad
             else (laplacian1d(40 + k), rng.standard_normal(40 + k)) for k in range(16)]
    res = solve_many(pairs, manager=_manager(device), M="jacobi", method="cg")
    assert len(res) == len(pairs)
    for k, (r, (A, b)) in enumerate(zip(res, pairs, strict=True)):
        if k in bad:
            assert r.status is Status.INVALID_INPUT and r.x is None
            assert "non-zero diagonal" in r.message and r.name == f"systems[{k}]"
        else:
            assert r.status is Status.CONVERGED
            x = sla.spsolve(A.tocsc(), b)
            assert np.linalg.norm(r.to_numpy() - x) <= 1e-6 * np.linalg.norm(x)


@pytest.mark.parametrize("device", ["cpu", "sim:0", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_what_solve_raises_for_one_system_is_that_systems_invalid_input(device):
    """solve() raises for M="amg" on a dense A: solve_many gives that system INVALID_INPUT with
    the same message, not DEVICE_ERROR. An indefinite preconditioner under MINRES breaks
    it down in both, and both go on to GMRES, which takes any preconditioner; the other
    systems are solved."""
    n = 30
    negative = sp.diags(-np.linspace(1.0, 10.0, n)).tocsr()  # symmetric negative definite: MINRES
    dense = laplacian1d(n).toarray()
    b = np.ones(n)
    systems = [LinearSystem(dense, b, M="amg"), LinearSystem(negative, b, M="jacobi"),
               LinearSystem(negative, b)]
    dm = _manager(device)
    res = solve_many(systems, manager=dm)
    with pytest.raises(TypeError) as raised:
        solve(systems[0], device=device, manager=dm)
    assert res[0].status is Status.INVALID_INPUT
    assert res[0].message == f"TypeError: {raised.value}"
    alone = solve(systems[1], device=device, manager=dm)
    assert alone.status is res[1].status is Status.CONVERGED
    assert alone.method == res[1].method == "gmres"
    assert alone.info["fallback_from"] == res[1].info["fallback_from"] == "minres"
    for r in (alone, res[1]):
        assert np.allclose(r.to_numpy(), b / negative.diagonal())
    assert res[2].status is Status.CONVERGED
    assert np.allclose(res[2].to_numpy(), b / negative.diagonal())
