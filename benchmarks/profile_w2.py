"""Where ``solve_many``'s time goes on GPUs (W2, W2-large): a diagnostic, not a benchmark.

Wraps the scheduler's steps with wall-clock timers (per thread), runs W2 on
one GPU and W2-large on one and two, and prints per-step totals and each
worker's timeline. Run on a GPU machine:

    python3 benchmarks/profile_w2.py [--large] [--rounds 2]
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
from bench_w2_many import RTOL, poisson2d, w2_pairs, w2_sizes  # noqa: E402

from managed_solve import LinearSystem, _backend  # noqa: E402
from managed_solve import scheduler as sched  # noqa: E402
from managed_solve.manager import DeviceManager  # noqa: E402
from managed_solve.solvers import _cuda_krylov, batch, batched  # noqa: E402

EVENTS: list[tuple[str, str, float, float, str]] = []
_lock = threading.Lock()


def timed(owner, name, label=None, note=None):
    fn = getattr(owner, name)
    label = label or name

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            t1 = time.perf_counter()
            extra = note(a, k) if note else ""
            with _lock:
                EVENTS.append((threading.current_thread().name, label, t0, t1, extra))

    setattr(owner, name, wrapper)


def _rows(a, k):
    systems = a[0] if a else k.get("systems")
    try:
        return f"{len(systems)} sys, {sum(s.n for s in systems):,} rows"
    except Exception:
        return ""


def install():
    timed(sched, "_pack", note=_rows)
    timed(sched, "_solve_packed", note=lambda a, k: _rows(a, k))
    timed(sched, "plan_work")
    timed(sched, "_validate", label="validate (per system)")
    timed(sched, "estimate", label="estimate (per system)")
    timed(sched, "_run_sharded")
    timed(batch, "pack_host", note=_rows)
    timed(batch.PackedBatch, "unpack")
    timed(batched, "cg_batched", note=lambda a, k: f"{a[0].nsys} sys, {a[0].n:,} rows")
    timed(_cuda_krylov, "solve", label="cuda solve")


def report(t_start: float, wall: float) -> None:
    totals = defaultdict(lambda: [0, 0.0])
    for _th, label, t0, t1, _x in EVENTS:
        totals[label][0] += 1
        totals[label][1] += t1 - t0
    print(f"  wall {wall * 1e3:.1f} ms")
    for label, (count, sec) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"  {label:28s} calls {count:6d}  total {sec * 1e3:9.1f} ms")
    print("  timeline (ms from start):")
    for th, label, t0, t1, extra in sorted(EVENTS, key=lambda e: e[2]):
        if "per system" in label:
            continue
        print(f"    {th:28s} {label:18s} {1e3 * (t0 - t_start):8.1f} -> {1e3 * (t1 - t_start):8.1f}"
              f"  ({1e3 * (t1 - t0):7.1f})  {extra}")


def run(title, systems, devices, dm, rounds, **kw):
    print(f"== {title}: {len(systems)} systems on {devices}")
    kw = kw or {"devices": devices}
    sched.solve_many(systems, manager=dm, **kw)  # warm-up, compiles, learns
    for r in range(rounds):
        EVENTS.clear()
        t0 = time.perf_counter()
        out = sched.solve_many(systems, manager=dm, **kw)
        for d in devices:
            if d.startswith("cuda"):
                _backend.synchronize(int(d.split(":")[1]))
        wall = time.perf_counter() - t0
        bad = sum(not x.converged for x in out)
        syncs = [x.info.get("host_syncs") for x in out if "host_syncs" in x.info]
        its = [x.iterations for x in out]
        print(f"-- round {r}: {wall * 1e3:.1f} ms, not converged {bad}, host syncs per batch "
              f"{sorted(set(syncs))}, iterations {min(its)}..{max(its)}")
        if r == rounds - 1:
            report(t0, wall)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    install()
    ngpu = _backend.cuda_probe()[0]
    sizes = w2_sizes()
    w2 = [LinearSystem(A, b, rtol=RTOL) for A, b in w2_pairs(sizes)]
    first = ["cuda:0"] if ngpu else ["cpu"]  # the CPU only to try the script here
    dm = DeviceManager(["cuda:0"] + (["cuda:1"] if ngpu > 1 else []) if ngpu else ["cpu"])
    run("W2", w2, first, dm, args.rounds)
    if ngpu:  # exactly the benchmark's call: (A, b) pairs, rtol given, a manager of one GPU
        run("W2 as bench_w2_gpu_solve_many", w2_pairs(sizes), first, DeviceManager(["cuda:0"]),
            args.rounds, rtol=RTOL)
    if args.large:
        big = poisson2d(1024)
        large = [LinearSystem(A, b, rtol=RTOL) for A, b in w2_pairs(w2_sizes(10_000, seed=1))]
        large += [LinearSystem(big, np.ones(1024 * 1024), rtol=RTOL) for _ in range(4)]
        run("W2-large 1 GPU", large, first, dm, 1)
        if ngpu > 1:
            run("W2-large 2 GPUs", large, ["cuda:0", "cuda:1"], dm, 1)


if __name__ == "__main__":
    main()
