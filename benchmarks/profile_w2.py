"""Where ``solve_many``'s time goes on GPUs (W2, W2-large): a diagnostic, not a benchmark.

Wraps the steps of ``managed_solve.scheduling`` with wall-clock timers (per thread), runs W2 on
one GPU and W2-large on one and two, and prints per-step totals and each
worker's timeline. Run on a GPU machine:

    python3 benchmarks/profile_w2.py [--large] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import gc
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
from bench_w2_many import RTOL, poisson2d, w2_pairs, w2_sizes  # noqa: E402

from managed_solve import LinearSystem, _backend, config  # noqa: E402
from managed_solve.manager import DeviceManager  # noqa: E402
from managed_solve.scheduling import estimate as estimation  # noqa: E402
from managed_solve.scheduling import many, routes  # noqa: E402
from managed_solve.scheduling import plan as planning  # noqa: E402
from managed_solve.scheduling import runner as running  # noqa: E402
from managed_solve.scheduling import validate as validation  # noqa: E402
from managed_solve.scheduling.runner import Runner  # noqa: E402
from managed_solve.solvers import batched  # noqa: E402
from managed_solve.solvers.batched import engine as batched_engine  # noqa: E402
from managed_solve.solvers.batched import gpu as batched_gpu  # noqa: E402
from managed_solve.solvers.batched import packed  # noqa: E402
from managed_solve.system import method  # noqa: E402

EVENTS: list[tuple[str, str, float, float, str]] = []
# Re-entrant: a garbage collection may start (and log itself) while a thread holds it.
_lock = threading.RLock()


def timed(owner, name, label=None, note=None, result_note=None):
    fn = getattr(owner, name)
    label = label or name

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = None
        try:
            out = fn(*a, **k)
            return out
        finally:
            t1 = time.perf_counter()
            extra = note(a, k) if note else ""
            if result_note is not None and out is not None:
                extra += result_note(out)
            event = (threading.current_thread().name, label, t0, t1, extra)
            with _lock:
                EVENTS.append(event)

    setattr(owner, name, wrapper)


_gc_start: dict = {}


def _gc_event(phase, info):
    """Garbage collections of generations 1 and 2 as timeline events (they hold the GIL)."""
    if info["generation"] < 1:
        return
    if phase == "start":
        _gc_start["t"] = time.perf_counter()
        return
    t0, t1 = _gc_start.get("t", time.perf_counter()), time.perf_counter()
    if t1 - t0 > 5e-4:  # list.append is atomic; no lock (a collection may run inside one)
        EVENTS.append((threading.current_thread().name, f"gc gen{info['generation']}", t0, t1,
                       f"collected {info['collected']}"))


def _rows(a, k):
    systems = a[0] if a else k.get("systems")
    try:
        return f"{len(systems)} sys, {sum(s.n for s in systems):,} rows"
    except Exception:
        return ""


def install():
    timed(running, "pack_batch", note=_rows)
    timed(routes, "solve_packed", note=lambda a, k: _rows(a, k))
    timed(planning, "plan_work")
    timed(validation, "validate_all", label="validate (all systems)")
    timed(estimation, "estimate_system", label="estimate (per system)")
    timed(routes, "run_sharded")
    timed(packed, "pack_host", note=_rows)
    timed(packed.PackedBatch, "unpack")
    timed(batched_engine, "run_core", note=lambda a, k: f"{a[0].nsys} sys, {a[0].n:,} rows")
    timed(batched_gpu, "solve", label="cuda solve",
          result_note=lambda out: f"gpu {1e3 * out[7]:.1f} ms, {out[5]} checkpoints, "
                                  f"{out[6]} compactions, its<= {int(out[1].max())}")
    timed(batched, "residual_norms")
    timed(batched_gpu.FusedSolve, "__init__", label="solver init")
    timed(batched_gpu.FusedSolve, "_setup", label="solver setup")
    timed(batched_gpu.FusedSolve, "_capture", label="graph capture")
    timed(batched_gpu.FusedSolve, "_compact", label="compaction")
    timed(Runner, "deliver", label="deliver (per result)")
    timed(Runner, "deliver_many", label="deliver (per batch)")
    timed(estimation, "prefetch_methods")
    timed(estimation, "head_start")
    timed(Runner, "extend", label="plan extended")
    timed(Runner, "complete", label="results (finisher)")
    timed(Runner, "join", label="runner join")
    timed(running, "stage", label="stage (stage thread)")
    timed(many, "solve_many")
    timed(routes, "packed_results", note=lambda a, k: f"{len(a[0])} sys")
    timed(routes, "run_packed")
    timed(many, "select_devices")
    timed(planning, "packed_bytes")
    timed(method, "is_symmetric", label="is_symmetric (per call)")
    timed(validation.SymmetryPass, "run", label="symmetry pass",
          note=lambda a, k: f"{sum(len(g[0]) for g in a[0].groups)} matrices")
    timed(validation, "finite_arrays", label="finite pass", note=lambda a, k: f"{len(a[0])} arrays")
    timed(Runner, "_batch_method", label="batch method (waits for its tests)")
    timed(method, "positive_diagonal", label="positive_diagonal (per call)")
    gc.callbacks.append(_gc_event)


def report(t_start: float, wall: float) -> None:
    totals = defaultdict(lambda: [0, 0.0])
    for _th, label, t0, t1, _x in EVENTS:
        totals[label][0] += 1
        totals[label][1] += t1 - t0
    print(f"  wall {wall * 1e3:.1f} ms")
    for label, (count, sec) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"  {label:28s} calls {count:6d}  total {sec * 1e3:9.1f} ms")
    summarize(t_start, wall)
    if not TIMELINE:
        return
    print("  timeline (ms from start):")
    for th, label, t0, t1, extra in sorted(EVENTS, key=lambda e: e[2]):
        if "per " in label:
            continue
        print(f"    {th:28s} {label:18s} {1e3 * (t0 - t_start):8.1f} -> {1e3 * (t1 - t_start):8.1f}"
              f"  ({1e3 * (t1 - t0):7.1f})  {extra}")


TIMELINE = True


def summarize(t_start: float, wall: float) -> None:
    """Per thread: when its first and last step ran, GPU time against wall time, host steps."""
    by_thread = defaultdict(list)
    for th, label, t0, t1, extra in EVENTS:
        by_thread[th].append((label, t0 - t_start, t1 - t_start, extra))
    print("  per thread (ms): first start, last end, busy (sum of top-level steps), GPU time")
    for th, ev in sorted(by_thread.items()):
        first = min(e[1] for e in ev)
        last = max(e[2] for e in ev)
        gpu = sum(float(e[3].split("gpu ")[1].split(" ms")[0]) for e in ev
                  if e[0] == "cuda solve" and "gpu " in e[3])
        steps = defaultdict(float)
        for label, a, b, _x in ev:
            steps[label] += b - a
        top = ", ".join(f"{k} {1e3 * v:.0f}" for k, v in sorted(steps.items(), key=lambda kv: -kv[1])[:6])
        print(f"    {th:28s} {1e3 * first:7.1f} {1e3 * last:7.1f}  gpu {gpu:7.1f}  | {top}")


def run(title, systems, devices, dm, rounds, **kw):
    print(f"== {title}: {len(systems)} systems on {devices}")
    kw = kw or {"devices": devices}
    many.solve_many(systems, manager=dm, **kw)  # warm-up, compiles, learns
    walls = []
    for r in range(rounds):
        EVENTS.clear()
        t0 = time.perf_counter()
        out = many.solve_many(systems, manager=dm, **kw)
        t_ret = time.perf_counter()
        for d in devices:
            if d.startswith("cuda"):
                _backend.synchronize(int(d.split(":")[1]))
        wall = time.perf_counter() - t0
        walls.append(wall)
        bad = sum(not x.converged for x in out)
        syncs = [x.info.get("host_syncs") for x in out if "host_syncs" in x.info]
        its = [x.iterations for x in out]
        print(f"-- round {r}: {wall * 1e3:.1f} ms (returned at {1e3 * (t_ret - t0):.1f}), "
              f"not converged {bad}, host syncs per batch "
              f"{sorted(set(syncs))}, iterations {min(its)}..{max(its)}")
        if r == rounds - 1:
            report(t0, wall)
    return float(np.median(walls))


# W2-large experiments: settings of ms.config (the library's defaults under "default").
CONFIGS = {
    "default": {},
    # batches launched kernel by kernel instead of replayed as CUDA graphs
    "no-graph-batches": {"batched_graph_batches": False},
    # process-wide changes the caller may opt in to (by default solve_many makes none)
    "pause-gc": {"pause_gc": True},
    "switch-0.5ms": {"switch_interval": 5e-4, "head_switch_interval": 1e-4},
    "head-switch-0.5ms": {"switch_interval": 5e-4, "head_switch_interval": 5e-4},
    "process-opt-in": {"pause_gc": True, "switch_interval": 5e-4, "head_switch_interval": 1e-4},
    "batches-per-gpu-2": {"batches_per_device": 2},  # default 4
    "batches-per-gpu-3": {"batches_per_device": 3},
    "batches-per-gpu-6": {"batches_per_device": 6},
    "batches-per-gpu-8": {"batches_per_device": 8},
    "serial-symmetry": {"symmetry_workers": 1},  # one-thread symmetry test
    # only the 1M-entry matrices' methods beside the estimate loop
    "large-prefetch-only": {"prefetch_all_cores": 1 << 30},
    # every system estimated and planned before any starts
    "no-head-start": {"head_start_systems": 1 << 62},
}


@contextlib.contextmanager
def configure(name):
    """One experiment's settings for the duration of a block."""
    with config.override(**CONFIGS[name]):
        yield


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="default",
                    help=f"comma-separated W2-large experiments among {', '.join(CONFIGS)}")
    ap.add_argument("--skip-w2", action="store_true")
    ap.add_argument("--large-count", type=int, default=10_000, help="W2 systems in W2-large")
    ap.add_argument("--big-m", type=int, default=1024, help="grid side of W2-large's four large systems")
    ap.add_argument("--watchdog", type=float, default=0,
                    help="seconds after which every thread's stack is printed and the run stops")
    ap.add_argument("--no-timeline", action="store_true", help="per-thread summaries only")
    args = ap.parse_args()
    global TIMELINE
    TIMELINE = not args.no_timeline
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    install()
    ngpu = _backend.cuda_probe()[0]
    sizes = w2_sizes()
    w2 = [LinearSystem(A, b, rtol=RTOL) for A, b in w2_pairs(sizes)]
    first = ["cuda:0"] if ngpu else ["cpu"]  # the CPU only to try the script here
    dm = DeviceManager(["cuda:0"] + (["cuda:1"] if ngpu > 1 else []) if ngpu else ["cpu"])
    if not args.skip_w2:
        run("W2 as LinearSystems, one matrix object per size", w2, first, dm, args.rounds)
    if ngpu and not args.skip_w2:
        run("W2 pairs, one matrix object per size", w2_pairs(sizes), first, DeviceManager(["cuda:0"]),
            args.rounds, rtol=RTOL)
        # exactly the benchmark's call: one matrix per system, rtol given, a manager of one GPU
        own = [(poisson2d(m), np.ones(m * m)) for m in sizes]
        run("W2 one matrix per system (bench_w2_gpu_solve_many)", own, first,
            DeviceManager(["cuda:0"]), args.rounds, rtol=RTOL)
    if args.large:
        m = args.big_m
        big = poisson2d(m)
        large = [LinearSystem(A, b, rtol=RTOL) for A, b in w2_pairs(w2_sizes(args.large_count, seed=1))]
        large += [LinearSystem(big, np.ones(m * m), rtol=RTOL) for _ in range(4)]
        summary = []
        for name in args.configs.split(","):
            with configure(name):
                one = run(f"W2-large 1 GPU [{name}]", large, first, dm, args.rounds)
                two = run(f"W2-large 2 GPUs [{name}]", large, ["cuda:0", "cuda:1"], dm,
                          args.rounds) if ngpu > 1 else float("nan")
            summary.append((name, one, two))
        print("== W2-large summary (median wall of the rounds)")
        print(f"  {'config':20s} {'1 GPU ms':>9s} {'2 GPUs ms':>9s} {'speed-up':>8s}")
        for name, one, two in summary:
            print(f"  {name:20s} {1e3 * one:9.1f} {1e3 * two:9.1f} {one / two:8.2f}")


if __name__ == "__main__":
    main()
