"""Gradients through solve, Solver and solve_many against a dense torch reference."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

import managed_solve as ms
from managed_solve.solvers.direct import DirectEngine
from managed_solve.solvers.krylov import KrylovEngine
from tests._problems import (
    convection_diffusion,
    high_contrast_poisson,
    laplacian1d,
    neumann2d,
    poisson2d,
    random_spd,
    tridiagonal,
)

torch = pytest.importorskip("torch")

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]

# An adjoint solve that did not converge warns: here, that fails a test that did not expect it.
pytestmark = [
    pytest.mark.filterwarnings("error:managed_solve.*:RuntimeWarning"),
    # torch's notes that sparse CSR is beta and invariant checks are off
    pytest.mark.filterwarnings("ignore:.*[Ss]parse.*:UserWarning"),
]


def triplets(A, device="cpu", *, grad=True):
    """(rows, cols, values) of a CSR matrix as torch tensors; values require grad."""
    C = A.tocoo()
    t = lambda a, **kw: torch.tensor(np.asarray(a), device=device, **kw)  # noqa: E731
    return (t(C.row, dtype=torch.int64), t(C.col, dtype=torch.int64),
            t(C.data, dtype=torch.float64, requires_grad=grad))


def csr_tensor(A, device="cpu", *, grad=True):
    """A torch sparse CSR tensor with the pattern of A; its values (a leaf) and the tensor."""
    A = A.tocsr()
    A.sort_indices()
    values = torch.tensor(A.data, device=device, requires_grad=grad)
    crow = torch.tensor(A.indptr, dtype=torch.int64, device=device)
    col = torch.tensor(A.indices, dtype=torch.int64, device=device)
    return values, torch.sparse_csr_tensor(crow, col, values, A.shape), (crow, col)


def dense_reference(rows, cols, values, b, n, weights):
    """Gradients of sum(weights * x) for x = A^-1 b, A dense built from the triplets (duplicates add)."""
    v = values.detach().cpu().clone().requires_grad_(values.requires_grad)
    bb = b.detach().cpu().clone().requires_grad_(b.requires_grad)
    D = torch.zeros(n, n, dtype=torch.float64).index_put((rows.cpu(), cols.cpu()), v,
                                                         accumulate=True)
    x = torch.linalg.solve(D, bb)
    (x * weights.cpu()).sum().backward()
    return v.grad, bb.grad


def close(got, want, rtol=1e-6):
    assert got is not None and want is not None
    got = got.detach().cpu()
    assert float((got - want).norm()) <= rtol * float(want.norm()), (got, want)


def spy_prepare(monkeypatch):
    """Count engine set-ups (Krylov and direct)."""
    count = {"n": 0}
    for engine in (KrylovEngine, DirectEngine):
        original = engine.prepare

        def counted(self, *a, _original=original, **kw):
            count["n"] += 1
            return _original(self, *a, **kw)

        monkeypatch.setattr(engine, "prepare", counted)
    return count


CASES = [
    ("spd-cg", lambda: poisson2d(6), "cg"),
    ("spd-auto", lambda: random_spd(40), "auto"),
    ("nonsym-bicgstab", lambda: convection_diffusion(6), "bicgstab"),
    ("nonsym-gmres", lambda: convection_diffusion(6), "gmres"),
    ("nonsym-direct", lambda: convection_diffusion(6), "direct"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wrt", ["A", "b", "both"])
@pytest.mark.parametrize("name,build,method", CASES, ids=[c[0] for c in CASES])
def test_solve_gradients_match_a_dense_reference(name, build, method, wrt, device):
    A = build()
    n = A.shape[0]
    values, At, _ = csr_tensor(A, device, grad=wrt in ("A", "both"))
    b = torch.linspace(1.0, 2.0, n, dtype=torch.float64, device=device,
                       requires_grad=wrt in ("b", "both"))
    res = ms.solve(At, b, method=method, rtol=1e-12, device=device)
    assert res.converged
    x = res.to_torch()
    assert x.grad_fn is not None and x.device.type == torch.device(device).type
    w = torch.cos(torch.arange(n, dtype=torch.float64, device=device))
    (x * w).sum().backward()
    rows, cols, _ = triplets(A)
    gv, gb = dense_reference(rows, cols, values, b, n, w)
    if wrt in ("A", "both"):
        close(values.grad, gv)
    else:
        assert values.grad is None
    if wrt in ("b", "both"):
        close(b.grad, gb)
    else:
        assert b.grad is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["cg", "bicgstab", "direct"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_block_of_right_hand_sides_differentiates(method, device, k):
    A = poisson2d(5) if method == "cg" else convection_diffusion(5)
    n = A.shape[0]
    values, At, _ = csr_tensor(A, device)
    B = torch.rand(n, k, dtype=torch.float64, device=device, requires_grad=True)
    res = ms.solve(At, B, method=method, rtol=1e-12, device=device)
    X = res.to_torch()
    assert X.shape == (n, k) and X.grad_fn is not None
    W = torch.rand(n, k, dtype=torch.float64, device=device)
    (X * W).sum().backward()
    rows, cols, _ = triplets(A)
    v = values.detach().cpu().clone().requires_grad_()
    Bc = B.detach().cpu().clone().requires_grad_()
    D = torch.zeros(n, n, dtype=torch.float64).index_put((rows, cols), v, accumulate=True)
    (torch.linalg.solve(D, Bc) * W.cpu()).sum().backward()
    close(values.grad, v.grad)
    close(B.grad, Bc.grad)


MIXED = [pytest.param("cuda:0", marks=pytest.mark.gpu),
         pytest.param("cuda:1", marks=pytest.mark.multi_gpu)]


@pytest.mark.parametrize("solve_on", MIXED)
@pytest.mark.parametrize("method", ["cg", "gmres", "direct"])
def test_leaves_on_the_cpu_get_their_gradients_on_the_cpu_from_a_gpu_solve(method, solve_on):
    """A system whose leaves live on the CPU, solved on a GPU: x on the GPU, gradients on the CPU."""
    A = poisson2d(5) if method == "cg" else convection_diffusion(5)
    n = A.shape[0]
    values, At, _ = csr_tensor(A, "cpu")
    b = torch.rand(n, dtype=torch.float64, requires_grad=True)
    x = ms.solve(At, b, method=method, rtol=1e-12, device=solve_on).to_torch()
    assert x.device == torch.device(solve_on) and x.grad_fn is not None
    w = torch.sin(torch.arange(n, dtype=torch.float64))
    (x * w.to(x.device)).sum().backward()
    assert values.grad.device.type == "cpu" and b.grad.device.type == "cpu"
    rows, cols, _ = triplets(A)
    gv, gb = dense_reference(rows, cols, values, b, n, w)
    close(values.grad, gv)
    close(b.grad, gb)


@pytest.mark.parametrize("solve_on", MIXED)
def test_solve_many_on_a_gpu_gives_cpu_leaves_their_gradients_on_the_cpu(solve_on):
    specs = [poisson2d(4), convection_diffusion(5), poisson2d(6)]
    items, refs = [], []
    for A in specs:
        values, At, _ = csr_tensor(A, "cpu")
        b = torch.rand(A.shape[0], dtype=torch.float64, requires_grad=True)
        items.append(ms.LinearSystem(At, b, rtol=1e-12))
        refs.append((A, values, b))
    results = ms.solve_many(items, manager=ms.DeviceManager([solve_on]))
    xs = [r.to_torch() for r in results]
    assert all(x.device == torch.device(solve_on) for x in xs)
    ws = [torch.cos(torch.arange(x.shape[0], dtype=torch.float64)) for x in xs]
    sum((x * w.to(x.device)).sum() for x, w in zip(xs, ws, strict=True)).backward()
    for (A, values, b), w in zip(refs, ws, strict=True):
        assert values.grad.device.type == "cpu" and b.grad.device.type == "cpu"
        rows, cols, _ = triplets(A)
        gv, gb = dense_reference(rows, cols, values, b, A.shape[0], w)
        close(values.grad, gv)
        close(b.grad, gb)


def test_coo_gradients_come_back_in_the_callers_order_with_duplicates():
    A = convection_diffusion(5)
    n = A.shape[0]
    rows, cols, vals = triplets(A, grad=False)
    # Shuffle, then split some entries into two duplicates that add up.
    perm = torch.randperm(rows.numel(), generator=torch.Generator().manual_seed(0))
    rows, cols, vals = rows[perm], cols[perm], vals[perm]
    dup = torch.arange(0, rows.numel(), 7)
    rows = torch.cat([rows, rows[dup]])
    cols = torch.cat([cols, cols[dup]])
    vals = torch.cat([vals, torch.zeros(dup.numel(), dtype=torch.float64)])
    vals[dup] *= 0.25
    vals[-dup.numel():] = 3 * vals[dup]
    values = vals.clone().requires_grad_()
    A_coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), values, (n, n))
    assert not A_coo.is_coalesced()
    b = torch.ones(n, dtype=torch.float64)
    x = ms.solve(A_coo, b, method="gmres", rtol=1e-12, device="cpu").to_torch()
    w = torch.linspace(-1, 1, n, dtype=torch.float64)
    (x * w).sum().backward()
    gv, _ = dense_reference(rows, cols, values, b, n, w)
    close(values.grad, gv)


def test_the_crow_col_values_form_takes_gradients_on_values():
    A = random_spd(30)
    A.sort_indices()
    values = torch.tensor(A.data, requires_grad=True)
    b = torch.ones(30, dtype=torch.float64, requires_grad=True)
    x = ms.solve((A.indptr, A.indices, values), b, rtol=1e-12, device="cpu").to_torch()
    x.pow(2).sum().backward()
    rows, cols, _ = triplets(A)
    v = values.detach().clone().requires_grad_()
    bb = b.detach().clone().requires_grad_()
    D = torch.zeros(30, 30, dtype=torch.float64).index_put((rows, cols), v, accumulate=True)
    torch.linalg.solve(D, bb).pow(2).sum().backward()
    close(values.grad, v.grad)
    close(b.grad, bb.grad)


def test_a_dense_torch_matrix_takes_gradients():
    A = torch.tensor(convection_diffusion(4).toarray(), requires_grad=True)
    b = torch.arange(16, dtype=torch.float64, requires_grad=True)
    ms.solve(A, b, method="direct", device="cpu").to_torch().sum().backward()
    A2, b2 = A.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.linalg.solve(A2, b2).sum().backward()
    close(A.grad, A2.grad)
    close(b.grad, b2.grad)


@pytest.mark.parametrize("method", ["direct", "cg"])
def test_gradcheck_on_a_tiny_system(method):
    A = laplacian1d(6) + sp.diags(np.linspace(0.5, 1.0, 6))
    A = A.tocsr()
    if method == "direct":  # and non-symmetric
        A = (A + sp.diags([0.3], [1], shape=(6, 6))).tocsr()
    A.sort_indices()
    values = torch.tensor(A.data, requires_grad=True)
    b = torch.linspace(1.0, 2.0, 6, dtype=torch.float64, requires_grad=True)

    def f(v, bb):
        return ms.solve((A.indptr, A.indices, v), bb, method=method, rtol=1e-14,
                        device="cpu").to_torch()

    assert torch.autograd.gradcheck(f, (values, b), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_through_solve_many():
    mats = [laplacian1d(5).tocsr(), (laplacian1d(4) + sp.diags([0.4], [-1], shape=(4, 4))).tocsr()]
    for M in mats:
        M.sort_indices()
    vals = [torch.tensor(M.data, requires_grad=True) for M in mats]
    bs = [torch.ones(M.shape[0], dtype=torch.float64, requires_grad=True) for M in mats]
    dm = ms.DeviceManager(["cpu"])

    def f(v0, v1, b0, b1):
        res = ms.solve_many([((mats[0].indptr, mats[0].indices, v0), b0),
                             ((mats[1].indptr, mats[1].indices, v1), b1)], method="direct",
                            manager=dm)
        return tuple(r.to_torch() for r in res)

    assert torch.autograd.gradcheck(f, (*vals, *bs), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_solve_many_mixes_systems_with_and_without_gradients(monkeypatch, device):
    from managed_solve.scheduling import many

    specs = [(poisson2d(4), True), (convection_diffusion(5), True), (random_spd(20), False),
             (convection_diffusion(4), True), (poisson2d(6), False)]
    items, refs = [], []
    for i, (A, grad) in enumerate(specs):
        values, At, _ = csr_tensor(A, device, grad=grad)
        b = torch.rand(A.shape[0], dtype=torch.float64, device=device, requires_grad=grad)
        items.append(ms.LinearSystem(At, b, rtol=10.0 ** -(11 + i % 2), name=f"sys{i}"))
        refs.append((A, values, b))
    dm = ms.DeviceManager(["cpu"] if device == "cpu" else [device])
    results = ms.solve_many(items, manager=dm)
    xs = [r.to_torch() for r in results]
    assert [x.grad_fn is not None for x in xs] == [g for _, g in specs]

    calls = []
    real = many.solve_many
    monkeypatch.setattr(many, "solve_many",
                        lambda systems, **kw: calls.append(len(systems)) or real(systems, **kw))
    count = spy_prepare(monkeypatch)
    ws = [torch.sin(torch.arange(x.shape[0], dtype=torch.float64, device=x.device)) for x in xs]
    sum((x * w).sum() for x, w in zip(xs, ws, strict=True)).backward()
    assert calls == [] and count["n"] == 0  # the adjoints on what the forward prepared
    for (A, values, b), w, (_, grad) in zip(refs, ws, specs, strict=True):
        if not grad:
            continue
        rows, cols, _ = triplets(A)
        gv, gb = dense_reference(rows, cols, values, b, A.shape[0], w)
        close(values.grad, gv)
        close(b.grad, gb)


def test_solve_many_backward_skips_systems_without_a_gradient_from_the_loss(monkeypatch):
    from managed_solve.solvers.direct import PreparedDirect

    # A high-contrast coefficient: the CPU's auto policy factorises it (host LU route).
    A = high_contrast_poisson(8)
    items = [(csr_tensor(A)[1], torch.ones(A.shape[0], dtype=torch.float64)) for _ in range(3)]
    results = ms.solve_many(items, manager=ms.DeviceManager(["cpu"]))
    assert {r.method for r in results} == {"direct"}
    solves = []
    real = PreparedDirect.solve_to
    monkeypatch.setattr(PreparedDirect, "solve_to",
                        lambda self, b, *a, **kw: solves.append(kw) or real(self, b, *a, **kw))
    results[1].to_torch().sum().backward()
    assert solves == [{"trans": True}]  # one adjoint, on the forward's factors


def test_an_operator_whose_values_require_grad_is_a_clear_error():
    w = torch.ones(5, dtype=torch.float64, requires_grad=True)

    class Scaled:
        shape = (5, 5)
        dtype = np.float64

        def __init__(self):
            self.weights = w

        def matvec(self, v):
            return v * self.weights.detach().numpy()

    with pytest.raises(TypeError, match="operator.*require grad"):
        ms.solve(Scaled(), np.ones(5))
    results = ms.solve_many([(Scaled(), np.ones(5))], manager=ms.DeviceManager(["cpu"]))
    assert results[0].status is ms.Status.INVALID_INPUT
    assert "require grad" in results[0].message


def test_an_operator_with_a_b_that_requires_grad_differentiates_b():
    A = convection_diffusion(4)
    op = sla.aslinearoperator(A)
    b = torch.ones(16, dtype=torch.float64, requires_grad=True)
    ms.solve(op, b, method="gmres", rtol=1e-12, device="cpu").to_torch().sum().backward()
    want = np.linalg.solve(A.toarray().T, np.ones(16))
    np.testing.assert_allclose(b.grad.numpy(), want, rtol=1e-6)


def test_a_sharded_solve_refuses_inputs_that_require_grad():
    b = torch.ones(16, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="sharded solve gives no gradient"):
        ms.solve(poisson2d(4), b, devices=["sim:0", "sim:1"])


@pytest.mark.parametrize("method", ["direct", "bicgstab", "cg"])
def test_backward_reuses_the_forward_engine(monkeypatch, method):
    count = spy_prepare(monkeypatch)
    A = poisson2d(5) if method == "cg" else convection_diffusion(5)
    values, At, _ = csr_tensor(A)
    x = ms.solve(At, torch.ones(25, dtype=torch.float64), method=method, device="cpu").to_torch()
    assert count["n"] == 1
    x.sum().backward()
    assert count["n"] == 1 and values.grad is not None


def test_the_solver_is_released_after_backward_and_kept_for_retain_graph():
    dm = ms.DeviceManager(["cpu"])
    b = torch.ones(25, dtype=torch.float64, requires_grad=True)
    x = ms.solve(poisson2d(5), b, device="cpu", manager=dm).to_torch()
    assert dm.reserved_bytes("cpu") > 0  # the solver waits for backward
    x.sum().backward(retain_graph=True)
    first = b.grad.clone()
    assert dm.reserved_bytes("cpu") > 0
    x.sum().backward()
    assert torch.allclose(b.grad, 2 * first)
    assert dm.reserved_bytes("cpu") == 0
    with pytest.raises(RuntimeError, match="second time"):
        x.sum().backward()

    y = ms.solve(poisson2d(5), b, device="cpu", manager=dm).to_torch()
    assert dm.reserved_bytes("cpu") > 0
    del y  # a graph dropped without backward frees the solver too
    gc.collect()
    assert dm.reserved_bytes("cpu") == 0


def test_nothing_is_attached_without_grad_or_under_no_grad():
    dm = ms.DeviceManager(["cpu"])
    b = torch.ones(25, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        res = ms.solve(poisson2d(5), b, device="cpu", manager=dm)
    assert res.to_torch().grad_fn is None and dm.reserved_bytes("cpu") == 0
    plain = ms.solve(poisson2d(5), torch.ones(25, dtype=torch.float64), device="cpu")
    assert plain.to_torch().grad_fn is None


def test_an_attached_result_shares_memory_and_pickles_without_the_graph():
    b = torch.ones(25, dtype=torch.float64, requires_grad=True)
    res = ms.solve(poisson2d(5), b, device="cpu")
    x = res.to_torch()
    assert x is res.to_torch() and np.shares_memory(x.detach().numpy(), res.x)
    back = pickle.loads(pickle.dumps(res))
    assert back.to_torch().grad_fn is None
    np.testing.assert_array_equal(back.x, res.x)


def test_a_solver_attaches_its_solves_and_transposed_solves():
    A = convection_diffusion(5)
    values, At, (crow, col) = csr_tensor(A)
    b = torch.ones(25, dtype=torch.float64, requires_grad=True)
    solver = ms.Solver(At, method="direct", device="cpu")
    x = solver.solve(b).to_torch()
    y = solver.solve_transpose(b).to_torch()
    (x.sum() + (y * y).sum()).backward()
    v = values.detach().clone().requires_grad_()
    bb = b.detach().clone().requires_grad_()
    D = torch.sparse_csr_tensor(crow, col, v, (25, 25)).to_dense()
    (torch.linalg.solve(D, bb).sum() + torch.linalg.solve(D.T, bb).pow(2).sum()).backward()
    close(values.grad, v.grad)
    close(b.grad, bb.grad)
    solver.close()


def test_a_backward_solve_that_does_not_converge_warns_naming_the_system():
    n = 40
    A = laplacian1d(n)
    # An eigenvector: CG converges in one iteration forward; the adjoint of a
    # generic gradient needs many more than maxiter allows.
    b = torch.tensor(np.sin(np.pi * np.arange(1, n + 1) / (n + 1)), requires_grad=True)
    system = ms.LinearSystem(A, b, method="cg", maxiter=3, rtol=1e-10, name="eigen")
    res = ms.solve(system, device="cpu")
    assert res.converged
    x = res.to_torch()
    with pytest.warns(RuntimeWarning, match="adjoint solve of eigen did not converge"):
        (x * torch.arange(n, dtype=torch.float64)).sum().backward()
    assert b.grad is not None  # given, though inaccurate

    results = ms.solve_many([system], manager=ms.DeviceManager(["cpu"]))
    with pytest.warns(RuntimeWarning, match="adjoint solve of eigen did not converge"):
        (results[0].to_torch() * torch.arange(n, dtype=torch.float64)).sum().backward()


@pytest.mark.gpu
def test_a_gradient_reaches_a_cpu_leaf_from_a_gpu_solve():
    A = convection_diffusion(5)
    values, At, _ = csr_tensor(A, "cpu")
    b = torch.ones(25, dtype=torch.float64, requires_grad=True)
    res = ms.solve(At, b, method="bicgstab", rtol=1e-12, device="cuda:0")
    x = res.to_torch()
    assert x.device.type == "cuda"
    w = torch.linspace(0, 1, 25, dtype=torch.float64, device=x.device)
    (x * w).sum().backward()
    assert values.grad.device.type == "cpu" and b.grad.device.type == "cpu"
    rows, cols, _ = triplets(A)
    gv, gb = dense_reference(rows, cols, values, b, 25, w.cpu())
    close(values.grad, gv)
    close(b.grad, gb)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["values", "csr", "dense"])
def test_create_graph_keeps_first_derivatives_and_refuses_second_ones(form, device):
    """The adjoint solve runs outside torch's graph: a gradient of the gradient would drop the
    solve's part (a Hessian-vector product came back as the loss's other terms alone), so it
    raises; the first derivatives under create_graph=True are the dense reference's."""
    A = convection_diffusion(5)
    n = A.shape[0]
    b = torch.linspace(1.0, 2.0, n, dtype=torch.float64, device=device).requires_grad_(True)
    if form == "values":
        rows, cols, values = triplets(A, device)
        C = A.tocsr()
        Ain = (torch.tensor(C.indptr, device=device), torch.tensor(C.indices, device=device),
               torch.tensor(C.data, device=device, requires_grad=True))
        leaf = Ain[2]
    elif form == "csr":
        leaf, Ain, _ = csr_tensor(A, device)
    else:
        leaf = Ain = torch.tensor(A.toarray(), device=device, requires_grad=True)
    x = ms.solve(Ain, b, rtol=1e-12, method="direct").to_torch()
    weights = torch.arange(1.0, n + 1, dtype=torch.float64, device=device)
    gA, gb = torch.autograd.grad((weights * x).sum(), (leaf, b), create_graph=True)
    D = torch.tensor(A.toarray(), dtype=torch.float64, requires_grad=True)
    bb = b.detach().cpu().clone().requires_grad_(True)
    (weights.cpu() * torch.linalg.solve(D, bb)).sum().backward()
    close(gb, bb.grad, 1e-9)
    want_A = D.grad if form == "dense" else D.grad[torch.tensor(A.tocoo().row), torch.tensor(A.tocoo().col)]
    got_A = gA.to_dense() if gA.layout != torch.strided else gA
    if form == "csr":
        got_A = got_A.values() if got_A.layout != torch.strided else got_A
        want_A = D.grad[torch.tensor(A.tocsr().tocoo().row), torch.tensor(A.tocsr().tocoo().col)]
    close(got_A.reshape(-1) if form != "dense" else got_A, want_A.reshape(-1) if form != "dense" else want_A, 1e-9)
    # d(gb)/db is zero (gb = A^-T w), d(gb)/dA is not; gA depends on both. (The values'
    # gradient of a torch CSR tensor is not differentiated again here: it passes through
    # torch's sparse backward, which stops before reaching the solve.)
    seconds = [(gb, leaf), (gb, b)] + ([(gA, leaf), (gA, b)] if form != "csr" else [])
    for g, wrt in seconds:
        with pytest.raises(RuntimeError, match="second derivatives through a solve are not supported"):
            torch.autograd.grad(g.sum(), wrt, allow_unused=True, retain_graph=True)


def test_a_null_space_solves_gradient_is_the_pseudo_inverses_without_a_warning():
    """dL/dx seldom lies in a singular A's range: the adjoint's least-squares answer is exact."""
    A = laplacian1d(6, neumann=True)
    rng = np.random.default_rng(3)
    b0 = rng.standard_normal(6)
    b = torch.tensor(b0 - b0.mean(), requires_grad=True)
    res = ms.solve(A, b, nullspace="constant", device="cpu", rtol=1e-12)
    assert res.status is ms.Status.CONVERGED
    g = torch.arange(6, dtype=torch.float64)
    (res.to_torch() * g).sum().backward()  # the module's marks turn a RuntimeWarning into an error
    want = torch.linalg.pinv(torch.tensor(A.toarray())).T @ g
    close(b.grad, want, 1e-10)


@pytest.mark.parametrize("method", ["cg", "minres", "direct"])
def test_a_singular_solves_gradients_are_the_projected_pseudo_inverses(method):
    """A 2D Neumann Laplacian, nullspace='constant', b of zero mean, a loss whose dL/dx has a
    part along the constants: A's values and b get the gradients of x = P pinv(A) P b (dense
    torch; P projects off the constants), through solve() and a Solver's solve."""
    A = neumann2d(4)
    A.sort_indices()
    n = A.shape[0]
    b0 = np.random.default_rng(5).standard_normal(n)
    b0 -= b0.mean()
    w = torch.cos(torch.arange(n, dtype=torch.float64))

    def loss(x):
        return (w * x).sum() + (x ** 3).sum()

    v = torch.tensor(A.data, requires_grad=True)
    bb = torch.tensor(b0, requires_grad=True)
    D = torch.sparse_csr_tensor(torch.tensor(A.indptr), torch.tensor(A.indices), v,
                                A.shape).to_dense()
    P = torch.eye(n, dtype=torch.float64) - 1.0 / n
    loss(P @ torch.linalg.pinv(D) @ (P @ bb)).backward()
    for run in ("solve", "Solver"):
        t = (torch.tensor(A.indptr), torch.tensor(A.indices),
             torch.tensor(A.data, requires_grad=True))
        b = torch.tensor(b0, requires_grad=True)
        if run == "solve":
            res = ms.solve(t, b, method=method, nullspace="constant", device="cpu", rtol=1e-12)
        else:
            with ms.Solver(t, method=method, nullspace="constant", device="cpu",
                           rtol=1e-12) as solver:
                res = solver.solve(b)
                loss(res.to_torch()).backward()  # while the solver is open
        assert res.converged, res.message
        if run == "solve":
            loss(res.to_torch()).backward()
        close(t[2].grad, v.grad, 1e-8)
        close(b.grad, bb.grad, 1e-8)


def neumann_convection(n=20):
    """A 1D Neumann Laplacian plus upwind convection: A 1 = 0 but 1^T A != 0 (non-symmetric)."""
    up = sp.diags([-np.ones(n - 1), np.r_[0.0, np.ones(n - 1)]], [-1, 0], format="csr")
    A = (laplacian1d(n, neumann=True) + 0.4 * up).tocsr()
    A.sort_indices()
    rng = np.random.default_rng(8)
    y, v = A @ rng.standard_normal(n), A @ np.eye(n)[0]
    return A, y - (y.sum() / v.sum()) * v  # b in A's range, orthogonal to the constants


def test_an_adjoint_system_keeps_a_symmetric_null_space_and_refuses_a_non_symmetric_one():
    """The adjoint system A^T lam = g was built without nullspace=. A symmetric A's adjoint has
    its null space; a non-symmetric one's (A^T's) is not known: refused, naming the fix."""
    from managed_solve.autograd import adjoint_system

    A = laplacian1d(12, neumann=True)
    s = ms.LinearSystem(A, np.zeros(12), nullspace="constant", name="heat")
    forward = ms.solve(s, device="cpu")
    g = np.arange(12.0)
    adj = adjoint_system(s, forward, g)
    assert adj.nullspace is not None
    np.testing.assert_array_equal(adj.nullspace, s.nullspace)
    got = ms.solve(adj, device="cpu", rtol=1e-12)
    assert got.status is ms.Status.LEAST_SQUARES  # g's part along the constants: no lam reaches it
    np.testing.assert_allclose(got.x, np.linalg.pinv(A.toarray()) @ g, rtol=1e-9, atol=1e-12)
    C, b = neumann_convection()
    t = ms.LinearSystem(C, b, nullspace="constant", name="drift")
    with pytest.raises(NotImplementedError, match=r"^gradient of drift: A is not symmetric and "
                                                  r"has a null space \(nullspace=\).*solve\(\)"):
        adjoint_system(t, ms.solve(t, device="cpu"), np.ones(C.shape[0]))


@pytest.mark.parametrize("method", ["gmres", "direct"])
def test_a_non_symmetric_singular_systems_gradient_on_its_solver_or_refused(monkeypatch, method):
    """solve() and solve_many's kept solver solve the adjoint on the forward's set-up: A^T's
    range is the orthogonal complement of A's null space, so g projected onto it is reached,
    by the lam orthogonal to the null space (a dense NumPy reference). With nothing of the
    forward kept, the adjoint system would need A^T's null space: refused, not wrong."""
    from managed_solve.scheduling import adjoint

    A, b0 = neumann_convection()
    n = A.shape[0]
    w = torch.tensor(np.random.default_rng(2).standard_normal(n))
    Pw = w.numpy() - w.numpy().mean()
    want = np.linalg.lstsq(np.vstack([A.T.toarray(), np.ones((1, n))]), np.r_[Pw, 0.0],
                           rcond=None)[0]

    def leaves():
        return ((torch.tensor(A.indptr), torch.tensor(A.indices),
                 torch.tensor(A.data, requires_grad=True)), torch.tensor(b0, requires_grad=True))

    for run in ("solve", "solve_many"):
        t, b = leaves()
        if run == "solve":
            res = ms.solve(t, b, nullspace="constant", method=method, device="cpu", rtol=1e-12)
        else:
            res = ms.solve_many([ms.LinearSystem(t, b, nullspace="constant", method=method,
                                                 rtol=1e-12)])[0]
        assert res.converged, res.message
        (w * res.to_torch()).sum().backward()
        np.testing.assert_allclose(b.grad.numpy(), want, rtol=1e-8, atol=1e-10)
        close(t[2].grad, torch.tensor(-want[A.tocoo().row] * res.x[A.tocoo().col]), 1e-8)
    monkeypatch.setattr(adjoint.Kept, "add_solver", lambda self, i, solver: solver.release())
    t, b = leaves()
    res = ms.solve_many([ms.LinearSystem(t, b, nullspace="constant", method=method, rtol=1e-12,
                                         name="drift")])[0]
    with pytest.raises(NotImplementedError, match=r"^gradient of drift: A is not symmetric"):
        (w * res.to_torch()).sum().backward()


def test_the_adjoint_of_an_operator_with_rmatvec_alone_is_its_transpose():
    """The transposition asks for an operator with rmatvec; one without .T is as good."""
    from managed_solve.autograd import transposed

    A = convection_diffusion(4)

    class Op:
        shape, dtype = A.shape, A.dtype

        def matvec(self, v):
            return A @ v

        def rmatvec(self, v):
            return A.T @ v

    AT = transposed(ms.LinearSystem(Op(), np.ones(A.shape[0])))
    v = np.random.default_rng(2).standard_normal(A.shape[0])
    np.testing.assert_allclose(AT.matvec(v), A.T @ v, rtol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", ["mul_", "setitem"])
def test_changing_x_in_place_before_backward_is_torchs_error_not_a_wrong_gradient(change, device):
    """The gradient of A's values is formed from x: an in-place change of x before backward
    raises torch's "modified by an inplace operation" error, as torch.linalg.solve does."""
    A = convection_diffusion(5)
    values, At, _ = csr_tensor(A, device)
    b = torch.linspace(1.0, 2.0, A.shape[0], dtype=torch.float64, device=device)
    x = ms.solve(At, b, rtol=1e-12, device=device).to_torch()
    if change == "mul_":
        x.mul_(2.0)
    else:
        x[0] = 0.0
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*x.clone"):
        x.sum().backward()
    D = torch.tensor(A.toarray(), requires_grad=True)
    xd = torch.linalg.solve(D, b.cpu())
    xd.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        xd.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_x_changed_in_place_still_gives_b_its_gradient(device):
    """b's gradient is the adjoint alone: an in-place change of x does not touch it."""
    A = convection_diffusion(5)
    n = A.shape[0]
    b = torch.linspace(1.0, 2.0, n, dtype=torch.float64, device=device, requires_grad=True)
    _, At, _ = csr_tensor(A, device, grad=False)
    x = ms.solve(At, b, rtol=1e-12, device=device).to_torch()
    x.mul_(2.0)
    x.sum().backward()
    _, want = dense_reference(*triplets(A, grad=False), b, n, 2.0 * torch.ones(n, dtype=torch.float64))
    close(b.grad, want, rtol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
def test_a_copy_of_x_changed_in_place_keeps_the_gradient_right(device):
    A = convection_diffusion(5)
    n = A.shape[0]
    values, At, (crow, col) = csr_tensor(A, device)
    b = torch.linspace(1.0, 2.0, n, dtype=torch.float64, device=device)
    x = ms.solve(At, b, rtol=1e-12, device=device).to_torch().clone()
    x.mul_(2.0)
    x.sum().backward()
    D = torch.sparse_csr_tensor(crow.cpu(), col.cpu(), values.detach().cpu(), A.shape).to_dense()
    D.requires_grad_(True)
    (2.0 * torch.linalg.solve(D, b.cpu())).sum().backward()
    rows = np.repeat(np.arange(n), np.diff(crow.cpu().numpy()))
    close(values.grad, D.grad[rows, col.cpu().numpy()], rtol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["direct", "cg", "gmres"])
def test_a_loss_over_solves_before_and_after_an_update_gets_both_gradients(method, device):
    """solve, update, solve, one loss, backward: each solve's adjoint is of its own matrix."""
    A = poisson2d(5) if method == "cg" else convection_diffusion(5)
    n = A.shape[0]
    v1, A1, (crow, col) = csr_tensor(A, device)
    diagonal = A.indices == np.repeat(np.arange(n), np.diff(A.indptr))
    v2 = torch.tensor(3.0 * A.data + 0.5 * diagonal, device=device, requires_grad=True)
    b = torch.linspace(1.0, 2.0, n, dtype=torch.float64, device=device, requires_grad=True)
    with ms.Solver(A1, method=method, rtol=1e-12, device=device) as solver:
        x1 = solver.solve(b).to_torch()
        solver.update((crow, col, v2))
        x2 = solver.solve(b).to_torch()
        ((x1 ** 2).sum() + (x1 * x2).sum()).backward()
    d1, d2 = (torch.sparse_csr_tensor(crow.cpu(), col.cpu(), v.detach().cpu(), A.shape)
              .to_dense().requires_grad_(True) for v in (v1, v2))
    bd = b.detach().cpu().requires_grad_(True)
    y1, y2 = torch.linalg.solve(d1, bd), torch.linalg.solve(d2, bd)
    ((y1 ** 2).sum() + (y1 * y2).sum()).backward()
    rows = np.repeat(np.arange(n), np.diff(crow.cpu().numpy()))
    cols = col.cpu().numpy()
    close(v1.grad, d1.grad[rows, cols], rtol=1e-8)
    close(v2.grad, d2.grad[rows, cols], rtol=1e-8)
    close(b.grad, bd.grad, rtol=1e-8)


def test_an_update_with_graphs_alive_hands_them_the_old_set_up_and_releases_it_after(monkeypatch):
    """The graphs' set-up is closed when the last of them is freed; the solver's own on close."""
    closed = []
    original = DirectEngine.prepare

    def recording(self, *a, **kw):
        prepared = original(self, *a, **kw)
        close_ = prepared.close
        prepared.close = lambda: (closed.append(prepared), close_())[1]
        return prepared

    monkeypatch.setattr(DirectEngine, "prepare", recording)
    A = convection_diffusion(5)
    values, At, (crow, col) = csr_tensor(A)
    b = torch.ones(A.shape[0], dtype=torch.float64)
    solver = ms.Solver(At, method="direct")
    x = solver.solve(b).to_torch()
    solver.update((crow, col, values.detach() * 2.0))
    assert closed == []  # the graph still needs the first factorisation
    x.sum().backward()
    del x
    gc.collect()
    assert len(closed) == 1  # freed with the graph
    solver.close()
    assert len(closed) == 2


def test_a_refused_update_with_graphs_alive_changes_nothing():
    A = poisson2d(5)
    n = A.shape[0]
    values, At, (crow, col) = csr_tensor(A)
    b = torch.linspace(1.0, 2.0, n, dtype=torch.float64)
    zero_diagonal = values.detach().clone()
    zero_diagonal[torch.as_tensor(A.indices == np.repeat(np.arange(n), np.diff(A.indptr)))] = 0
    with ms.Solver(At, method="cg", M="jacobi", rtol=1e-12) as solver:
        x = solver.solve(b).to_torch()
        with pytest.raises(ValueError, match="zero diagonal"):
            solver.update((crow, col, zero_diagonal))
        again = solver.solve(b.detach())
        x.sum().backward()
    want = torch.linalg.solve(torch.tensor(A.toarray()), b)
    close(again.to_torch(), want, rtol=1e-9)
    D = torch.tensor(A.toarray(), requires_grad=True)
    torch.linalg.solve(D, b).sum().backward()
    rows = np.repeat(np.arange(n), np.diff(crow.numpy()))
    close(values.grad, D.grad[rows, col.numpy()], rtol=1e-8)


@pytest.mark.parametrize("device,method", [
    ("cpu", "auto"), ("cpu", "direct"), ("cpu", "bicgstab"),
    *(pytest.param("cuda:0", m, marks=pytest.mark.gpu) for m in ("direct", "bicgstab"))])
def test_a_penalised_non_symmetric_matrix_gets_the_transposed_adjoint(method, device):
    """A 1e15 penalty on the diagonal once made this matrix pass for symmetric (pairs 1.0 apart
    within 1e-12 * 1e15): the adjoint then solved A instead of A^T and dL/db was 90% off."""
    n = 50
    A = tridiagonal(n, -1.5, 2.0, -0.5).tolil()  # upwind convection: mirrors 1.0 apart
    A[0, 0] = A[n - 1, n - 1] = 1e15  # penalty Dirichlet conditions at both ends
    A = A.tocsr()
    values, At, _ = csr_tensor(A, device)
    b0 = np.ones(n)
    b0[0] = b0[-1] = 0.0
    b = torch.tensor(b0, device=device, requires_grad=True)
    res = ms.solve(At, b, method=method, rtol=1e-10, device=device,
                   M="jacobi" if method == "bicgstab" else "auto")  # unpreconditioned: 1e15 stalls it
    assert res.converged, res.message
    w = torch.linspace(0.0, 1.0, n, dtype=torch.float64, device=device)
    (res.to_torch() * w).sum().backward()
    rows, cols, _ = triplets(A)
    gv, gb = dense_reference(rows, cols, values, b, n, w)
    close(b.grad, gb)
    close(values.grad, gv)


@pytest.mark.parametrize("how,device", [
    ("solve", "cpu"), ("Solver cg", "cpu"), ("solve_many cg batch", "cpu"),
    ("from the system", "cpu"), pytest.param("solve", "cuda:0", marks=pytest.mark.gpu),
    pytest.param("Solver cg", "cuda:0", marks=pytest.mark.gpu),
    pytest.param("solve_many cg batch", "cuda:0", marks=pytest.mark.gpu)])
def test_a_float32_matrix_symmetric_only_to_float32s_rule_has_the_transposes_adjoint(how, device):
    """float32's symmetry rule (128 ulps) picks CG or Cholesky for a matrix assembled with its
    mirrors a few ulps apart; the adjoint must still solve A^T, not A: through A the gradient
    carried the asymmetry the rule allows (1e-4 off here, against a float64 dense reference).
    Direct (Cholesky, its transposed solve refined against A^T) and CG (on A^T) alike."""
    from managed_solve.autograd import adjoint_system

    P = poisson2d(20).tocoo()
    d = P.data.copy()
    d[P.row < P.col] *= 1 + 1.2e-5  # inside float32's rule, far outside float64's
    A = sp.csr_matrix((d, (P.row, P.col)), shape=P.shape).astype(np.float32)
    A.sort_indices()
    n = A.shape[0]
    rng = np.random.default_rng(0)
    b0, w0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    D = torch.tensor(A.toarray().astype(np.float64), requires_grad=True)
    bd = torch.tensor(b0.astype(np.float64), requires_grad=True)
    (torch.tensor(w0.astype(np.float64)) * torch.linalg.solve(D, bd)).sum().backward()
    want_b = bd.grad
    want_v = D.grad[A.tocoo().row, A.tocoo().col]  # dL/dA at the stored entries (COO = CSR order)
    crow, col = torch.tensor(A.indptr.astype(np.int64)), torch.tensor(A.indices.astype(np.int64))
    v = torch.tensor(A.data, requires_grad=True)
    b = torch.tensor(b0, requires_grad=True)
    w = torch.tensor(w0)
    if how == "from the system":  # the adjoint a solve_many without a kept solver solves
        s = ms.LinearSystem(A, b0, rtol=1e-5, method="cg")
        lam = ms.solve(adjoint_system(s, s, w0), device=device)
        assert lam.converged
        got = torch.tensor(np.asarray(lam.x, np.float64))
        close(got, want_b, 2e-5)
        return
    if how == "solve":
        res = ms.solve((crow, col, v), b, rtol=1e-5, method="direct", device=device)
    elif how == "Solver cg":
        solver = ms.Solver((crow, col, v), method="cg", rtol=1e-5, device=device)
        res = solver.solve(b)
    else:  # two systems of one size: one CG batch, its adjoints one batched solve
        other = torch.tensor(b0[::-1].copy(), requires_grad=True)
        res, _ = ms.solve_many([ms.LinearSystem((crow, col, v), b, rtol=1e-5),
                                ms.LinearSystem((crow, col, v), other, rtol=1e-5)],
                               method="cg", devices=[device])
    assert res.converged, res.message
    (w * res.to_torch().cpu()).sum().backward()
    close(b.grad.double(), want_b, 2e-5)
    close(v.grad.double(), want_v, 2e-5)
