"""The main job (`managed-solve demo`): a PDE sweep on a surface, solved on every device.

A tessellated surface (an icosphere at three resolutions by default, or the
user's mesh), a sweep of heat steps and screened Poisson problems on it, one
``solve_many`` over every device present, then:

- what the first run compiled (Numba kernels; on a GPU the batched CUDA modules
  and CuPy's kernels; all cached on disk afterwards) and
  how long that took, apart from the solve;
- the solve time (median of ``--repeat`` runs) against the loop a user would
  write without this package, timed on the same systems the same number of
  times: SciPy's ``cg`` on the CPU, or cupyx's ``cg`` on the first GPU when
  there is one; printed as "N.Nx faster" or "N.Nx slower";
- a device table, the largest relative residual, and a picture (two hot
  spots on the surface, then after one implicit heat step).

``--json`` prints one JSON object (the same figures) on stdout and the text
on stderr, for scripts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import numpy as np

from . import _backend
from ._warmup import compiled_since, cupy_cache_dir, jit_snapshot
from .config import ENV_DEVICES, ENV_SIMULATE, environment
from .devices import format_bytes


def _meshes(args):
    from . import mesh as ms_mesh

    if args.mesh:
        if not os.path.exists(args.mesh):
            raise FileNotFoundError(f"--mesh {args.mesh}: no such file")
        return [ms_mesh.read(args.mesh)]
    levels = (2, 3) if args.small else (3, 4, 5)
    return [ms_mesh.icosphere(k) for k in levels]


def hot_spots(vertices: np.ndarray) -> np.ndarray:
    """Two Gaussian hot spots on the surface: a picture in which diffusion is visible."""
    v = vertices - vertices.mean(axis=0)
    radius = float(np.sqrt((v ** 2).sum(axis=1).max())) or 1.0
    centres = np.array([[0.95, 0.0, 0.3], [0.35, -0.9, -0.25]])
    centres = radius * centres / np.linalg.norm(centres, axis=1)[:, None]
    width = 0.25 * radius
    return sum(np.exp(-((v - c) ** 2).sum(axis=1) / (2 * width ** 2)) for c in centres)


def build_sweep(meshes, n_systems: int):
    """Heat steps and screened Poisson problems of varying parameters and sizes."""
    from . import pde

    systems, labels = [], []
    per_mesh = max(2, n_systems // len(meshes))
    for m in meshes:
        v = m.vertices
        u0 = hot_spots(v)
        f = v[:, 0] * v[:, 1] + 0.5 * v[:, 2]
        half = per_mesh // 2
        for dt in np.geomspace(1e-3, 3e-2, max(1, half)):
            systems.append(pde.heat_step(m, u0, dt=float(dt)))
            labels.append(f"heat dt={dt:.2g} n={m.n_vertices}")
        for alpha in np.geomspace(0.1, 100.0, max(1, per_mesh - half)):
            systems.append(pde.screened_poisson(m, f, alpha=float(alpha)))
            labels.append(f"screened alpha={alpha:.2g} n={m.n_vertices}")
    if len(systems) > n_systems:
        systems, labels = systems[:n_systems], labels[:n_systems]
    return systems, labels


# ------------------------------------------------------------------ compilation
def _cuda_modules() -> list[str]:
    """The batched core's CUDA modules this process has (none without a GPU)."""
    if "managed_solve.solvers.batched.cuda" not in sys.modules:
        return []
    from .solvers.batched import cuda

    return cuda.loaded_modules()


def _count_files(path: str) -> int:
    return sum(len(f) for _, _, f in os.walk(path)) if os.path.isdir(path) else 0


def _names(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


# ------------------------------------------------------------------ timing
def _solve_once(systems, manager):
    from ._solve_many import solve_many

    t0 = time.perf_counter()
    results = solve_many(systems, disperse=True, manager=manager)
    for r in results:  # results stay on their devices; wait for all of them
        if r.x is not None and _backend.is_cupy_array(r.x):
            _backend.synchronize(r.x.device.id)
    return time.perf_counter() - t0, results


def _naive_loop(systems, gpu: bool):
    """The loop a user writes without this package: one CG call per system on one device.

    Returns (one run's callable, a description). On a GPU each run copies the
    matrices and right-hand sides to the device, as the user's loop would
    (``solve_many`` copies them too).
    """
    mats = [(_backend.to_host(s.A).tocsr(), np.asarray(_backend.to_host(s.b)), s.rtol, s.n)
            for s in systems]
    if gpu:
        cp = _backend.cupy()
        import cupyx.scipy.sparse as csp
        import cupyx.scipy.sparse.linalg as cla

        def run():
            for A, b, rtol, n in mats:
                cla.cg(csp.csr_matrix(A), cp.asarray(b), rtol=rtol, maxiter=10 * n)
            cp.cuda.Device().synchronize()

        return run, "a loop of cupyx.scipy.sparse.linalg.cg on cuda:0"

    import scipy.sparse.linalg as sla

    def run():
        for A, b, rtol, n in mats:
            sla.cg(A, b, rtol=rtol, maxiter=10 * n)

    return run, "a loop of scipy.sparse.linalg.cg on the CPU"


def _timed(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def speedup_text(ours: float, naive: float) -> str:
    """``"3.1x faster"`` or ``"1.4x slower"``: ours against the naive time.

    Examples
    --------
    >>> speedup_text(1.0, 3.14)
    '3.1x faster'
    >>> speedup_text(2.0, 1.0)
    '2.0x slower'
    """
    if ours <= naive:
        return f"{naive / ours:.1f}x faster" if ours > 0 else "faster"
    return f"{ours / naive:.1f}x slower"


# ------------------------------------------------------------------ picture
def picture(mesh, panels, path: str, *, label: str = "u") -> bool:
    """Draw ``panels`` (a list of (vertex values, title)) side by side on ``mesh``, as a PNG.

    A tetrahedral mesh is drawn by its boundary surface (the values seen
    from outside). Returns False (nothing written) only without matplotlib.
    One colour scale for all panels, so they compare.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from mpl_toolkits.mplot3d.art3d import Poly3DCollection

    v = mesh.vertices
    faces = mesh.faces if mesh.kind == "triangle" else mesh.boundary_faces()
    panels = [(np.asarray(vals), title) for vals, title in panels]
    lo_val = float(min(0.0, *(p.min() for p, _ in panels)))
    norm = matplotlib.colors.Normalize(lo_val, float(max(p.max() for p, _ in panels)))
    cmap = matplotlib.colormaps["inferno"]
    fig = plt.figure(figsize=(5 * len(panels), 5))
    lo, hi = v.min(axis=0), v.max(axis=0)
    for i, (vals, title) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1, projection="3d")
        # Face colours computed here (not set_array on plot_trisurf, whose depth
        # sort can reorder faces against the values).
        face_vals = vals[faces].mean(axis=1)
        ax.add_collection3d(Poly3DCollection(v[faces], facecolors=cmap(norm(face_vals)),
                                             edgecolor="none"))
        ax.set_xlim(lo[0], hi[0])
        ax.set_ylim(lo[1], hi[1])
        ax.set_zlim(lo[2], hi[2])
        ax.view_init(elev=20, azim=-30)
        ax.set_box_aspect((1, 1, 1))
        ax.set_axis_off()
        ax.set_title(title)
    fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=fig.axes, shrink=0.6,
                 label=label)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True


# ------------------------------------------------------------------ main
def _manager(args):
    from .devices import parse_device_name, parse_simulate
    from .manager import DeviceManager

    if args.simulate is not None:
        try:
            parse_simulate(args.simulate, var="simulate")
        except ValueError as exc:
            raise ValueError(f"--simulate {args.simulate}: {exc}") from None
    devices = None
    if args.device:
        try:
            kind, index = parse_device_name(args.device.strip(), what="--device")
        except ValueError:
            raise ValueError(f"--device {args.device}: not a device name; give cpu, cuda:0, "
                             "cuda:1, ... (or sim:0, ... with --simulate)") from None
        name = "cpu" if kind == "cpu" else f"{kind}:{index}"
        # The CPU comes along as the spill target; the user named one device.
        devices = [name] if kind == "cpu" else [name, "cpu"]
    try:
        manager = DeviceManager(devices=devices, simulate=args.simulate)
    except ValueError as exc:
        text = str(exc)
        # A value from the environment is named by the message itself; an option is named here.
        if ENV_DEVICES in text or ENV_SIMULATE in text or devices is None:
            raise
        raise ValueError(f"--device {args.device}: {_missing(devices[0], args.simulate)}") from None
    return manager


def _missing(name: str, simulate: str | None) -> str:
    """Why the device ``name`` is not here, and what is: a machine's inventory before any selection."""
    from .devices import cpu_device, discover_cuda, inventory_mode, parse_simulate

    spec = simulate if simulate is not None else environment(ENV_SIMULATE)
    accel, why = (parse_simulate(spec), "") if spec else discover_cuda()
    have = [*accel, cpu_device()]
    names = ", ".join(str(d) for d in have)
    return (f"this machine has no {name} ({inventory_mode(have)} mode: {names}"
            + (f"; {why}" if why and not accel else "") + f"). Give one of {names}, or leave "
            "--device out to use every device.")


def main(args: argparse.Namespace) -> int:
    import managed_solve

    repeat = getattr(args, "repeat", 3)
    as_json = bool(getattr(args, "json", False))
    n_systems = args.systems if args.systems is not None else (12 if args.small else 60)
    if n_systems < 1:
        raise ValueError(f"--systems {n_systems}: give at least 1 system")
    if repeat < 1:
        raise ValueError(f"--repeat {repeat}: give at least 1 run")
    manager = _manager(args)
    stream = sys.stderr if as_json else sys.stdout

    def say(text: str = "") -> None:
        print(text, file=stream, flush=True)

    gpu = any(d.is_cuda for d in manager.devices) and _backend.cuda_usable()
    say(f"managed-solve {managed_solve.__version__} demo")
    say("devices: " + "; ".join(f"{d} ({d.name}, {format_bytes(d.total_bytes)})"
                                for d in manager.devices))

    jit_before = jit_snapshot()
    cuda_before = set(_cuda_modules())
    cupy_files = _count_files(cupy_cache_dir()) if gpu else 0
    t0 = time.perf_counter()
    meshes = _meshes(args)
    build_sweep(meshes, n_systems)  # the first assembly compiles its kernels
    t_build_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    systems, labels = build_sweep(meshes, n_systems)
    t_build = time.perf_counter() - t0
    n_unknowns = sum(s.n for s in systems)
    say(f"{len(systems)} systems on {len(meshes)} mesh(es), {n_unknowns:,} unknowns in all "
        f"(assembled in {t_build:.2f} s)")

    # The first run pays for compilation; it is timed apart, then `repeat` runs are timed.
    t_first, results = _solve_once(systems, manager)
    times = []
    for _ in range(repeat):
        t, results = _solve_once(systems, manager)
        times.append(t)
    t_ours = statistics.median(times)
    first = compiled_since(jit_before)
    first["seconds"] = max(0.0, t_build_first - t_build) + max(0.0, t_first - t_ours)
    first["cuda_modules"] = sorted(set(_cuda_modules()) - cuda_before)
    if gpu:
        first["cupy_cache_new_files"] = _count_files(cupy_cache_dir()) - cupy_files
    if first["compiled"]:
        what = f"compiled {len(first['compiled'])} Numba kernels ({_names(first['compiled'])})"
        if first["loaded_from_cache"]:
            what += f" and loaded {len(first['loaded_from_cache'])} from Numba's cache"
    else:
        what = f"nothing to compile in Numba (loaded {len(first['loaded_from_cache'])} kernels " \
            "from its cache)"
    if first["cuda_modules"]:
        fresh = first.get("cupy_cache_new_files", 0) > 0
        what += (f"; {'compiled' if fresh else 'loaded from CuPy cache'} "
                 f"{len(first['cuda_modules'])} CUDA modules ({_names(first['cuda_modules'])})")
        if fresh:
            what += " and CuPy's kernels"
    say(f"first run: {what}: about {first['seconds']:.1f} s on top of the work, not counted in "
        "the times below. The disk caches keep them (Numba's"
        + (", and CuPy's in " + cupy_cache_dir() if gpu else "")
        + "): later runs load them. `managed-solve warmup` does this ahead of need.")
    say("solve_many runs: " + ", ".join(f"{t:.3f} s" for t in times))

    rows: dict = {}
    counted = set()  # systems of one batch share its time: count each batch once
    for k, r in enumerate(results):
        row = rows.setdefault(r.device, [0, 0.0])
        row[0] += 1
        key = (r.device, r.info.get("batch", ("alone", k)))
        if key not in counted:
            counted.add(key)
            row[1] += r.seconds
    methods = collections.Counter(r.method or "?" for r in results)
    say()
    say(f"{'device':8s} {'name':28s} {'memory':>10s} {'systems':>8s} {'busy s':>8s}")
    for dev, (count, busy) in sorted(rows.items()):
        d = manager.get_device(dev)
        say(f"{dev:8s} {d.name[:28]:28s} {format_bytes(d.total_bytes):>10s} {count:8d} {busy:8.3f}")
    worst = max(r.relative_residual for r in results)
    failed = [lab for lab, r in zip(labels, results, strict=True) if not r.converged]
    say()
    say(f"solve_many: {len(results)} systems in {t_ours:.3f} s (median of {repeat}): "
        f"{len(results) / t_ours:.1f} systems/s; methods: "
        + ", ".join(f"{m} {c}" for m, c in methods.most_common()))
    say(f"largest relative residual: {worst:.2e}" + (f"; not converged: {failed}" if failed else ""))

    run_naive, where = _naive_loop(systems, gpu)
    if gpu:
        _timed(lambda: _naive_loop(systems[:1], gpu)[0](), 1)  # CuPy's kernels compile once
    naive_times = _timed(run_naive, repeat)
    t_naive = statistics.median(naive_times)
    verdict = speedup_text(t_ours, t_naive)
    say(f"naive way ({where}), same {len(systems)} systems: {t_naive:.3f} s (median of {repeat})")
    say(f"solve_many is {verdict} than the naive way on this machine")

    out = args.out or os.path.join(os.getcwd(), "managed_solve_demo.png")
    heat = [i for i, lab in enumerate(labels) if lab.startswith("heat")]
    picture_path = None
    if heat:
        pick = max(heat, key=lambda i: (systems[i].n, i))  # the largest mesh's latest step
        mesh_for = next((m for m in meshes if m.n_vertices == systems[pick].n), None)
        title = labels[pick].split(" n=")[0].replace("heat dt=", "after one heat step, dt = ")
        if mesh_for is None or results[pick].x is None:
            pass
        elif picture(mesh_for, [(hot_spots(mesh_for.vertices), "t = 0: two hot spots"),
                                (results[pick].to_numpy(), title)], out, label="temperature u"):
            picture_path = out
            say(f"picture of '{labels[pick]}' written to {out}")
        else:
            say("picture skipped: matplotlib is not installed (pip install \"managed-solve[plot]\")")

    if as_json:
        summary = {
            "version": managed_solve.__version__,
            "devices": [str(d) for d in manager.devices],
            "systems": len(systems),
            "unknowns": int(n_unknowns),
            "first_run": first,
            "solve_many": {"median_s": t_ours, "runs_s": times, "methods": dict(methods),
                           "by_device": {dev: {"systems": c, "busy_s": b} for dev, (c, b) in rows.items()}},
            "naive": {"what": where, "median_s": t_naive, "runs_s": naive_times},
            "speedup": t_naive / t_ours if t_ours > 0 else None,
            "verdict": verdict,
            "largest_relative_residual": float(worst),
            "not_converged": failed,
            "picture": picture_path,
        }
        print(json.dumps(summary, indent=1))
    return 0 if not failed else 1
