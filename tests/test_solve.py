"""solve(): placement through the DeviceManager, method choice, inputs, bad input, learned hints, sharding."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

import managed_solve.solvers.batched as batched
from managed_solve import DeviceManager, LinearSystem, SolveError, Status, solve
from managed_solve.devices import SimulatedOutOfMemory
from tests._problems import (
    BACKENDS,
    helmholtz2d,
    host,
    on,
    poisson2d,
    poisson2d_plus_diagonal,
    upwind,
)

METHODS = ["cg", "bicgstab", "gmres", "minres", "direct"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-8), (np.float32, 1e-4)])
def test_every_method_known_solution(backend, method, dtype, rtol):
    A = poisson2d(12, dtype)
    x_true = np.random.default_rng(5).standard_normal(A.shape[0]).astype(dtype)
    b = (A @ x_true).astype(dtype)
    Ad, bd = on(backend, A, b)
    res = solve(Ad, bd, method=method, rtol=rtol)
    assert res.converged, res.message
    assert res.method == method
    assert res.device == ("cpu" if backend == "cpu" else "cuda:0")
    assert type(res.x).__module__.split(".")[0] == ("numpy" if backend == "cpu" else "cupy")
    x = host(res.x)
    assert x.dtype == dtype
    # the reported residual is the true one, and it meets rtol
    true = np.linalg.norm(b.astype(np.float64) - A.astype(np.float64) @ x.astype(np.float64))
    floor = float(np.linalg.norm(b)) * (1e-12 if dtype == np.float64 else 1e-5)
    assert res.residual_norm == pytest.approx(true, rel=0.05, abs=floor)
    assert res.relative_residual <= rtol
    assert res.b_norm == pytest.approx(np.linalg.norm(b), rel=1e-5)
    tol = 1e-5 if dtype == np.float64 else 2e-2
    assert np.linalg.norm(x - x_true) / np.linalg.norm(x_true) < tol
    assert res.seconds > 0


def test_auto_chooses_by_size_symmetry_and_device():
    A = poisson2d(10)
    b = np.ones(100)
    # On the CPU a small 2D-like system is factorised unless CG is predicted sooner
    # (SPD and Poisson-like: it is, here); a dense one goes to LAPACK's LU.
    assert solve(A, b).method == "cg"
    assert solve(upwind(10), b).method == "direct"  # non-symmetric
    assert solve(A.toarray(), b).method == "direct"
    assert solve(A, b, M="jacobi").method == "cg"  # a preconditioner asks for a Krylov solve
    # A simulated GPU takes the GPU's choice (iterative), as a real one would.
    dm = DeviceManager(simulate="2x1GiB")
    assert solve(A, b, manager=dm).method == "cg"
    negative = helmholtz2d(10, 5.0)  # symmetric, negative diagonal
    res = solve(negative, b, manager=dm)
    assert res.method == "minres" and res.converged
    shifted = helmholtz2d(10, 0.5)  # positive diagonal, yet indefinite
    res = solve(shifted, b, manager=dm)
    assert res.method == "minres" and res.converged
    assert res.info["fallback_from"] == "cg"
    np.testing.assert_allclose(res.to_numpy(), sla.spsolve(shifted.tocsc(), b), rtol=1e-6)
    nonsym = poisson2d_plus_diagonal(10, 0.5)
    res = solve(nonsym, b, manager=dm)
    assert res.method == "bicgstab" and res.converged
    res = solve(sla.aslinearoperator(A), b)
    assert res.method == "bicgstab" and res.converged


def test_device_none_places_through_the_manager_and_learns():
    dm = DeviceManager(simulate="2x1GiB")
    A = poisson2d(20)
    b = np.ones(400)
    system = LinearSystem(A, b, method="cg")
    held = []
    res = solve(system, manager=dm,
                callback=lambda xk: held.append(dm.reserved_bytes("sim:0")))
    assert res.converged and res.device == "sim:0"
    expected = dm.size_of(system.nbytes + system.workspace_bytes("cg"))
    assert held and all(h == expected for h in held)  # reserved during the solve
    assert dm.reserved_bytes("sim:0") == 0  # and released after
    hints = dm.hints()
    assert len(hints) == 1
    (hint,) = hints.values()
    assert hint["device"] == "sim:0" and hint["count"] == 1
    solve(system, manager=dm)
    assert next(iter(dm.hints().values()))["count"] == 2


def test_device_none_spills_to_cpu_when_nothing_fits():
    dm = DeviceManager(simulate="2x1KiB")
    res = solve(poisson2d(20), np.ones(400), method="cg", manager=dm)
    assert res.converged and res.device == "cpu"


def test_named_device_is_obeyed():
    dm = DeviceManager(simulate="2x1GiB")
    A, b = poisson2d(8), np.ones(64)
    assert solve(A, b, device="sim:1", manager=dm, method="cg").device == "sim:1"
    assert solve(A, b, device="cpu", manager=dm, method="cg").device == "cpu"
    assert dm.reserved_bytes("sim:1") == 0


def test_cuda_device_without_gpu_is_a_clear_runtime_error():
    from managed_solve import _backend

    if _backend.cuda_usable():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="no such CUDA GPU.*device='cpu'"):
        solve(poisson2d(4), np.ones(16), device="cuda:0", manager=DeviceManager(devices="cpu"))


def test_inputs_are_not_moved_when_already_in_place(backend, monkeypatch):
    def no_move(self, device):
        raise AssertionError(f"LinearSystem.to({device}) called: a round trip")

    monkeypatch.setattr(LinearSystem, "to", no_move)
    A, b = on(backend, poisson2d(10), np.ones(100))
    res = solve(A, b, method="cg", manager=DeviceManager(devices="cpu") if backend == "cpu" else None)
    assert res.converged


def test_device_fault_is_a_device_error_status():
    dm = DeviceManager(simulate="1x1GiB")

    def fail(dev, nbytes):
        raise SimulatedOutOfMemory(f"{dev}: {nbytes} bytes")

    dm.get_device("sim:0").fault = fail
    res = solve(poisson2d(6), np.ones(36), method="cg", manager=dm)
    assert res.status is Status.DEVICE_ERROR
    assert "out of memory on sim:0" in res.message
    assert dm.reserved_bytes("sim:0") == 0


def test_linear_system_argument_and_overrides():
    A = poisson2d(10)
    system = LinearSystem(A, np.ones(100), method="gmres", rtol=1e-4, name="p")
    res = solve(system)
    assert res.method == "gmres" and res.name == "p"
    assert res.relative_residual <= 1e-4
    tight = solve(system, rtol=1e-10)
    assert tight.method == "gmres" and tight.relative_residual <= 1e-10
    assert tight.iterations > res.iterations
    with pytest.raises(ValueError, match="already holds b"):
        solve(system, np.ones(100))
    with pytest.raises(TypeError, match="b is missing"):
        solve(A)


@pytest.mark.filterwarnings("ignore:Sparse:UserWarning")
def test_torch_inputs_shared_and_solution_to_torch():
    torch = pytest.importorskip("torch")
    A = poisson2d(10)
    tb = torch.ones(100, dtype=torch.float64)
    crow = torch.from_numpy(A.indptr.astype(np.int64))
    col = torch.from_numpy(A.indices.astype(np.int64))
    vals = torch.from_numpy(A.data.copy())
    for tA in (torch.sparse_csr_tensor(crow, col, vals, size=A.shape),
               torch.sparse_csr_tensor(crow, col, vals, size=A.shape).to_sparse_coo(),
               torch.tensor(A.toarray())):
        res = solve(tA, tb, method="cg", rtol=1e-10)
        assert res.converged
        np.testing.assert_allclose(res.x, sla.spsolve(A.tocsc(), np.ones(100)), rtol=1e-8)
        t = res.to_torch()
        assert t.data_ptr() == res.x.ctypes.data


def test_float32_precision_limit_is_reported_honestly():
    # float32 cannot resolve rtol=1e-5 on this system: the recurrence says
    # converged, the true residual does not; the status must say so.
    A = poisson2d(60, np.float32)
    b = np.ones(3600, dtype=np.float32)
    res = solve(A, b, method="cg", rtol=1e-6, maxiter=3000)
    assert res.relative_residual > 1e-6
    assert res.status is Status.MAXITER
    assert "float32" in res.message and "true residual" in res.message
    res64 = solve(A, b, method="cg", rtol=1e-6, dtype="float64")
    assert res64.converged and res64.relative_residual <= 1e-6 and res64.x.dtype == np.float64


@pytest.mark.parametrize(
    "args,kwargs,exc,words",
    [
        ((sp.random(4, 5, density=0.5, format="csr"), np.ones(4)), {}, ValueError, ["square"]),
        ((poisson2d(3), np.ones(8)), {}, ValueError, ["b must have shape (9,)"]),
        ((poisson2d(3), np.full(9, np.nan)), {}, ValueError, ["b has NaN or Inf"]),
        ((poisson2d(3).astype(np.complex128), np.ones(9)), {}, TypeError, ["complex"]),
        ((sp.csr_matrix((0, 0)), np.ones(0)), {}, ValueError, ["empty"]),
        ((poisson2d(3), np.ones(9)), {"x0": np.ones(4)}, ValueError, ["x0 must have shape (9,)"]),
        ((poisson2d(3), np.ones(9)), {"method": "qr"}, ValueError, ["method='qr'"]),
        ((poisson2d(3), np.ones(9)), {"device": "tpu:0"}, ValueError, ["not a device name"]),
    ],
)
def test_bad_input_raises_naming_the_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        solve(*args, **kwargs)
    assert "solve(A, b)" in str(info.value) or "device" in str(info.value)
    for w in words:
        assert w in str(info.value)


def test_bad_systems_give_statuses_not_crashes():
    indefinite = helmholtz2d(6, 2.0)
    res = solve(indefinite, np.ones(36), method="cg")
    assert res.status is Status.BREAKDOWN and "minres" in res.message
    with pytest.raises(SolveError):
        res.raise_for_status()
    singular = poisson2d(4).tolil()
    singular[2, :] = 0
    res = solve(singular.tocsr(), np.ones(16), method="direct")
    assert res.status is Status.BREAKDOWN and "singular" in res.message
    res = solve(poisson2d(12), np.ones(144), method="bicgstab", maxiter=3)
    assert res.status is Status.MAXITER and res.iterations == 3


@pytest.mark.gpu
def test_gpu_inputs_stay_and_numpy_inputs_go_where_told():
    import cupy as cp
    import cupyx.scipy.sparse as csp

    A = poisson2d(16)
    b = np.ones(256)
    res = solve(csp.csr_matrix(A), cp.asarray(b), method="auto")
    assert res.device == "cuda:0" and isinstance(res.x, cp.ndarray)
    assert res.method == "cg"  # symmetric, positive diagonal, on a GPU: not direct
    back = solve(csp.csr_matrix(A), cp.asarray(b), device="cpu", method="cg")
    assert back.device == "cpu" and isinstance(back.x, np.ndarray) and back.converged
    res = solve(A, b, device="cuda:0", method="bicgstab")
    assert res.device == "cuda:0" and isinstance(res.x, cp.ndarray)
    np.testing.assert_allclose(res.x.get(), sla.spsolve(A.tocsc(), b), rtol=1e-6)


@pytest.mark.gpu
def test_gpu_torch_tensors_zero_copy_both_ways():
    import cupy as cp
    import torch

    A = poisson2d(16)
    tA = torch.tensor(A.toarray(), device="cuda").to_sparse_csr()
    tb = torch.ones(256, dtype=torch.float64, device="cuda")
    res = solve(tA, tb, method="cg", rtol=1e-10)
    assert res.converged and res.device == "cuda:0"
    assert isinstance(res.x, cp.ndarray)
    assert res.to_torch().data_ptr() == res.x.data.ptr


def test_host_path_tests_see_a_cpu_only_default_manager():
    """The root conftest gives unmarked tests a CPU-only default manager (GPU hosts, MANAGED_SOLVE_SIMULATE)."""
    from managed_solve.manager import default_manager

    assert [str(d) for d in default_manager().devices] == ["cpu"]
    res = solve(poisson2d(5), np.ones(25))
    assert res.device == "cpu" and isinstance(res.x, np.ndarray)


def test_gmres_takes_the_batched_core_on_a_gpu_only(backend):
    """CSR GMRES: the batched core on a GPU (fused kernels), the generic one on the CPU (BLAS)."""
    A = upwind(20, 0.6)  # non-symmetric
    b = np.random.default_rng(3).standard_normal(400)
    res = solve(*on(backend, A, b), method="gmres", rtol=1e-10)
    assert res.converged and res.method == "gmres"
    x = host(res.x)
    assert np.linalg.norm(b - A @ x) <= 1e-10 * np.linalg.norm(b)
    np.testing.assert_allclose(x, sla.spsolve(A.tocsc(), b), rtol=1e-7, atol=1e-9)
    assert (res.info.get("path") == "batched") == (backend != "cpu")


# -- learned iteration counts: a repeated solve places its first convergence read there
@pytest.fixture
def first_checks(monkeypatch):
    """The first_check each fused CG solve received, in order."""
    seen = []
    real = batched.cg_batched

    def spy(batch, **kw):
        seen.append(kw.get("first_check"))
        return real(batch, **kw)

    monkeypatch.setattr(batched, "cg_batched", spy)
    return seen


def test_repeated_solve_passes_the_learned_iteration_count(first_checks):
    A = poisson2d(30)
    n = A.shape[0]
    dm = DeviceManager(simulate="1x1GiB")
    first = solve(A, np.ones(n), method="cg", device="sim:0", manager=dm)
    second = solve(A, np.arange(n, dtype=float), method="cg", device="sim:0", manager=dm)
    assert first.converged and second.converged
    assert first_checks[0] is None and first_checks[1] == first.iterations
    # another tolerance is another kind of solve: no hint
    solve(A, np.ones(n), method="cg", device="sim:0", manager=dm, rtol=1e-4)
    assert first_checks[2] is None


def test_a_solve_that_reached_maxiter_teaches_maxiter(first_checks):
    A = poisson2d(30)
    dm = DeviceManager(simulate="1x1GiB")
    for _ in range(2):
        r = solve(A, np.ones(A.shape[0]), method="cg", device="sim:0", manager=dm, maxiter=7)
        assert r.status.name == "MAXITER" and r.iterations == 7
    assert first_checks == [None, 7]  # the second solve reads the host once, at maxiter, on a GPU


# -- solve(A, b, devices=...) / device="all" shards one system (same answer as one device)
@pytest.mark.parametrize("how", ["all", "list"])
def test_sharded_route_matches_direct_solve(how):
    dm = DeviceManager(simulate="3x1GiB")
    A = poisson2d(24)
    b = np.random.default_rng(0).standard_normal(A.shape[0])
    kw = {"device": "all"} if how == "all" else {"devices": ["sim:0", "sim:2"]}
    res = solve(A, b, rtol=1e-10, manager=dm, **kw)
    assert res.converged and res.method == "cg"
    np.testing.assert_allclose(res.to_numpy(), sla.spsolve(A.tocsc(), b), rtol=1e-7, atol=1e-9)


@pytest.mark.filterwarnings("ignore:Sparse:UserWarning")
@pytest.mark.parametrize("method,where", [
    ("direct", {"device": "cpu"}), ("cg", {"device": "cpu"}), ("direct", {"device": "sim:0"}),
    ("cg", {"device": "sim:0"}), ("cg", {"devices": "all"}),  # sharded: iterative only
], ids=["cpu-direct", "cpu-cg", "sim-direct", "sim-cg", "sharded-cg"])
def test_a_one_column_b_gives_a_one_column_x(method, where):
    """b of shape (n, 1) is a block of one column: x (n, 1) and its column status, on every route."""
    torch = pytest.importorskip("torch")
    dm = DeviceManager(simulate="2x1GiB")
    A = poisson2d(9)
    B = np.linspace(-1.0, 2.0, A.shape[0])[:, None]
    want = sla.spsolve(A.tocsc(), B[:, 0])
    for b in (B, torch.from_numpy(B)):
        res = solve(A, b, method=method, rtol=1e-10, manager=dm, **where)
        assert res.x.shape == (81, 1) and res.column_status == (Status.CONVERGED,)
        assert res.converged and res.iterations.shape == (1,)
        assert res.to_torch().shape == (81, 1)
        np.testing.assert_allclose(res.to_numpy()[:, 0], want, rtol=1e-7, atol=1e-10)
    assert solve(A, B[:, 0], method=method, manager=dm, **where).x.shape == (81,)


def test_sharded_route_nonsymmetric_picks_bicgstab():
    dm = DeviceManager(simulate="2x1GiB")
    A = poisson2d_plus_diagonal(16, 0.3)
    b = np.ones(256)
    res = solve(A, b, devices="all", manager=dm, rtol=1e-10)
    assert res.converged and res.method == "bicgstab"
    assert np.linalg.norm(A @ res.to_numpy() - b) <= 1e-8 * np.linalg.norm(b)


def test_sharded_route_rejects_unshardable_method():
    dm = DeviceManager(simulate="2x1GiB")
    with pytest.raises(ValueError, match="cannot be sharded"):
        solve(poisson2d(8), np.ones(64), devices="all", method="gmres", manager=dm)


def test_a_manager_argument_that_is_not_a_manager_is_named():
    """manager="cpu" meant device="cpu": a TypeError naming the call and the fix, not an AttributeError later."""
    from managed_solve import solve_many

    A, b = poisson2d(3), np.ones(9)
    calls = {"solve": lambda: solve(A, b, manager="cpu"),
             "solve_many": lambda: solve_many([(A, b)], manager="cpu"),
             "solve ": lambda: solve(A, b, devices=["sim:0", "sim:1"], manager="cpu"),
             "solve  ": lambda: solve(A, np.ones((9, 2)), manager="cpu")}
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{name.strip()}\(manager='cpu'\): expected a "
                                            r"DeviceManager or None.*device='cpu'"):
            call()


@pytest.mark.parametrize("device", ["cpu", "sim:0", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_zero_b_gives_x_zero_whatever_x0(device):
    """b = 0: x = 0 is the exact answer and the only one a tolerance of 0 (atol=0) takes; from
    x0, GMRES and MINRES stopped short of it (MAXITER, or LEAST_SQUARES with Jacobi)."""
    from managed_solve import Solver, solve_many

    dm = DeviceManager([device], simulate="1x1GiB") if device.startswith("sim") \
        else DeviceManager([device])
    A = poisson2d(12)
    n = A.shape[0]
    x0 = np.random.default_rng(0).standard_normal(n)
    b = np.zeros(n)
    for method in ("cg", "bicgstab", "gmres", "minres", "direct"):
        for M in (None, "jacobi"):
            if method == "direct" and M is not None:
                continue
            r = solve(A, b, x0=x0, method=method, M=M, device=device, manager=dm)
            assert r.status is Status.CONVERGED, (method, M, r.message)
            assert not host(r.x).any()
    B = np.stack([b, np.ones(n)], axis=1)
    X0 = np.stack([x0, x0], axis=1)
    with Solver(A, method="gmres", device=device, manager=dm) as s:
        r = s.solve(B, X0)
    x = host(r.x)
    assert not x[:, 0].any() and np.linalg.norm(A @ x[:, 1] - 1.0) <= 1e-8 * np.sqrt(n)
    many = solve_many([LinearSystem(A, b, x0=x0, method=m) for m in ("cg", "gmres", "minres")],
                      manager=dm)
    assert all(r.status is Status.CONVERGED and not host(r.x).any() for r in many)


@pytest.mark.parametrize("k", [1, 3])
def test_a_float32_matrix_with_a_float64_block_is_solved_in_float64_as_a_vector_is(k, backend):
    """float32 only when A and b both are, whether b is (n,) or (n, k)."""
    A = poisson2d(12).astype(np.float32)
    B = np.random.default_rng(3).standard_normal((A.shape[0], k))
    A_, B_ = on(backend, A, B)
    wide = solve(A_, B_, rtol=1e-10, method="cg")
    assert wide.x.dtype == np.float64 and wide.converged
    want = sla.spsolve(A.astype(np.float64).tocsc(), B).reshape(B.shape)
    assert np.linalg.norm(host(wide.x) - want) <= 1e-8 * np.linalg.norm(want)
    narrow = solve(A_, B_.astype(np.float32), rtol=1e-5, method="cg")
    assert narrow.x.dtype == np.float32 and narrow.converged


def test_a_b_of_the_wrong_shape_names_the_block_form_solve_takes():
    A = poisson2d(4)
    with pytest.raises(ValueError, match=r"shape \(16, 2, 1\).*columns of a \(16, k\) array to "
                                         r"solve\(\) or a Solver.*solve_many"):
        solve(A, np.ones((16, 2, 1)), device="cpu")


def _nan_in(col, shape=(9, 2)):
    v = np.ones(shape)
    v[2, col] = np.nan
    return v


@pytest.mark.parametrize(
    "A,B,kwargs,exc,pattern",
    [
        (poisson2d(3), np.ones((8, 2)), {}, ValueError,
         r"b must have shape \(9,\) or \(9, k\) with k >= 1, got shape \(8, 2\); A has shape"),
        (poisson2d(3), _nan_in(1), {}, ValueError,
         r"b has NaN or Inf entries in column 1; replace them with finite values"),
        (poisson2d(3), np.ones((9, 2)), {"x0": np.ones((9, 3))}, ValueError,
         r"x0 must have shape \(9, 2\), b's: one initial guess per right-hand side; got shape "
         r"\(9, 3\)"),
        (poisson2d(3), np.ones((9, 2)), {"x0": np.ones(9)}, ValueError,
         r"x0 must have shape \(9, 2\), b's.*got shape \(9,\)"),
        (poisson2d(3), np.ones((9, 2)), {"x0": _nan_in(0)}, ValueError,
         r"x0 has NaN or Inf entries in column 0; replace"),
        (poisson2d(3), np.ones((9, 2), complex), {}, TypeError, r"b has complex dtype"),
        (poisson2d(3), np.ones((9, 2)), {"x0": np.ones((9, 2), complex)}, TypeError,
         r"x0 has complex dtype"),
        (poisson2d(3), np.ones((9, 2)), {"maxiter": -1}, ValueError,
         r"maxiter must be a positive integer, got -1"),
        (poisson2d(3), np.ones((9, 2)), {"rtol": -1.0}, ValueError, r"rtol must be a finite"),
        (poisson2d(3), np.ones((9, 2)), {"method": "qr"}, ValueError, r"method='qr' is not known"),
        (poisson2d(3), np.ones((9, 2)), {"dtype": np.int32}, TypeError, r"dtype"),
        (poisson2d(3), np.ones((9, 2)), {"nullspace": np.ones(8)}, ValueError,
         r"nullspace must have shape \(9,\)"),
        (sp.random(4, 5, density=0.5, format="csr", random_state=0), np.ones((4, 2)), {},
         ValueError, r"A must be square"),
        (None, np.ones((4, 2)), {}, TypeError, r"A is None"),
        (sp.csr_matrix(np.full((3, 3), np.nan)), np.ones((3, 2)), {}, ValueError,
         r"A has NaN or Inf entries"),
    ],
)
def test_a_block_b_names_solve_a_b_and_the_argument_in_every_error(A, B, kwargs, exc, pattern):
    """solve(A, B) sets up a Solver, yet its errors name the call the user made, never the Solver
    nor an engine; x0 of another shape than B's is refused before any engine sees it."""
    with pytest.raises(exc, match=r"^solve\(A, B\): " + pattern):
        solve(A, B, device="cpu", **kwargs)


def test_a_block_of_torch_tensors_names_solve_a_b():
    torch = pytest.importorskip("torch")
    A = poisson2d(3)
    with pytest.raises(TypeError, match=r"^solve\(A, B\): b is a tensor on the meta device"):
        solve(A, torch.ones((9, 2), device="meta"))
    with pytest.raises(ValueError, match=r"^solve\(A, B\): x0 must have shape \(9, 2\)"):
        solve(A, torch.ones((9, 2), dtype=torch.float64),
              x0=torch.ones((9, 3), dtype=torch.float64), device="cpu")


@pytest.mark.parametrize("shape", [(9,), (9, 1)])
def test_one_guess_for_a_one_column_block_is_taken_as_a_vector_or_a_column(shape):
    A = poisson2d(3)
    B = np.arange(1.0, 10.0).reshape(9, 1)
    res = solve(A, B, x0=np.ones(shape), method="cg", rtol=1e-12, device="cpu")
    np.testing.assert_allclose(res.x[:, 0], sla.spsolve(A.tocsc(), B[:, 0]), rtol=1e-9)
