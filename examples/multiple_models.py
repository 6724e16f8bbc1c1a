"""Many small models trained at once from a thread pool, spread over the GPUs by the manager.

The bridgesign/managed prototype's second scenario, done properly: each of
16 or more regression models (different data conditioning, learning rate and
tolerance, so they converge after very different numbers of steps) reserves
its bytes with the DeviceManager for the time it trains (``disperse=True``:
the device with the earliest predicted finish), trains there, and releases
them. Every model's result must equal the same training run on one device,
whatever device it landed on and whatever ran beside it.

Run: ``python examples/multiple_models.py [--small] [--models 16] [--simulate 2x1GiB]``;
prints the placement per device, then ``max_param_diff=...`` (largest
difference of any trained parameter from the one-device reference run).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from managed_solve import _backend
from managed_solve.manager import DeviceManager
from managed_solve.module import ManagedModule
from managed_solve.tensor import managed


@dataclass
class Task:
    index: int
    n: int        # samples
    d: int        # features
    hidden: int
    lr: float
    tol: float
    max_steps: int


@dataclass
class Outcome:
    index: int
    device: str
    steps: int
    loss: float
    params: list  # CPU tensors


def make_tasks(count: int, small: bool) -> list[Task]:
    n, d, hidden = (64, 4, 8) if small else (4096, 32, 256)
    return [Task(i, n, d, hidden, lr=0.05 * (1 + i % 4), tol=10.0 ** -(1.0 + 0.15 * (i % 7)),
                 max_steps=150 if small else 2000) for i in range(count)]


def make_data(task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + task.index)
    # Feature scales differ per model (conditioning), so convergence speed differs.
    scale = torch.logspace(0.0, -0.5 * (task.index % 5), task.d, dtype=torch.float64)
    X = torch.randn(task.n, task.d, dtype=torch.float64, generator=g) * scale
    w = torch.randn(task.d, 1, dtype=torch.float64, generator=g)
    y = torch.tanh(X @ w) + 0.01 * torch.randn(task.n, 1, dtype=torch.float64, generator=g)
    return X, y


def make_model(task: Task) -> torch.nn.Module:
    torch.manual_seed(task.index)  # process-global RNG: callers hold _model_lock
    return torch.nn.Sequential(torch.nn.Linear(task.d, task.hidden), torch.nn.Tanh(),
                               torch.nn.Linear(task.hidden, 1)).double()


def train(task: Task, model: torch.nn.Module, X, y, device: str) -> Outcome:
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.5)
    loss_value = float("inf")
    steps = 0
    while steps < task.max_steps:
        steps += 1
        loss = torch.nn.functional.mse_loss(model(X), y)
        loss_value = float(loss.detach())  # sync: reads the loss on the host to test convergence
        if loss_value < task.tol:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = [p.detach().as_subclass(torch.Tensor).cpu().clone() for p in model.parameters()]
    return Outcome(task.index, device, steps, loss_value, params)


_model_lock = __import__("threading").Lock()


def run_managed(task: Task, dm: DeviceManager) -> Outcome:
    """Reserve the model's bytes (parameters, gradients, data) where the manager says, train there."""
    with _model_lock:  # torch.manual_seed is process-global
        model = ManagedModule.from_module(make_model(task), manager=dm)
    X, y = make_data(task)
    nbytes = dm.size_of(model) + dm.size_of([X, y])
    with dm.reserve(nbytes, disperse=True, cost=float(task.max_steps * nbytes)) as r:
        dev = str(r.device)
        model.to(dev)
        Xd, yd = managed(X, manager=dm).to(dev), managed(y, manager=dm).to(dev)
        return train(task, model, Xd, yd, dev)


def run_reference(task: Task, device: str) -> Outcome:
    """The same training with plain tensors on one device, one model at a time."""
    with _model_lock:
        model = make_model(task)
    X, y = make_data(task)
    dev = _torch_device(device)
    model = model.to(dev)
    return train(task, model, X.to(dev), y.to(dev), device)


def _torch_device(name: str) -> str:
    return "cpu" if name.startswith("sim") else name


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="small models (for the test suite)")
    p.add_argument("--models", type=int, default=16)
    p.add_argument("--workers", type=int, default=4, help="threads training at once")
    p.add_argument("--simulate", default=None, help="simulated GPUs, e.g. 2x1GiB")
    args = p.parse_args(argv)
    simulate = args.simulate
    if simulate is None and _backend.cuda_probe()[0] == 0:
        simulate = "2x1GiB"
        print("no usable GPU: two simulated GPUs (sim:0, sim:1) on the CPU")
    dm = DeviceManager(simulate=simulate) if simulate else DeviceManager()
    tasks = make_tasks(args.models, args.small)

    ref_device = str((dm.accelerators or [dm.cpu])[0])
    t0 = time.perf_counter()
    reference = [run_reference(t, ref_device) for t in tasks]
    t_ref = time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        managed_runs = list(pool.map(lambda t: run_managed(t, dm), tasks))
    t_managed = time.perf_counter() - t0

    counts = Counter(o.device for o in managed_runs)
    print("placement: " + " ".join(f"{d}={counts[d]}" for d in sorted(counts)))
    print(f"steps per model: {[o.steps for o in managed_runs]}")
    print(f"managed, {args.workers} threads: {t_managed:.2f} s; one device, sequential: {t_ref:.2f} s")
    diff = 0.0
    for o, r in zip(managed_runs, reference, strict=True):
        if o.steps != r.steps:
            print(f"model {o.index}: {o.steps} steps on {o.device} vs {r.steps} on {ref_device}")
            diff = float("inf")
        for a, b in zip(o.params, r.params, strict=True):
            diff = max(diff, float((a - b).abs().max()))
    print(f"max_param_diff={diff:.3e}")
    return diff


if __name__ == "__main__":
    main()
