"""The same job as ``pde_solve_simple.py``, with managed-solve and ``disperse=True``.

Neighbours and the cotangent Laplacian come from the assembly kernels (CUDA on
a GPU, Numba on the CPU; the sparsity pattern is found once per mesh and reused
for every ``dt``), and one ``solve_many`` call spreads the systems over every
device, batched, each system to its own tolerance.

Run: ``python examples/pde_solve_managed.py [--small] [--simulate 2x1GiB]``;
prints ``checksum=...``, equal to ``pde_solve_simple.py``'s to solver tolerance.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

import managed_solve as ms


def run(subdivisions: int, n_systems: int, rtol: float = 1e-10, manager=None) -> tuple[float, list]:
    mesh = ms.mesh.icosphere(subdivisions)
    v = mesh.vertices
    u0 = np.cos(3.0 * v[:, 2]) + v[:, 0]
    systems = [ms.pde.heat_step(mesh, u0, dt=float(dt), rtol=rtol, device="cpu")
               for dt in np.geomspace(1e-3, 1e-1, n_systems)]
    results = ms.solve_many(systems, disperse=True, manager=manager)
    mass = ms.pde.mass(mesh, device="cpu").A.diagonal()
    checksum = 0.0
    for r in results:
        r.raise_for_status()
        x = r.to_numpy()
        checksum += math.sqrt(float(x @ (mass * x)))
    return checksum, results


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a quick run (tests)")
    p.add_argument("--simulate", default=None, help="simulated GPUs, e.g. 2x1GiB")
    args = p.parse_args(argv)
    sub, k = (2, 4) if args.small else (5, 16)
    manager = ms.DeviceManager(simulate=args.simulate) if args.simulate else None
    t0 = time.perf_counter()
    checksum, results = run(sub, k, manager=manager)
    where = sorted({r.device for r in results})
    print(f"{k} systems on icosphere({sub}) in {time.perf_counter() - t0:.2f} s on {', '.join(where)}")
    print(f"checksum={checksum:.10f}")
    return checksum


if __name__ == "__main__":
    main()
