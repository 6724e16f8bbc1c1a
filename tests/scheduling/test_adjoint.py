"""solve_many's backward: every adjoint on what its forward prepared, no set-up again."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import scipy.sparse as sp

import managed_solve as ms
from managed_solve.scheduling import adjoint, estimate, many, validate
from managed_solve.solvers.batched import PackedBatch
from managed_solve.solvers.direct import DirectEngine, PreparedDirect
from managed_solve.solvers.krylov import KrylovEngine
from tests._problems import convection_diffusion, laplacian1d, neumann2d, poisson2d

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.filterwarnings("error:managed_solve.*:RuntimeWarning"),
    # torch's notes that sparse CSR is beta and invariant checks are off
    pytest.mark.filterwarnings("ignore:.*[Ss]parse.*:UserWarning"),
]


class SetUps:
    """Counts of every set-up a solve can do: validation, estimates, packing, engines, calls."""

    def __init__(self, monkeypatch):
        self.counts = {"validate": 0, "estimate": 0, "pack": 0, "prepare": 0, "solve_many": 0}
        self._spy(monkeypatch, validate, "validate_all", "validate")
        self._spy(monkeypatch, estimate, "estimate_system", "estimate")
        self._spy(monkeypatch, many, "solve_many", "solve_many")
        for engine in (KrylovEngine, DirectEngine):
            self._spy(monkeypatch, engine, "prepare", "prepare")
        real = PackedBatch.pack.__func__

        def pack(cls, *a, **kw):
            self.counts["pack"] += 1
            return real(cls, *a, **kw)

        monkeypatch.setattr(PackedBatch, "pack", classmethod(pack))

    def _spy(self, monkeypatch, owner, name, key):
        real = getattr(owner, name)

        def counted(*a, **kw):
            self.counts[key] += 1
            return real(*a, **kw)

        monkeypatch.setattr(owner, name, counted)

    def reset(self):
        for k in self.counts:
            self.counts[k] = 0

    def none(self):
        return all(v == 0 for v in self.counts.values())


def leaves(A, device="cpu", *, seed=0):
    """(crow, col, values) and b of A as torch tensors; values and b require grad."""
    A = A.tocsr()
    A.sort_indices()
    crow = torch.tensor(A.indptr, dtype=torch.int64, device=device)
    col = torch.tensor(A.indices, dtype=torch.int64, device=device)
    values = torch.tensor(A.data, device=device, requires_grad=True)
    rng = np.random.default_rng(seed)
    b = torch.tensor(rng.standard_normal(A.shape[0]), device=device, requires_grad=True)
    return (crow, col, values), b


def dense_grads(A, b, w):
    """dL/dvalues (on A's CSR pattern) and dL/db of L = sum(w * A^-1 b), dense torch."""
    A = A.tocsr()
    A.sort_indices()
    v = torch.tensor(A.data, requires_grad=True)
    bb = b.detach().cpu().clone().requires_grad_()
    D = torch.sparse_csr_tensor(torch.tensor(A.indptr), torch.tensor(A.indices), v,
                                A.shape).to_dense()
    (torch.linalg.solve(D, bb) * w.cpu()).sum().backward()
    return v.grad, bb.grad


def close(got, want, rtol=1e-6):
    got = got.detach().cpu()
    assert float((got - want).norm()) <= rtol * float(want.norm())


def indefinite(m):
    return (poisson2d(m) - 2.7 * sp.eye(m * m)).tocsr()


# Each route of solve_many on the CPU: host LU, packed batches of each batched
# method (CG's own adjoint; BiCGStab and GMRES through the batch's transpose),
# and a solver alone (MINRES, which the batched core lacks).
ROUTES = [
    ("direct", "auto", lambda m: convection_diffusion(m), "direct"),
    ("batch-cg", "cg", lambda m: poisson2d(m), "cg"),
    ("batch-bicgstab", "bicgstab", lambda m: convection_diffusion(m), "bicgstab"),
    ("batch-gmres", "gmres", lambda m: convection_diffusion(m), "gmres"),
    ("single-minres", "minres", indefinite, "minres"),
]


@pytest.mark.parametrize("device", ["cpu", "sim:0", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name,method,build,solved_by", ROUTES, ids=[r[0] for r in ROUTES])
def test_each_routes_backward_sets_nothing_up_and_matches_a_dense_reference(
        monkeypatch, name, method, build, solved_by, device):
    if device != "cpu" and solved_by == "direct":
        pytest.skip("the host LU route is the CPU's")
    dm = ms.DeviceManager(simulate="1x64MiB") if device == "sim:0" else ms.DeviceManager([device])
    mats = [build(m) for m in (4, 5, 6, 5)]
    # On a GPU the leaves lie there too (the systems then never leave it).
    inputs = [leaves(A, "cuda:0" if device == "cuda:0" else "cpu", seed=k)
              for k, A in enumerate(mats)]
    systems = [ms.LinearSystem(t, b, method=method, rtol=10.0 ** -(11 + k % 2), name=f"s{k}")
               for k, (t, b) in enumerate(inputs)]
    spies = SetUps(monkeypatch)
    results = ms.solve_many(systems, manager=dm)
    assert {r.method for r in results} == {solved_by} and all(r.converged for r in results)
    assert {r.device for r in results} == {device}
    spies.reset()
    xs = [r.to_torch() for r in results]
    ws = [torch.cos(torch.arange(x.shape[0], dtype=torch.float64, device=x.device)) for x in xs]
    sum((x * w).sum() for x, w in zip(xs, ws, strict=True)).backward()
    assert spies.none(), spies.counts
    for A, ((_, _, values), b), w in zip(mats, inputs, ws, strict=True):
        gv, gb = dense_grads(A, b, w)
        close(values.grad, gv)
        close(b.grad, gb)
    assert values.grad.device == values.device


def test_a_batch_keeps_its_bytes_in_the_ledger_until_the_graph_is_freed():
    dm = ms.DeviceManager(simulate="1x64MiB")
    A = poisson2d(6)
    inputs = [leaves(A, seed=k) for k in range(3)]
    results = ms.solve_many([ms.LinearSystem(t, b, method="cg") for t, b in inputs], manager=dm)
    kept = dm.reserved_bytes("sim:0")
    assert kept > 0  # the packed batch waits for backward
    xs = [r.to_torch() for r in results]
    sum(x.sum() for x in xs).backward(retain_graph=True)
    first = inputs[0][1].grad.clone()
    assert dm.reserved_bytes("sim:0") == kept
    sum(x.sum() for x in xs).backward()
    assert torch.allclose(inputs[0][1].grad, 2 * first)
    assert dm.reserved_bytes("sim:0") == 0

    again = ms.solve_many([ms.LinearSystem(t, b, method="cg") for t, b in inputs], manager=dm)
    assert dm.reserved_bytes("sim:0") == kept
    del again  # a graph dropped without backward releases the batch too
    gc.collect()
    assert dm.reserved_bytes("sim:0") == 0


def test_kept_factors_and_solvers_are_closed_with_the_graph(monkeypatch):
    closed = []
    real_close = PreparedDirect.close
    monkeypatch.setattr(PreparedDirect, "close",
                        lambda self: closed.append(id(self)) or real_close(self))
    dm = ms.DeviceManager(["cpu"])
    lu = [leaves(convection_diffusion(5), seed=k) for k in range(2)]
    alone = leaves(indefinite(5))
    systems = [ms.LinearSystem(t, b) for t, b in lu]
    systems.append(ms.LinearSystem(*alone, method="minres"))
    results = ms.solve_many(systems, manager=dm)
    assert [r.method for r in results] == ["direct", "direct", "minres"]
    assert closed == [] and dm.reserved_bytes("cpu") > 0  # the factors and the solver wait
    sum(r.to_torch().sum() for r in results).backward()
    assert len(set(closed)) == 2 and dm.reserved_bytes("cpu") == 0


def test_nothing_is_kept_or_attached_under_no_grad(monkeypatch):
    dm = ms.DeviceManager(["cpu"])
    closed = []
    real_close = PreparedDirect.close
    monkeypatch.setattr(PreparedDirect, "close",
                        lambda self: closed.append(id(self)) or real_close(self))
    systems = [ms.LinearSystem(*leaves(convection_diffusion(4))),
               ms.LinearSystem(*leaves(poisson2d(4)), method="cg"),
               ms.LinearSystem(*leaves(indefinite(4)), method="minres")]
    with torch.no_grad():
        results = ms.solve_many(systems, manager=dm)
    assert all(r.to_torch().grad_fn is None for r in results)
    assert len(closed) == 1 and dm.reserved_bytes("cpu") == 0


def test_systems_without_a_gradient_share_a_kept_batch_with_zero_right_hand_sides():
    dm = ms.DeviceManager(["cpu"])
    A = convection_diffusion(5)
    with_grad = [leaves(A, seed=k) for k in range(3)]
    plain = np.ones(25)
    systems = [ms.LinearSystem(t, b, method="bicgstab", rtol=1e-12) for t, b in with_grad]
    systems.insert(1, ms.LinearSystem(A, plain, method="bicgstab"))
    results = ms.solve_many(systems, manager=dm)
    assert {r.info["batch_size"] for r in results} == {4}  # one batch
    w = torch.linspace(-1, 1, 25, dtype=torch.float64)
    (results[2].to_torch() * w).sum().backward()  # one of the three gets a gradient
    gv, gb = dense_grads(A, with_grad[1][1], w)
    close(with_grad[1][0][2].grad, gv)
    close(with_grad[1][1].grad, gb)
    assert with_grad[0][1].grad is None and with_grad[2][1].grad is None


def test_adjoints_with_nothing_kept_are_solved_with_one_solve_many_call(monkeypatch):
    monkeypatch.setattr(adjoint.Kept, "add_batch", lambda self, *a, **kw: None)
    dm = ms.DeviceManager(["cpu"])
    mats = [poisson2d(4), convection_diffusion(5), poisson2d(5)]
    inputs = [leaves(A, seed=k) for k, A in enumerate(mats)]
    methods = ["cg", "bicgstab", "direct"]  # two batches not kept, one factorisation kept
    results = ms.solve_many([ms.LinearSystem(t, b, method=m, rtol=1e-12)
                             for (t, b), m in zip(inputs, methods, strict=True)], manager=dm)
    calls = []
    real = many.solve_many
    monkeypatch.setattr(many, "solve_many",
                        lambda systems, **kw: calls.append(len(systems)) or real(systems, **kw))
    sum((r.to_torch() ** 2).sum() for r in results).backward()
    assert calls == [2]
    for A, ((_, _, values), b), r in zip(mats, inputs, results, strict=True):
        gv, gb = dense_grads(A, b, 2 * r.to_torch().detach())
        close(values.grad, gv)
        close(b.grad, gb)


def test_results_returned_on_the_host_differentiate_through_a_kept_batch():
    dm = ms.DeviceManager(simulate="1x64MiB")
    A = convection_diffusion(5)
    t, b = leaves(A)
    res = ms.solve_many([ms.LinearSystem(t, b, method="bicgstab", rtol=1e-12)], manager=dm,
                        return_on="host")[0]
    assert isinstance(res.x, np.ndarray)
    w = torch.sin(torch.arange(25, dtype=torch.float64))
    (res.to_torch() * w).sum().backward()
    gv, gb = dense_grads(A, b, w)
    close(t[2].grad, gv)
    close(b.grad, gb)


def test_batches_dispersed_over_two_devices_differentiate_without_set_ups(monkeypatch):
    dm = ms.DeviceManager(simulate="2x64MiB")
    rng = np.random.default_rng(3)
    mats = [poisson2d(int(m)) if k % 3 else convection_diffusion(int(m))
            for k, m in enumerate(rng.integers(3, 9, size=24))]
    inputs = [leaves(A, seed=k) for k, A in enumerate(mats)]
    systems = [ms.LinearSystem(t, b, rtol=1e-12, method="cg" if k % 3 else "bicgstab")
               for k, (t, b) in enumerate(inputs)]
    with ms.config.override(work_stealing=False):
        results = ms.solve_many(systems, manager=dm)
    assert {r.device for r in results} == {"sim:0", "sim:1"}
    spies = SetUps(monkeypatch)
    ws = [torch.cos(torch.arange(A.shape[0], dtype=torch.float64)) for A in mats]
    sum((r.to_torch() * w).sum() for r, w in zip(results, ws, strict=True)).backward()
    assert spies.none(), spies.counts
    for A, ((_, _, values), b), w in zip(mats, inputs, ws, strict=True):
        gv, gb = dense_grads(A, b, w)
        close(values.grad, gv)
        close(b.grad, gb)
    assert dm.reserved_bytes("sim:0") == dm.reserved_bytes("sim:1") == 0


def pinv_grads(A, b, loss):
    """dL/dvalues and dL/db of L(x) for x = P pinv(A) P b, dense torch; P projects off the constants.

    The projections are the solve's with nullspace='constant' (b's part along the
    constants left out, x orthogonal to them); the pseudo-inverse is A's inverse on
    the rest.
    """
    A = A.tocsr()
    A.sort_indices()
    n = A.shape[0]
    v = torch.tensor(A.data, requires_grad=True)
    bb = b.detach().cpu().clone().requires_grad_()
    D = torch.sparse_csr_tensor(torch.tensor(A.indptr), torch.tensor(A.indices), v,
                                A.shape).to_dense()
    P = torch.eye(n, dtype=torch.float64) - 1.0 / n
    loss(P @ torch.linalg.pinv(D) @ (P @ bb)).backward()
    return v.grad, bb.grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kept", [True, False], ids=["kept", "from-the-system"])
@pytest.mark.parametrize("method", ["cg", "minres", "gmres", "direct"])
def test_a_singular_systems_adjoint_keeps_its_null_space(monkeypatch, method, kept, device):
    """Neumann Laplacians with nullspace='constant' and b of zero mean; dL/dx has a part along
    the constants. An adjoint with nothing kept (a fallback, the Ray backend's backward) was
    solved from an adjoint system without the null space: CG and GMRES drifted along it (the
    gradient off by 1e16 and more), the factorisation found A singular (no gradient). A
    symmetric A's adjoint is A, null space included: the pseudo-inverse's gradient."""
    if not kept:  # every adjoint from its system, as when nothing of the forward is kept
        monkeypatch.setattr(adjoint.Kept, "add_solver", lambda self, i, solver: solver.release())
    mats = [laplacian1d(12, neumann=True), neumann2d(4)]
    inputs = [leaves(A, device, seed=k) for k, A in enumerate(mats)]
    with torch.no_grad():
        for _, b in inputs:
            b -= b.mean()
    results = ms.solve_many([ms.LinearSystem(t, b, method=method, nullspace="constant",
                                             rtol=1e-12, name=f"s{k}")
                             for k, (t, b) in enumerate(inputs)],
                            manager=ms.DeviceManager([device]))
    assert all(r.converged for r in results), [r.message for r in results]
    ws = [torch.sin(torch.arange(A.shape[0], dtype=torch.float64, device=device)) for A in mats]

    def loss(x, w):
        return (w * x).sum() + (x ** 3).sum()  # dL/dx = w + 3 x^2: not orthogonal to 1

    # Each x where it was solved (a tiny system may be planned on the CPU beside a cold GPU).
    sum(loss(r.to_torch(), w.to(r.to_torch().device))
        for r, w in zip(results, ws, strict=True)).backward()
    for A, ((_, _, values), b), w in zip(mats, inputs, ws, strict=True):
        gv, gb = pinv_grads(A, b, lambda x, w=w: loss(x, w.cpu()))
        close(values.grad, gv, 1e-8)
        close(b.grad, gb, 1e-8)
