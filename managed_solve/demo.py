"""The main job (`managed-solve demo`): a PDE sweep on a surface, solved on every device.

A tessellated surface (an icosphere at three resolutions by default, or the
user's mesh), a sweep of heat steps and screened Poisson problems on it, one
``solve_many`` over every device present, then a device table, throughput,
the largest relative residual, a comparison with the naive loop, and a
picture of one solution.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from . import _backend
from .devices import format_bytes


def _meshes(args):
    from . import mesh as ms_mesh

    if args.mesh:
        if not os.path.exists(args.mesh):
            raise FileNotFoundError(f"--mesh {args.mesh}: no such file")
        return [ms_mesh.read(args.mesh)]
    levels = (2, 3) if args.small else (3, 4, 5)
    return [ms_mesh.icosphere(k) for k in levels]


def build_sweep(meshes, n_systems: int):
    """Heat steps and screened Poisson problems of varying parameters and sizes."""
    from . import pde

    systems, labels = [], []
    per_mesh = max(2, n_systems // len(meshes))
    for m in meshes:
        v = m.vertices
        u0 = np.cos(3.0 * v[:, 2]) + v[:, 0]
        f = v[:, 0] * v[:, 1] + 0.5 * v[:, 2]
        half = per_mesh // 2
        for dt in np.geomspace(1e-4, 1e-1, max(1, half)):
            systems.append(pde.heat_step(m, u0, dt=float(dt)))
            labels.append(f"heat dt={dt:.2g} n={m.n_vertices}")
        for alpha in np.geomspace(0.1, 100.0, max(1, per_mesh - half)):
            systems.append(pde.screened_poisson(m, f, alpha=float(alpha)))
            labels.append(f"screened alpha={alpha:.2g} n={m.n_vertices}")
    return systems[:n_systems] if len(systems) > n_systems else systems, labels


def _naive_loop(systems):
    """What users write today: one solver call per system on one device."""
    t0 = time.perf_counter()
    if _backend.cuda_usable():
        cp = _backend.cupy()
        import cupyx.scipy.sparse as csp
        import cupyx.scipy.sparse.linalg as cla

        for s in systems:
            A = csp.csr_matrix(_backend.to_host(s.A))
            cla.cg(A, cp.asarray(_backend.to_host(s.b)), rtol=s.rtol, maxiter=10 * s.n)
        cp.cuda.Device().synchronize()
        where = "cupyx cg loop on cuda:0"
    else:
        import scipy.sparse.linalg as sla

        for s in systems:
            sla.cg(_backend.to_host(s.A), _backend.to_host(s.b), rtol=s.rtol, maxiter=10 * s.n)
        where = "scipy cg loop on the CPU"
    return time.perf_counter() - t0, where


def _picture(mesh, x, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if mesh.faces.shape[1] != 3:
        return False
    from mpl_toolkits.mplot3d.art3d import Poly3DCollection

    v = mesh.vertices
    face_vals = np.asarray(x)[mesh.faces].mean(axis=1)
    norm = matplotlib.colors.Normalize(face_vals.min(), face_vals.max())
    cmap = matplotlib.colormaps["viridis"]
    fig = plt.figure(figsize=(6, 6))
    ax = fig.add_subplot(111, projection="3d")
    # Facecolors computed here (not set_array on plot_trisurf, whose depth sort
    # can reorder faces against the values).
    ax.add_collection3d(Poly3DCollection(v[mesh.faces], facecolors=cmap(norm(face_vals)),
                                         edgecolor="none"))
    lo, hi = v.min(axis=0), v.max(axis=0)
    ax.set_xlim(lo[0], hi[0])
    ax.set_ylim(lo[1], hi[1])
    ax.set_zlim(lo[2], hi[2])
    fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=0.6, label="u")
    ax.set_title("managed-solve demo: one solution of the sweep")
    ax.set_box_aspect((1, 1, 1))
    ax.set_axis_off()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True


def main(args: argparse.Namespace) -> int:
    from ._solve_many import solve_many
    from .manager import DeviceManager

    n_systems = args.systems if args.systems is not None else (12 if args.small else 60)
    if n_systems < 1:
        raise ValueError(f"--systems {n_systems}: give at least 1 system")
    devices = [args.device] if args.device else None
    if args.device and args.device != "cpu":
        devices = [args.device, "cpu"]
    try:
        manager = DeviceManager(devices=devices, simulate=args.simulate)
    except ValueError as exc:
        flag = f"--device {args.device}" if args.device else f"--simulate {args.simulate}"
        raise ValueError(f"{flag}: {exc}") from None
    print("managed-solve demo")
    print(manager.report())
    print()

    t0 = time.perf_counter()
    meshes = _meshes(args)
    systems, labels = build_sweep(meshes, n_systems)
    t_build = time.perf_counter() - t0
    n_unknowns = sum(s.n for s in systems)
    print(f"{len(systems)} systems on {len(meshes)} mesh(es), {n_unknowns:,} unknowns in all "
          f"(assembled in {t_build:.2f} s)")

    t0 = time.perf_counter()
    results = solve_many(systems, disperse=True, progress=True, manager=manager)
    for r in results:  # results stay on their devices; wait for all of them
        if r.x is not None and _backend.is_cupy_array(r.x):
            _backend.synchronize(r.x.device.id)
    t_solve = time.perf_counter() - t0

    rows = {}
    counted = set()  # systems of one batch share its time: count each batch once
    for k, r in enumerate(results):
        row = rows.setdefault(r.device, [0, 0.0, 0])
        row[0] += 1
        key = (r.device, r.info.get("batch", ("alone", k)))
        if key not in counted:
            counted.add(key)
            row[1] += r.seconds
        row[2] += r.x.size if r.x is not None else 0
    print()
    print(f"{'device':8s} {'name':28s} {'memory':>10s} {'systems':>8s} {'busy s':>8s}")
    for dev, (count, busy, _n) in sorted(rows.items()):
        d = manager.get_device(dev)
        print(f"{dev:8s} {d.name[:28]:28s} {format_bytes(d.total_bytes):>10s} {count:8d} {busy:8.2f}")
    worst = max(r.relative_residual for r in results)
    failed = [lab for lab, r in zip(labels, results, strict=False) if not r.converged]
    print(f"\nsolved {len(results)} systems in {t_solve:.2f} s: {len(results) / t_solve:.1f} systems/s, "
          f"{n_unknowns / t_solve / 1e6:.2f} M unknowns/s")
    print(f"largest relative residual: {worst:.2e}" + (f"; not converged: {failed}" if failed else ""))

    # A sample across the sweep (every k-th system), so sizes and parameters mix as in the whole.
    k = max(1, len(systems) // (6 if args.small else 10))
    subset = systems[::k]
    t_naive, where = _naive_loop(subset)
    per_naive = t_naive / len(subset)
    estimate = per_naive * len(systems)
    print(f"naive way ({where}): {len(subset)} systems in {t_naive:.2f} s, "
          f"about {estimate:.2f} s for all {len(systems)}; speed-up {estimate / t_solve:.1f}x")

    out = args.out or os.path.join(os.getcwd(), "managed_solve_demo.png")
    pick = max(range(len(results)), key=lambda i: results[i].x.size if results[i].x is not None else -1)
    mesh_for = next(m for m in meshes if m.n_vertices == results[pick].x.size)
    if _picture(mesh_for, results[pick].to_numpy(), out):
        print(f"picture of '{labels[pick]}' written to {out}")
    else:
        print("picture skipped: matplotlib is not installed (pip install \"managed-solve[plot]\")")
    return 0 if not failed else 1
