"""Placement of one system: which pin places it (``pinned_input``), and ``solve`` obeying it."""

from __future__ import annotations

import linecache
import re
import warnings

import numpy as np
import pytest

import managed_solve as ms
from managed_solve import Solver
from managed_solve.manager import DeviceManager
from managed_solve.placement import named_device, pinned_input
from tests._problems import array_modules, host, on, poisson2d


def test_a_system_is_placed_by_its_own_pin_else_its_matrix_else_its_right_hand_side():
    dm = DeviceManager(simulate="2x64MiB")
    A, b = poisson2d(6), np.ones(36)
    s = ms.LinearSystem(A, b)
    assert pinned_input(dm, s, s.A, s.b) is None
    dm.pin(b, "sim:0")
    assert pinned_input(dm, s, s.A, s.b) is b
    dm.pin(A, "sim:1")
    assert pinned_input(dm, s, s.A, s.b) is A
    dm.pin(s, "cpu")
    assert pinned_input(dm, s, s.A, s.b) is s
    assert pinned_input(dm, None, s) is s


def test_solve_of_a_pinned_matrix_runs_on_its_device_and_names_it_when_full():
    dm = DeviceManager(simulate="2x64MiB", reserved=0.0)
    A, b = poisson2d(8), np.arange(64.0)
    assert ms.solve(A, b, manager=dm).device == "sim:0"  # the manager's choice
    dm.pin(A, "sim:1")
    r = ms.solve(A, b, manager=dm)
    assert r.device == "sim:1" and r.converged
    np.testing.assert_allclose(r.to_numpy(), np.linalg.solve(A.toarray(), b), rtol=1e-6)
    with pytest.warns(UserWarning, match="pinned to sim:1"):  # an explicit device wins, said
        assert ms.solve(A, b, device="sim:0", manager=dm).device == "sim:0"
    held = dm.reserve(dm.available_bytes(dm.accelerators[1]) - 100, "sim:1")
    try:
        with pytest.raises(MemoryError, match="pinned to sim:1.*unpin the object"):
            ms.solve(A, b, manager=dm)
    finally:
        held.release()


# Where the inputs lie and the device they are pinned to: host inputs and a
# simulated GPU; CuPy inputs on cuda:0 pinned to the CPU or to another GPU.
PIN_PLACES = [pytest.param(("sim", "sim:1"), id="host-to-sim:1"),
              pytest.param(("cuda", "cpu"), marks=pytest.mark.gpu, id="cuda:0-to-cpu"),
              pytest.param(("cuda", "cuda:1"), marks=pytest.mark.multi_gpu, id="cuda:0-to-cuda:1")]


def _pinned_inputs(mode, form):
    """(A, b, the object pinned) as the caller gives them: ``form`` names what is pinned.

    Validation converts all but the float64 CSR matrix and the LinearSystem
    (which ``solve(system, rtol=...)`` replaces by a new one).
    """
    xp, sparse = array_modules("cpu" if mode == "sim" else "cuda")
    A0, b0 = poisson2d(6), np.arange(36.0) - 10.0
    A, b = sparse.csr_matrix(A0), xp.asarray(b0)
    if form in ("coo", "csc"):
        A = getattr(sparse, f"{form}_matrix")(A0)
    elif form == "int dense":
        A = xp.asarray(A0.toarray().astype(np.int64))
    elif form == "int b":
        b = xp.asarray(b0.astype(np.int64))
        return A, b, b
    elif form == "system":
        s = ms.LinearSystem(A, b)
        return s, None, s
    elif form == "block b":
        b = xp.stack([b, 2 * b], axis=1)
        return A, b, b
    return A, b, A


def _solver_solve(A, b, **kw):
    with Solver(A, **kw) as solver:
        return solver.solve(b)


@pytest.mark.parametrize("form", ["csr", "coo", "csc", "int dense", "int b", "system", "block b"])
@pytest.mark.parametrize("where", PIN_PLACES)
def test_a_pin_on_an_input_as_given_places_solve_solver_and_solve_many_alike(where, form):
    """Whatever validation made of the pinned input, and wherever its arrays lie (CuPy ones on
    another GPU are moved), solve, Solver, solve(A, B) and solve_many all run on its device."""
    mode, target = where
    A, b, pinned = _pinned_inputs(mode, form)
    A0, b0 = poisson2d(6).toarray(), np.arange(36.0) - 10.0
    B0 = np.stack([b0, 2 * b0], axis=1)

    def manager(pin=True):  # a fresh one each call: unpinned, its first solve goes to sim:0
        dm = DeviceManager(simulate="2x64MiB") if mode == "sim" else DeviceManager()
        if pin:
            dm.pin(pinned, target)
        return dm

    kw = {"rtol": 1e-10}
    if form == "system":
        calls = {"solve": lambda dm: ms.solve(A, manager=dm, **kw),
                 "solve_many": lambda dm: ms.solve_many([A], manager=dm, **kw)[0]}
    elif form == "block b":
        calls = {"solve(A, B)": lambda dm: ms.solve(A, b, manager=dm, **kw)}
    else:
        calls = {"solve": lambda dm: ms.solve(A, b, manager=dm, **kw),
                 "solve_many": lambda dm: ms.solve_many([(A, b)], manager=dm, **kw)[0]}
    if form not in ("int b", "system", "block b"):  # A itself is pinned
        B = on("cpu" if mode == "sim" else "cuda", B0)
        calls["Solver"] = lambda dm: _solver_solve(A, b, manager=dm, **kw)
        calls["solve(A, B)"] = lambda dm: ms.solve(A, B, manager=dm, **kw)
    unpinned = "sim:0" if mode == "sim" else "cuda:0"
    for name, call in calls.items():
        assert call(manager(pin=False)).device == unpinned, name  # the pin is what moves it
        r = call(manager())
        assert r.device == target, name
        want = np.linalg.solve(A0, B0 if name == "solve(A, B)" else b0)
        np.testing.assert_allclose(host(r.x), want, rtol=1e-6, atol=1e-6 * abs(want).max(),
                                   err_msg=name)


@pytest.mark.parametrize("pinned_to, other", [("sim:1", "cpu"), ("cpu", "sim:0")],
                         ids=["pinned-to-sim", "pinned-to-cpu"])
@pytest.mark.parametrize("what", ["A", "b"])
def test_an_explicit_device_wins_over_a_pin_with_a_warning_naming_the_call_and_the_fix(
        pinned_to, other, what):
    """device= naming the pinned device is silent; another device is used, with a warning (as
    solve_many(devices=) does); device=None follows the pin. solve, Solver and solve(A, B)."""
    A, b = poisson2d(6), np.arange(36.0) - 10.0
    B = np.stack([b, 2 * b], axis=1)
    calls = {"solve": (lambda dm, **kw: ms.solve(A, b, manager=dm, **kw), b),
             "solve(A, B)": (lambda dm, **kw: ms.solve(A, B, manager=dm, **kw), B)}
    if what == "A":  # Solver(A) sees b only when it solves
        calls["Solver"] = (lambda dm, **kw: _solver_solve(A, b, manager=dm, **kw), b)
    for name, (call, rhs) in calls.items():
        dm = DeviceManager(simulate="2x64MiB")
        dm.pin(A if what == "A" else (B if rhs is B else b), pinned_to)
        want = np.linalg.solve(A.toarray(), rhs)
        label = name.split("(", 1)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the pinned device named, or none: no warning
            assert call(dm, device=pinned_to).device == pinned_to, name
            assert call(dm).device == pinned_to, name
        with pytest.warns(UserWarning) as record:
            r = call(dm, device=other)
        assert r.device == other and r.converged, name
        np.testing.assert_allclose(host(r.x), want, rtol=1e-6, atol=1e-8, err_msg=name)
        [w] = [w for w in record if "pinned to" in str(w.message)]
        assert re.match(rf"{re.escape(label)}\(device='{other}'\): an input \(pinned to "
                        rf"{pinned_to}\) left out by device=, so solved on {other} instead\. "
                        rf"Name the pinned device in device= \(or pass device=None\) to solve "
                        rf"there, or unpin the object \(manager\.unpin\)\.$", str(w.message)), \
            (name, str(w.message))
        # The line that called the library, not the library's own.
        assert w.filename == __file__, name
        assert re.search(r"\bsolve\(|Solver\(", linecache.getline(w.filename, w.lineno)), name


def test_named_device_errors_name_the_call_the_user_made():
    dm = DeviceManager(simulate="2x64MiB")
    assert str(named_device("sim:1", dm, call="Solver")) == "sim:1"
    with pytest.raises(ValueError, match=r"^Solver\(device=\.\.\.\): 'tpu:0' is not a device name"):
        named_device("tpu:0", dm, call="Solver")
    with pytest.raises(RuntimeError, match=r"^solve\(device='sim:7'\): sim:7 is not managed here.*"
                                           r"or device=None to let the manager choose"):
        named_device("sim:7", dm, call="solve")


def test_a_device_named_but_full_is_used_and_the_warning_names_the_call(caplog):
    dm = DeviceManager(simulate="2x64MiB", reserved=0.0)
    A, b = poisson2d(8), np.arange(64.0)
    held = dm.reserve(dm.available_bytes(dm.accelerators[1]) - 100, "sim:1")
    try:
        with caplog.at_level("WARNING", logger="managed_solve"):
            with Solver(A, device="sim:1", manager=dm) as solver:
                r = solver.solve(b)
            r2 = ms.solve(A, b, device="sim:1", manager=dm)
    finally:
        held.release()
    assert r.device == r2.device == "sim:1" and r.converged and r2.converged
    np.testing.assert_allclose(r.to_numpy(), np.linalg.solve(A.toarray(), b), rtol=1e-6)
    assert "Solver(device=sim:1) runs beyond the ledger" in caplog.text
    assert "solve(device=sim:1) runs beyond the ledger" in caplog.text
