"""Solve and train where the data lies: one torch.distributed rank per GPU (or CPU process).

Each rank solves its share of 2D Poisson problems (a Gaussian source whose
centre and width vary) on its own device with ``managed_solve.solve``, hands
the solutions to torch without a copy (``SolveResult.to_torch()``, DLPack),
and trains a small surrogate (source parameters -> solution field) with
DistributedDataParallel. Nothing moves through the host.

Backend nccl on GPUs, gloo on the CPU. Launch::

    torchrun --nproc_per_node=2 examples/ddp_solve_train.py [--small]
    python examples/ddp_solve_train.py [--small]        # one process, same result

Every rank holds the same number of systems and the loss is a mean, so the
averaged DDP gradient equals the one-process full-batch gradient: both runs
print the same ``final_loss=...`` (rank 0, last line) up to rounding.
"""

from __future__ import annotations

import argparse
import gc
import os

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

from managed_solve import _backend, solve
from managed_solve.manager import default_manager


def poisson_2d(m: int) -> sp.csr_matrix:
    """5-point Laplacian on an m x m interior grid of the unit square, Dirichlet, scaled by 1/h^2."""
    h = 1.0 / (m + 1)
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    eye = sp.identity(m)
    return ((sp.kron(eye, T) + sp.kron(T, eye)) / h**2).tocsr()


def source(m: int, params: np.ndarray) -> np.ndarray:
    """Right-hand side: a Gaussian bump at (cx, cy) of width w."""
    cx, cy, w = params
    s = np.linspace(0.0, 1.0, m + 2)[1:-1]
    X, Y = np.meshgrid(s, s, indexing="ij")
    return np.exp(-((X - cx) ** 2 + (Y - cy) ** 2) / (2.0 * w**2)).ravel()


def all_params(count: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.column_stack([rng.uniform(0.25, 0.75, count), rng.uniform(0.25, 0.75, count),
                            rng.uniform(0.05, 0.2, count)])


def setup() -> tuple[int, int, str]:
    """(rank, world size, device) from torchrun's environment; one process without it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    # Every rank must agree on the backend: GPUs only when each local rank gets one
    # of the CUDA devices the DeviceManager manages (MANAGED_SOLVE_DEVICES=cpu keeps
    # the run on the CPU on a GPU machine).
    cuda = [d for d in default_manager().accelerators if d.kind == "cuda"]
    use_gpu = len(cuda) >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = f"cuda:{local}" if use_gpu else "cpu"
    if use_gpu:
        torch.cuda.set_device(local)
        _backend.cupy().cuda.Device(local).use()
    if world > 1:
        dist.init_process_group("nccl" if use_gpu else "gloo")
    return rank, world, device


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="small grids and few systems (test suite)")
    p.add_argument("--systems", type=int, default=None, help="systems in all (a multiple of the ranks)")
    p.add_argument("--epochs", type=int, default=None)
    args = p.parse_args(argv)
    m = 12 if args.small else 96
    count = args.systems or (16 if args.small else 512)
    epochs = args.epochs or (60 if args.small else 500)
    rank, world, device = setup()
    if count % world:
        raise ValueError(f"--systems={count} must be a multiple of the {world} ranks (equal shares)")

    # Solve this rank's share on its device; to_torch() shares x's memory there.
    A = poisson_2d(m)
    params = all_params(count)
    mine = range(rank, count, world)
    solutions = []
    for i in mine:
        res = solve(A, source(m, params[i]), rtol=1e-10, method="cg", device=device)
        res.raise_for_status()
        solutions.append(res.to_torch())
    U = torch.stack(solutions)  # on `device`
    P = torch.as_tensor(params[list(mine)], device=U.device)

    # One scale for all ranks, so every rank trains on the same targets.
    scale = U.abs().max().reshape(1)
    if world > 1:
        dist.all_reduce(scale, op=dist.ReduceOp.MAX)
    U = U / scale

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, m * m)).double().to(U.device)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)

    def global_loss() -> float:
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(model(P), U).reshape(1)
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        return float(loss)  # sync: reads the loss on the host (once per report)

    first = global_loss()
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(P), U).backward()  # DDP averages gradients over ranks
        opt.step()
    last = global_loss()
    if rank == 0:
        print(f"ranks={world} device={device} systems={count} grid={m}x{m} epochs={epochs}")
        print(f"initial_loss={first:.10e}")
        print(f"final_loss={last:.10e}")
    if world > 1:
        # Tear down in order while the interpreter is fully alive. DDP's reducer
        # holds the process group and its last gradient work; DDP sits in a
        # reference cycle (its hooks), so without the explicit release it is
        # freed only at interpreter shutdown, where gloo's threads can abort the
        # process ("terminate called without an active exception"). The barrier
        # keeps a rank that finishes first from closing its gloo pairs while
        # another still uses them.
        del net, opt
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return last


if __name__ == "__main__":
    main()
