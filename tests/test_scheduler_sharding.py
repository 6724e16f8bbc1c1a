"""solve_many sends a system that fits no single accelerator to the sharded solver."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import DeviceManager, LinearSystem, solve_many


def _poisson(n):
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    return (sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr()


@pytest.fixture
def mix():
    big = _poisson(100)  # 10,000 unknowns: about 1.3 MB with its CG workspace
    small = [_poisson(n) for n in (8, 12, 16)]
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
