"""W6: gradients through solves (benchmarks/README.md), forward against forward + backward in one run.

Groups (the forward alone is each group's anchor, so the report's ratios are
forward + backward, and the backward alone, over the forward; targets:
backward at most 1.2 x forward, the pair at most 2.2 x; through
``solve_many`` the pair at most 2.3 x):

- ``w6-cpu``: ``solve`` on 2D Poisson N = 16k (CPU), gradients for b and A's values;
- ``w6-gpu``: the same at N = 1M on one GPU (default method and preconditioner);
- ``w6-many-cpu`` / ``w6-many-gpu``: ``solve_many`` over W2's 400 systems, every
  system's b and values requiring grad, the adjoints on what the forward
  prepared (its LU factors on the CPU, its packed batches on a GPU);
- torch-sla 0.4.0's forward and forward + backward on the same problem, where
  importable (``pip install torch-sla``; pure Python), reported beside ours.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from conftest import GPU_COUNT, sync
from managed_solve import DeviceManager, LinearSystem, solve, solve_many

torch = pytest.importorskip("torch")

RTOL = 1e-8
ROUNDS = 3
SIZES = {"cpu": 128, "cuda:0": 1024}  # N = 16k on the CPU, 1M on a GPU


def poisson2d(m: int) -> sp.csr_matrix:
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    A = (sp.kron(sp.eye(m), t) + sp.kron(t, sp.eye(m))).tocsr()
    A.sort_indices()
    return A


def leaves(A: sp.csr_matrix, device: str):
    """(crow, col, values) and b as torch tensors on ``device``; values and b require grad."""
    crow = torch.tensor(A.indptr, dtype=torch.int64, device=device)
    col = torch.tensor(A.indices, dtype=torch.int64, device=device)
    values = torch.tensor(A.data, device=device, requires_grad=True)
    b = torch.ones(A.shape[0], dtype=torch.float64, device=device, requires_grad=True)
    return (crow, col, values), b


def _sync(device: str) -> None:
    if device != "cpu":
        sync()


def _devices():
    return ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


WHO = ["forward", "forward+backward", "backward"]


def timed(benchmark, forward, device, who):
    """Time ``forward()`` (returns the loss), with its backward, or the backward alone.

    The backward alone: each round's forward runs untimed in the round's
    set-up, then ``loss.backward()`` is timed.
    """
    def run():
        loss = forward()
        if who == "forward+backward":
            loss.backward()
        _sync(device)

    if who != "backward":
        benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
        return

    def setup():
        loss = forward()
        _sync(device)
        return (loss,), {}

    def backward(loss):
        loss.backward()
        _sync(device)

    benchmark.pedantic(backward, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=0)


def check_b_gradient(A, b, x):
    """dL/db = A^-T (2 x) for L = sum(x^2), from the gradient one backward left in b."""
    g = b.grad.detach().cpu().numpy()
    xn = x.detach().cpu().numpy()
    assert np.linalg.norm(A.T @ g - 2 * xn) <= 10 * RTOL * np.linalg.norm(2 * xn)
    b.grad = None


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("who", WHO)
def bench_w6_solve(benchmark, machine_info, device, who):
    A = poisson2d(SIZES[device])
    triple, b = leaves(A, device)
    benchmark.group = f"w6-{'cpu' if device == 'cpu' else 'gpu'}"
    x = solve(triple, b, rtol=RTOL, device=device).to_torch()  # warm-up, gradient checked
    (x * x).sum().backward()
    check_b_gradient(A, b, x)

    def forward():
        x = solve(triple, b, rtol=RTOL, device=device).to_torch()
        return (x * x).sum()

    timed(benchmark, forward, device, who)
    machine_info(benchmark, "cpu" if device == "cpu" else "cuda", dtype="float64",
                 role="anchor" if who == "forward" else "ours", n=A.shape[0], nnz=A.nnz,
                 target={"forward": None, "backward": "<= 1.2 x forward",
                         "forward+backward": "<= 2.2 x forward"}[who])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("who", ["forward", "forward+backward"])
def bench_w6_torch_sla(benchmark, machine_info, device, who):
    """torch-sla on the same problem, through its public ``spsolve`` with its own choices.

    Told what it cannot know cheaply (A is SPD) and given our tolerance as
    its absolute one (its iterative backend stops at max(atol, 1e-10 ||b||));
    on the CPU it factorises (SciPy's SuperLU), on a GPU without cuDSS it
    runs its Jacobi-preconditioned CG, at 1M unknowns in any case.
    """
    torch_sla = pytest.importorskip("torch_sla")
    from torch_sla.backends import select_backend, select_method

    A = poisson2d(SIZES[device])
    C = A.tocoo()
    row = torch.tensor(C.row, dtype=torch.int64, device=device)
    col = torch.tensor(C.col, dtype=torch.int64, device=device)
    values = torch.tensor(C.data, device=device, requires_grad=True)
    b = torch.ones(A.shape[0], dtype=torch.float64, device=device, requires_grad=True)
    atol = RTOL * float(b.detach().norm())
    backend = select_backend(torch.device(device), n=A.shape[0])
    benchmark.group = f"w6-{'cpu' if device == 'cpu' else 'gpu'}"

    def run():
        x = torch_sla.spsolve(values, row, col, A.shape, b, atol=atol, is_symmetric=True,
                              is_spd=True)
        if who == "forward+backward":
            (x * x).sum().backward()
        _sync(device)
        return x

    x = run()
    xn = x.detach().cpu().numpy()
    assert np.linalg.norm(A @ xn - 1.0) <= 10 * RTOL * np.sqrt(A.shape[0])
    grad_relres = None
    if who == "forward+backward":  # dL/db = A^-T (2 x), as for ours
        # torch-sla's adjoint solve keeps its own tolerance (on a GPU looser than
        # the forward's): its accuracy is reported beside its time, and only a
        # gradient of no use (relative residual above 1e-3) fails the case.
        g = b.grad.detach().cpu().numpy() / 2
        grad_relres = float(np.linalg.norm(A.T @ g - xn) / np.linalg.norm(xn))
        assert grad_relres <= 1e-3
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu" if device == "cpu" else "cuda", dtype="float64",
                 role="reported", n=A.shape[0], who=f"torch-sla {who}",
                 torch_sla=getattr(torch_sla, "__version__", "?"),
                 torch_sla_backend=backend, grad_relres=grad_relres,
                 torch_sla_method=select_method(backend, is_symmetric=True, is_spd=True))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("who", WHO)
def bench_w6_solve_many(benchmark, machine_info, device, who):
    """W2's 400 systems, each its own matrix (its own tensors), b and values requiring grad."""
    sizes = [int(m) for m in np.random.default_rng(0).integers(32, 97, size=400)]
    mats = {m: poisson2d(m) for m in set(sizes)}
    dm = DeviceManager([device]) if device == "cpu" or GPU_COUNT else None
    benchmark.group = f"w6-many-{'cpu' if device == 'cpu' else 'gpu'}"

    def solved():
        pairs = [leaves(mats[m], device) for m in sizes]
        results = solve_many([LinearSystem(t, b, rtol=RTOL) for t, b in pairs], manager=dm)
        return pairs, results

    pairs, results = solved()  # warm-up, gradients checked
    assert all(r.converged for r in results)
    sum((r.to_torch() ** 2).sum() for r in results).backward()
    for k in (0, len(sizes) - 1):
        check_b_gradient(mats[sizes[k]], pairs[k][1], results[k].to_torch())

    def forward():
        return sum((r.to_torch() ** 2).sum() for r in solved()[1])

    timed(benchmark, forward, device, who)
    machine_info(benchmark, "cpu" if device == "cpu" else "cuda", dtype="float64",
                 role="anchor" if who == "forward" else "ours", systems=len(sizes),
                 target={"forward": None, "backward": "reported",
                         "forward+backward": "<= 2.3 x forward"}[who])
