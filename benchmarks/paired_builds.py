"""W1, W2 and W3 on two builds of the package, call by call in alternation, on one GPU.

Timing each build in a process of its own, one after the other, leaves
the comparison to whatever else the host did meanwhile: on a shared GPU
host W2's medians move by some 10% between processes. Here two long-lived
worker processes, one per build (``PYTHONPATH`` each checkout), take
turns: for each workload the driver asks old, new, new, old, then new,
old, old, new, ... for one call at a time, so the two builds' calls
alternate within milliseconds and neither gains from its position. The
figure is the median of the paired ratios (each new call over the old
call next to it) with a bootstrap interval of that median.

    python benchmarks/paired_builds.py --old ../before --new . --rounds 20

A checkout whose ``kernels/`` sits beside the package (installed through a
``package-dir`` mapping) runs from its tree once that directory is linked
into it: ``ln -s ../kernels managed_solve/kernels``.

Each workload is built and called three times (untimed) in each worker
before its rounds; each call is timed between two synchronisations of
the GPU. Every call's answer is checked (W1: the iterations run; W2:
every system converged); the last table says whether all were right.
With ``--phases``, W2's four steps (validate, estimate, plan, run) are
timed too, where the build has ``managed_solve.scheduling``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_builds import poisson2d  # noqa: E402  (this directory's helper, either build)

#: Workloads by name: W2 with one matrix per system and with shared matrices,
#: W1 at two sizes (200 CG iterations) and to rtol 1e-8 at a million unknowns, W3.
WORKLOADS = ("W2-own", "W2-shared", "W1-256", "W1-2048", "W1-answer", "W3")
#: The W2 steps timed with ``--phases`` (module attribute of ``scheduling.many``).
PHASES = (("validation", "validate_call"), ("estimation", "estimate_call"),
          ("planning", "plan_call"), ("running", "run_call"))


def make(name: str, ms, cp, csp, dm):
    """One call of workload ``name`` (a function returning whether its answer is right)."""
    if name.startswith("W2-"):
        sizes = [int(m) for m in np.random.default_rng(0).integers(32, 97, size=400)]
        if name == "W2-own":  # one matrix per system, as users have them
            pairs = [(poisson2d(m), np.ones(m * m)) for m in sizes]
        else:
            cache: dict = {}
            pairs = [(cache.setdefault(m, poisson2d(m)), np.ones(m * m)) for m in sizes]
        return lambda: all(r.converged for r in ms.solve_many(pairs, rtol=1e-8, manager=dm))
    if name in ("W1-256", "W1-2048"):
        m = int(name[3:])
        A, b = csp.csr_matrix(poisson2d(m)), cp.ones(m * m)
        return lambda: int(ms.solve(A, b, rtol=1e-30, maxiter=200, method="cg", M=None,
                                    device="cuda:0", manager=dm).iterations) == 200
    if name == "W1-answer":
        A, b = csp.csr_matrix(poisson2d(1024)), cp.ones(1024 * 1024)
        return lambda: bool(ms.solve(A, b, rtol=1e-8, method="cg", M=None, device="cuda:0",
                                     manager=dm).converged)
    if name == "W3":
        from managed_solve import assembly
        from managed_solve.mesh import icosphere

        mesh = icosphere(9)
        assembly.symbolic(mesh, device="cuda:0")

        def w3():
            assembly.assemble(mesh, stiffness=1.0, lumped_mass=1.0, device="cuda:0")
            return True
        return w3
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


def serve(phases: bool) -> None:
    """The worker: one JSON line per workload name read from stdin (until ``stop``)."""
    import cupy as cp
    import cupyx.scipy.sparse as csp

    import managed_solve as ms

    spent: dict[str, float] = {}
    try:
        from managed_solve.scheduling import many
    except ImportError:  # a build without the scheduling package: no steps to time
        many = None
        if phases:
            print(f"--phases: {ms.__file__} has no managed_solve.scheduling; its steps are "
                  "not timed", file=sys.stderr)
    if phases and many is not None:
        for module, name in PHASES:
            mod = getattr(many, module)
            mod.__dict__[name] = _timed_step(mod.__dict__[name], name, spent)
    dm = ms.DeviceManager(["cuda:0"])
    dev = cp.cuda.Device(0)
    calls: dict = {}
    print(json.dumps({"ready": ms.__file__}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == "stop":
            break
        if name not in calls:
            calls[name] = make(name, ms, cp, csp, dm)
            for _ in range(3):
                calls[name]()
        dev.synchronize()
        spent.clear()
        t0 = time.perf_counter()
        ok = calls[name]()
        dev.synchronize()
        print(json.dumps({"total": time.perf_counter() - t0, "ok": bool(ok), **spent}), flush=True)


def _timed_step(fn, name: str, spent: dict):
    def step(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    return step


def drive(args) -> None:
    workers = {}
    for label, path in (("old", args.old), ("new", args.new)):
        cmd = [sys.executable, os.path.abspath(__file__), "--serve"] + (["--phases"] if args.phases else [])
        env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = p.stdout.readline()
        if not first.startswith("{"):
            raise SystemExit(f"--{label} {path}: its worker did not start (its error is above); "
                             "the path must be a checkout holding the managed_solve package")
        print(f"{label}: {json.loads(first)['ready']}", flush=True)
        workers[label] = p

    def call(label: str, name: str) -> dict:
        p = workers[label]
        p.stdin.write(name + "\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    table, raw = [], {}
    for name in args.only.split(","):
        rows: dict[str, list] = {"old": [], "new": []}
        for r in range(args.rounds):
            order = ("old", "new", "new", "old") if r % 2 == 0 else ("new", "old", "old", "new")
            for label in order:
                rows[label].append(call(label, name))
        raw[name] = rows
        ratios = [n["total"] / o["total"] for o, n in zip(rows["old"], rows["new"], strict=True)]
        rng = random.Random(0)
        boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        medians = {k: statistics.median(d["total"] for d in rows[k]) * 1e3 for k in rows}
        ok = all(d["ok"] for k in rows for d in rows[k])
        table.append((name, medians["old"], medians["new"], statistics.median(ratios), boots[50],
                      boots[1949], len(ratios), ok))
        for step in sorted({k for d in rows["new"] for k in d} - {"total", "ok"}):
            o, n = (statistics.median(d.get(step, 0.0) for d in rows[k]) * 1e3 for k in ("old", "new"))
            print(f"  {name} {step}: old {o:.3f} ms, new {n:.3f} ms", flush=True)
    for p in workers.values():
        p.stdin.write("stop\n")
        p.stdin.flush()
        p.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f)
    print("| workload | old (ms) | new (ms) | new/old, paired median | 95% interval | pairs | answers right |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, o, n, r, lo, hi, pairs, ok in table:
        print(f"| {name} | {o:.3f} | {n:.3f} | {r:.3f} | {lo:.3f}-{hi:.3f} | {pairs} | {ok} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", help="checkout of the build to compare against")
    ap.add_argument("--new", help="checkout of the build compared")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of 2 calls each per build")
    ap.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads")
    ap.add_argument("--phases", action="store_true", help="time W2's steps too")
    ap.add_argument("--json", help="write every call's times here")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.phases)
    elif not (args.old and args.new):
        ap.error("--old and --new are required")
    else:
        drive(args)


if __name__ == "__main__":
    main()
