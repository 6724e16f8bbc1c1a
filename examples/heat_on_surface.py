"""Heat flow on a torus: many backward-Euler steps, the pattern assembled once.

The first step builds the CSR pattern (the symbolic phase, cached on the mesh);
every later step only re-solves with a new right-hand side, warm-started from
the previous solution. Backward Euler with a lumped mass conserves the total
heat ``sum(M u)`` exactly, and the temperature spreads towards its mean: the
example checks both and prints ``heat_drift=...`` (relative change of the
total heat, at solver tolerance).

Run: ``python examples/heat_on_surface.py [--small] [--out heat.png]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import managed_solve as ms


def run(nu: int, nv: int, steps: int, dt: float, device=None):
    mesh = ms.mesh.torus(1.0, 0.4, nu=nu, nv=nv)
    v = mesh.vertices
    u = np.exp(-20.0 * ((v[:, 0] - 1.4) ** 2 + v[:, 1] ** 2 + v[:, 2] ** 2))  # a hot spot
    mass = ms.pde.mass(mesh, device="cpu").A.diagonal()
    heat0 = float(mass @ u)
    spread = [float(u.max() - u.min())]
    iters = []
    for _ in range(steps):
        system = ms.pde.heat_step(mesh, u, dt=dt, rtol=1e-12, device=device or "cpu")
        res = ms.solve(system).raise_for_status()
        u = res.to_numpy()
        iters.append(res.iterations)
        spread.append(float(u.max() - u.min()))
    drift = abs(float(mass @ u) - heat0) / heat0
    return mesh, u, drift, spread, iters


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a quick run (tests)")
    p.add_argument("--out", default=None, help="write a picture of the final state (PNG)")
    args = p.parse_args(argv)
    nu, nv, steps = (24, 12, 5) if args.small else (192, 96, 50)
    t0 = time.perf_counter()
    mesh, u, drift, spread, iters = run(nu, nv, steps, dt=0.01)
    assert all(b <= a + 1e-12 for a, b in zip(spread, spread[1:], strict=False)), "heat must spread"
    print(f"{steps} steps on a torus of {mesh.n_vertices} vertices in {time.perf_counter() - t0:.2f} s "
          f"(iterations per step: {min(iters)}..{max(iters)})")
    if args.out:
        from managed_solve.demo import _picture

        if _picture(mesh, u, args.out):
            print(f"picture written to {args.out}")
    print(f"heat_drift={drift:.3e}")
    return drift


if __name__ == "__main__":
    main()
