"""Solve many heat problems, then train a surrogate on each device's share, where the data lie.

1. ``solve_many`` solves backward-Euler heat steps ``(M + dt L) u = M u0`` on
   a sphere for many ``dt``, dispersed over every device.
2. Each solution goes to torch with ``SolveResult.to_torch()``: zero-copy, on
   the device it was solved on (no trip through the host).
3. On each device, a small network learns ``(log dt, x, y, z) -> u`` from the
   solutions that device holds, and is tested on ``dt`` values it never saw
   (solved the same way).

Run: ``python examples/surrogate_training.py [--small] [--simulate 2x1GiB]``;
prints ``test_rel_error=...`` (relative L2 error on held-out dt, all devices).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict

import numpy as np

import managed_solve as ms


def make_systems(mesh, dts):
    v = mesh.vertices
    u0 = np.cos(3.0 * v[:, 2]) + v[:, 0]
    return [ms.pde.heat_step(mesh, u0, dt=float(dt), device="cpu") for dt in dts]


def features(torch, coords, dt, device):
    """(n, 4) inputs for one dt: log10(dt) and the vertex coordinates, on ``device``."""
    c = torch.tensor(coords, dtype=torch.float32, device=device)
    ld = torch.full((c.shape[0], 1), float(np.log10(dt)), dtype=torch.float32, device=device)
    return torch.cat([ld, c], dim=1)


def train_on_share(torch, share, coords, epochs, seed):
    """Train one surrogate on the (dt, solution tensor) pairs a device holds."""
    device = share[0][1].device  # where the solutions lie: train there
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                              torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    X = torch.cat([features(torch, coords, dt, device) for dt, _ in share])
    Y = torch.cat([u.to(torch.float32) for _, u in share]).unsqueeze(1)  # no host copy
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(epochs):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(X), Y)
        loss.backward()
        opt.step()
    return net, float(loss.detach())


def run(subdivisions=3, n_train=24, n_test=4, epochs=300, manager=None):
    torch = ms._backend.torch_module()
    mesh = ms.mesh.icosphere(subdivisions)
    rng = np.random.default_rng(0)
    train_dt = np.sort(10 ** rng.uniform(-3, -1, n_train))
    test_dt = 10 ** rng.uniform(-2.8, -1.2, n_test)
    results = ms.solve_many(make_systems(mesh, train_dt), disperse=True, manager=manager)
    shares = defaultdict(list)
    for dt, r in zip(train_dt, results, strict=True):
        r.raise_for_status()
        t = r.to_torch()  # shares memory with r.x, on r's device
        shares[r.device].append((dt, t))
    models = {}

    def work(dev, share, seed):
        models[dev] = train_on_share(torch, share, mesh.vertices, epochs, seed)

    threads = [threading.Thread(target=work, args=(dev, share, i))
               for i, (dev, share) in enumerate(sorted(shares.items()))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()

    tests = ms.solve_many(make_systems(mesh, test_dt), manager=manager)
    errs = []
    for dt, r in zip(test_dt, tests, strict=True):
        u = r.raise_for_status().to_torch()
        for net, _loss in models.values():
            dev = next(net.parameters()).device
            with torch.no_grad():
                pred = net(features(torch, mesh.vertices, dt, dev)).squeeze(1)
            ref = u.to(dev, torch.float32)
            errs.append(float(torch.linalg.norm(pred - ref) / torch.linalg.norm(ref)))
    return float(np.mean(errs)), {d: loss for d, (_n, loss) in models.items()}


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a quick run (tests)")
    p.add_argument("--simulate", default=None, help="simulated GPUs, e.g. 2x1GiB")
    args = p.parse_args(argv)
    manager = ms.DeviceManager(simulate=args.simulate) if args.simulate else None
    kw = dict(subdivisions=2, n_train=12, n_test=3, epochs=150) if args.small else {}
    t0 = time.perf_counter()
    err, losses = run(manager=manager, **kw)
    for dev, loss in sorted(losses.items()):
        print(f"model on {dev}: final training loss {loss:.2e}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    print(f"test_rel_error={err:.4f}")
    return err


if __name__ == "__main__":
    main()
