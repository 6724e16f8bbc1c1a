"""Where ``solve_many``'s time goes on GPUs (W2, W2-large): a diagnostic, not a benchmark.

Wraps the scheduler's steps with wall-clock timers (per thread), runs W2 on
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

from managed_solve import LinearSystem, _backend, config, packing, system  # noqa: E402
from managed_solve import scheduler as sched  # noqa: E402
from managed_solve.manager import DeviceManager  # noqa: E402
from managed_solve.solvers import batched  # noqa: E402
from managed_solve.solvers.batched import gpu as batched_gpu  # noqa: E402
from managed_solve.solvers.batched import packed  # noqa: E402

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
    timed(sched, "_pack", note=_rows)
    timed(sched, "_solve_packed", note=lambda a, k: _rows(a, k))
    timed(sched, "plan_work")
    timed(sched, "_validate", label="validate (per system)")
    timed(sched, "estimate", label="estimate (per system)")
    timed(sched, "_run_sharded")
    timed(packed, "pack_host", note=_rows)
    timed(packed.PackedBatch, "unpack")
    timed(batched, "cg_batched", note=lambda a, k: f"{a[0].nsys} sys, {a[0].n:,} rows")
    timed(batched_gpu, "solve", label="cuda solve",
          result_note=lambda out: f"gpu {1e3 * out[7]:.1f} ms, {out[5]} checkpoints, "
                                  f"{out[6]} compactions, its<= {int(out[1].max())}")
    timed(batched, "residual_norms")
    timed(batched_gpu.FusedSolve, "__init__", label="solver init")
    timed(batched_gpu.FusedSolve, "_setup", label="solver setup")
    timed(batched_gpu.FusedSolve, "_capture", label="graph capture")
    timed(batched_gpu.FusedSolve, "_compact", label="compaction")
    timed(sched._Runner, "_deliver", label="deliver (per result)")
    timed(sched._Runner, "_deliver_many", label="deliver (per batch)")
    timed(sched, "_prefetch_methods")
    timed(sched, "_head_start")
    timed(sched._Runner, "extend", label="plan extended")
    timed(sched._Runner, "_deliver_batch", label="deliver batch")
    timed(sched._Runner, "join", label="runner join")
    timed(sched._Stager, "close", label="stager close")
    timed(sched, "_solve_many_local")
    timed(sched, "_results", note=lambda a, k: f"{len(a[0])} sys")
    timed(sched, "_run_packed")
    timed(sched, "_select_devices")
    timed(sched, "_packed_bytes")
    timed(sched, "is_symmetric", label="is_symmetric (per call)")
    timed(sys.modules["managed_solve.solve"], "positive_diagonal", label="positive_diagonal (per call)")
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
    sched.solve_many(systems, manager=dm, **kw)  # warm-up, compiles, learns
    walls = []
    for r in range(rounds):
        EVENTS.clear()
        t0 = time.perf_counter()
        out = sched.solve_many(systems, manager=dm, **kw)
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


_SYM_WORKERS = system.SYMMETRY_WORKERS
_PREFETCH_ALL_CORES = sched.PREFETCH_ALL_CORES
_HEAD_START_SYSTEMS = sched.HEAD_START_SYSTEMS
_HEAD_SWITCH_INTERVAL = sched.HEAD_SWITCH_INTERVAL

CONFIGS = {
    "default": {},
    "no-graph-batches": {"graph_batches": False},
    "switch-5ms": {"switch": 5e-3},  # scheduler.SWITCH_INTERVAL: the interpreter's default
    "gc-on": {"gc": True},  # scheduler.PAUSE_GC off: collections may run during the call
    "workspace-on-worker": {"prepare": False},  # scheduler.PREPARE_WORKSPACE off
    "batches-per-gpu-2": {"bpd": 2},  # packing.BATCHES_PER_DEVICE (default 4)
    "batches-per-gpu-3": {"bpd": 3},
    "batches-per-gpu-6": {"bpd": 6},
    "batches-per-gpu-8": {"bpd": 8},
    "eager-x": {"lazy_x": False},  # scheduler.LAZY_X off: every x view made on the worker
    "serial-symmetry": {"sym_workers": 1},  # system.SYMMETRY_WORKERS = 1: one-thread symmetry test
    # scheduler.PREFETCH_ALL_CORES out of reach: only the 1M-entry matrices' methods beside the loop
    "large-prefetch-only": {"prefetch_all_cores": 1 << 30},
    # scheduler.HEAD_START_SYSTEMS out of reach: every system estimated and planned before any starts
    "no-head-start": {"head_start": 1 << 62},
    # scheduler.HEAD_SWITCH_INTERVAL as the call's own (0.5 ms) instead of 0.1 ms
    "head-switch-0.5ms": {"head_switch": 5e-4},
    # scheduler.FINISH_BESIDE off: each batch's results built on its worker before the next batch
    "finish-on-worker": {"finish_beside": False},
    # scheduler.HEAD_DEFER_METHOD off: a large system waits for its method test before its copy
    "no-defer": {"defer": False},
}


_SETTINGS = contextlib.ExitStack()  # the library settings of the experiment running


def configure(name):
    """Apply one experiment's settings (module flags of the library)."""
    cfg = CONFIGS[name]
    _SETTINGS.close()  # the previous experiment's
    _SETTINGS.enter_context(config.override(batched_graph_batches=cfg.get("graph_batches", True)))
    sched.SWITCH_INTERVAL = cfg.get("switch", 5e-4)
    sched.PAUSE_GC = not cfg.get("gc", False)
    sched.PREPARE_WORKSPACE = cfg.get("prepare", True)
    sched.LAZY_X = cfg.get("lazy_x", True)
    system.SYMMETRY_WORKERS = cfg.get("sym_workers", _SYM_WORKERS)
    sched.PREFETCH_ALL_CORES = cfg.get("prefetch_all_cores", _PREFETCH_ALL_CORES)
    sched.HEAD_START_SYSTEMS = cfg.get("head_start", _HEAD_START_SYSTEMS)
    sched.HEAD_SWITCH_INTERVAL = cfg.get("head_switch", _HEAD_SWITCH_INTERVAL)
    sched.FINISH_BESIDE = cfg.get("finish_beside", True)
    sched.HEAD_DEFER_METHOD = cfg.get("defer", True)
    sched.target_rows = functools.partial(packing.target_rows,
                                          batches_per_device=cfg.get("bpd", packing.BATCHES_PER_DEVICE))


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
        run("W2", w2, first, dm, args.rounds)
    if ngpu and not args.skip_w2:  # exactly the benchmark's call: (A, b) pairs, rtol given, a manager of one GPU
        run("W2 as bench_w2_gpu_solve_many", w2_pairs(sizes), first, DeviceManager(["cuda:0"]),
            args.rounds, rtol=RTOL)
    if args.large:
        m = args.big_m
        big = poisson2d(m)
        large = [LinearSystem(A, b, rtol=RTOL) for A, b in w2_pairs(w2_sizes(args.large_count, seed=1))]
        large += [LinearSystem(big, np.ones(m * m), rtol=RTOL) for _ in range(4)]
        summary = []
        for name in args.configs.split(","):
            configure(name)
            one = run(f"W2-large 1 GPU [{name}]", large, first, dm, args.rounds)
            two = run(f"W2-large 2 GPUs [{name}]", large, ["cuda:0", "cuda:1"], dm,
                      args.rounds) if ngpu > 1 else float("nan")
            summary.append((name, one, two))
        configure("default")
        print("== W2-large summary (median wall of the rounds)")
        print(f"  {'config':20s} {'1 GPU ms':>9s} {'2 GPUs ms':>9s} {'speed-up':>8s}")
        for name, one, two in summary:
            print(f"  {name:20s} {1e3 * one:9.1f} {1e3 * two:9.1f} {one / two:8.2f}")


if __name__ == "__main__":
    main()
