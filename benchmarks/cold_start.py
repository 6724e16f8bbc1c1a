"""Cold start: what the first ``solve_many`` of a process costs, with empty and with warm caches.

Each figure comes from its own subprocess, so nothing is imported or
compiled beforehand:

(a) ``import managed_solve``, and which heavy optional modules it pulled in;
(b) the first W2-like ``solve_many`` (W2's sizes, one matrix object per
    system, as users have them) with EMPTY compile caches, then the same call
    again in that process (warm);
(c) a fresh process over the caches (b) left (warm disk caches): its first
    call and a warm call;
(d) ``managed-solve warmup`` with empty caches, then a fresh process's first
    call over what it left (a container image or a cluster worker warmed at
    start);
(e) ``managed-solve demo`` (``--small`` with ``--small``) with empty caches:
    its wall time and the speed-up line it prints.

The package's bytecode is compiled first, as pip does when it installs a
package: a source checkout has none (nor does a process under
``PYTHONDONTWRITEBYTECODE``), and every process would compile each module
it imports from source, at import and again for the modules the first call
imports.

Empty caches: ``NUMBA_CACHE_DIR``, ``CUPY_CACHE_DIR`` and ``CUDA_CACHE_PATH``
point at fresh temporary folders. Numba consults ``NUMBA_CACHE_DIR`` before
the ``__pycache__`` folders beside the package's sources (its
``cache=True`` kernels would otherwise be found there), so a child sees no
cached kernel; each child reports how many kernels it loaded from a cache,
and (b) and (e) must report none. What a fresh machine adds and no script
can undo here (files not yet in the page cache, a first CUDA driver start)
comes on top.

    python benchmarks/cold_start.py --device cpu --small
    python benchmarks/cold_start.py --device cuda --json cold.json

Targets (issue: the first call): (c) first minus warm at most 0.5 s; (b) at
most 5 s; (e) on a GPU, faster than the naive loop it prints.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "cupy", "cupyx.scipy.sparse", "ray", "meshio", "pyamg", "matplotlib", "jax",
         "numba", "numba.cuda", "scipy.sparse.linalg", "tqdm")


# ----------------------------------------------------------------------------- children
def _jit_recorder():
    """Seconds each package kernel spent compiling (or loading from Numba's cache), by name."""
    import numba.core.dispatcher as nd

    seconds: dict[str, float] = {}
    depth = [0]
    original = nd.Dispatcher.compile

    def compile(self, sig):
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return original(self, sig)
        finally:
            depth[0] -= 1
            mod = getattr(self.py_func, "__module__", "") or ""
            if depth[0] == 0 and mod.startswith("managed_solve"):
                name = f"{mod.rsplit('.', 1)[-1]}.{self.py_func.__name__}"
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0

    nd.Dispatcher.compile = compile
    return seconds


def _cuda_recorder():
    """Seconds each batched CUDA module took to compile or load, by (family, dtype)."""
    from managed_solve.solvers.batched import cuda

    seconds: dict[str, float] = {}
    original = cuda.compile_module

    def compile_module(device_id, dtype, index_dtype, **kw):
        t0 = time.perf_counter()
        try:
            return original(device_id, dtype, index_dtype, **kw)
        finally:
            seconds[f"{kw.get('family')} {cuda.type_names(dtype, index_dtype)}"] = \
                time.perf_counter() - t0

    cuda.compile_module = compile_module
    return seconds


def _cache_hits() -> int:
    """Kernels of the package this process loaded from Numba's on-disk cache."""
    hits = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("managed_solve") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            stats = getattr(obj, "stats", None)
            if hasattr(obj, "py_func") and stats is not None:
                hits += sum(stats.cache_hits.values())
    return hits


def child_import() -> dict:
    t0 = time.perf_counter()
    import managed_solve  # noqa: F401

    return {"import_s": time.perf_counter() - t0, "imported": [m for m in HEAVY if m in sys.modules]}


def child_solve(device: str, systems: int, warm_rounds: int) -> dict:
    jit = _jit_recorder()
    t0 = time.perf_counter()
    import managed_solve as ms

    t_import = time.perf_counter() - t0
    imported = [m for m in HEAVY if m in sys.modules]
    cuda_s = _cuda_recorder()
    import numpy as np

    sys.path.insert(0, ROOT)
    from tests._problems import poisson2d  # the W2 matrix: 5-point Laplacian, diagonal 4

    # W2's sizes (benchmarks/bench_w2_many.py: w2_sizes), one matrix object per system.
    sizes = [int(m) for m in np.random.default_rng(0).integers(32, 97, size=systems)]
    pairs = [(poisson2d(m), np.ones(m * m)) for m in sizes]
    manager = ms.DeviceManager(["cpu"] if device == "cpu" else ["cuda:0"])

    def call() -> float:
        t = time.perf_counter()
        res = ms.solve_many(pairs, manager=manager)
        if device != "cpu":
            import cupy

            cupy.cuda.runtime.deviceSynchronize()
        assert all(r.converged for r in res), [r.status for r in res if not r.converged][:3]
        return time.perf_counter() - t

    first = call()
    jit_first, cuda_first = dict(jit), dict(cuda_s)
    warm = [call() for _ in range(warm_rounds)]
    return {"import_s": t_import, "imported_at_import": imported, "first_s": first,
            "warm_s": statistics.median(warm), "warm_runs_s": warm,
            "numba_s": jit_first, "cuda_modules_s": cuda_first,
            "numba_loaded_from_cache": _cache_hits(),
            "imported_after_first": [m for m in HEAVY if m in sys.modules]}


# ----------------------------------------------------------------------------- parent
def _run(args: list[str], env: dict, timeout: float = 1800) -> tuple[dict | None, str, float]:
    t0 = time.perf_counter()
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - t0
    out = None
    if p.returncode == 0 or p.stdout.strip().startswith("{"):
        try:
            out = json.loads(p.stdout[p.stdout.index("{"):])
        except ValueError:
            out = None
    if out is None:
        sys.stderr.write(f"command failed ({p.returncode}): {' '.join(args)}\n{p.stdout[-2000:]}\n"
                         f"{p.stderr[-4000:]}\n")
    return out, p.stderr, wall


def _caches(root: str, name: str) -> dict:
    base = os.path.join(root, name)
    dirs = {"NUMBA_CACHE_DIR": os.path.join(base, "numba"), "CUPY_CACHE_DIR": os.path.join(base, "cupy"),
            "CUDA_CACHE_PATH": os.path.join(base, "cuda")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    return dirs


def _files(d: str) -> int:
    return sum(len(f) for _, _, f in os.walk(d))


def _env(caches: dict) -> dict:
    env = dict(os.environ)
    env.update(caches)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def _top(seconds: dict, most: int = 4) -> str:
    items = sorted(seconds.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{k} {v:.2f}" for k, v in items[:most])
    return shown + (f", {len(items) - most} more" if len(items) > most else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--small", action="store_true", help="40 systems and the demo's --small")
    ap.add_argument("--systems", type=int, default=None,
                    help="W2 systems (default 40 with --small, else 120 on cpu, 400 on cuda)")
    ap.add_argument("--warm-rounds", type=int, default=3)
    ap.add_argument("--no-demo", action="store_true", help="skip (e)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    systems = args.systems or (40 if args.small else (120 if args.device == "cpu" else 400))

    if args.child == "import":
        print(json.dumps(child_import()))
        return 0
    if args.child == "solve":
        print(json.dumps(child_solve(args.device, systems, args.warm_rounds)))
        return 0

    compileall.compile_dir(os.path.join(ROOT, "managed_solve"), quiet=1)  # as pip install does
    me = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--systems",
          str(systems), "--warm-rounds", str(args.warm_rounds)]
    report: dict = {"device": args.device, "systems": systems, "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory(prefix="ms_cold_") as tmp:
        cold = _caches(tmp, "cold")
        a, _, _ = _run(me + ["--child", "import"], _env(_caches(tmp, "import")))
        b, _, _ = _run(me + ["--child", "solve"], _env(cold))
        numba_files = _files(cold["NUMBA_CACHE_DIR"])
        c, _, _ = _run(me + ["--child", "solve"], _env(cold))
        warmed = _caches(tmp, "warmup")
        cli = [sys.executable, "-m", "managed_solve"]
        _, warm_text, t_warmup = _run(cli + ["warmup", "--device", args.device, "--json"],
                                      _env(warmed))
        d, _, _ = _run(me + ["--child", "solve"], _env(warmed))
        e = None
        if not args.no_demo:
            demo_dir = _caches(tmp, "demo")
            demo = cli + ["demo", "--json", "--repeat", "3", "--device",
                          "cpu" if args.device == "cpu" else "cuda:0",
                          "--out", os.path.join(tmp, "demo.png")] + (["--small"] if args.small else [])
            e_json, e_text, e_wall = _run(demo, _env(demo_dir))
            if e_json is not None:
                lines = [ln for ln in e_text.splitlines() if "than the naive way" in ln
                         or ln.startswith("first run")]
                e = {"wall_s": e_wall, "speedup": e_json.get("speedup"), "verdict": e_json.get("verdict"),
                     "first_run": e_json.get("first_run"), "lines": lines}
    report.update({"import": a, "empty_caches": b, "warm_disk_caches": c,
                   "after_warmup": d, "warmup_wall_s": t_warmup, "demo": e,
                   "numba_cache_files_after_b": numba_files})

    print(f"cold start on {args.device}: {systems} W2 systems (one matrix each), seconds")
    if a:
        print(f"  (a) import managed_solve                          {a['import_s']:7.2f}"
              f"   pulls in: {', '.join(a['imported']) or 'nothing heavy'}")
    for label, r in (("(b) first solve_many, empty caches", b),
                     ("(c) first solve_many, warm disk caches", c),
                     ("(d) first solve_many after `warmup`", d)):
        if not r:
            print(f"  {label}: failed (see above)")
            continue
        print(f"  {label:48s} {r['first_s']:7.2f}   (+ import {r['import_s']:.2f})")
        print(f"      same process, warm call (median of {len(r['warm_runs_s'])})  "
              f"{r['warm_s']:7.3f}   first - warm {r['first_s'] - r['warm_s']:.2f}")
        if r["numba_s"]:
            print(f"      Numba kernels compiled/loaded: {sum(r['numba_s'].values()):.2f} s "
                  f"({_top(r['numba_s'])}); {r['numba_loaded_from_cache']} loaded from cache")
        if r["cuda_modules_s"]:
            print(f"      CUDA modules: {sum(r['cuda_modules_s'].values()):.2f} s "
                  f"({_top(r['cuda_modules_s'])})")
    print(f"  `managed-solve warmup` with empty caches, wall    {t_warmup:7.2f}")
    if b and b["numba_loaded_from_cache"]:
        print("  WARNING: (b) loaded kernels from a cache: its caches were not empty")
    if e:
        print(f"  (e) `managed-solve demo{' --small' if args.small else ''}`, empty caches, wall "
              f"{e['wall_s']:.1f} s")
        for ln in e["lines"]:
            print(f"      {ln.strip()}")
    if b and c:
        print(f"targets: (b) {b['first_s']:.2f} s <= 5 s: {'met' if b['first_s'] <= 5 else 'MISSED'}; "
              f"(c) first - warm {c['first_s'] - c['warm_s']:.2f} s <= 0.5 s: "
              f"{'met' if c['first_s'] - c['warm_s'] <= 0.5 else 'MISSED'}"
              + (f"; (e) speed-up {e['speedup']:.2f}x > 1: {'met' if e['speedup'] > 1 else 'MISSED'}"
                 if e and e.get("speedup") else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
