"""Host-side costs of ``solve_many`` before and around the GPU work: a diagnostic, not a benchmark.

Times, on whatever machine runs it (no GPU needed):

- ``as_system`` (validation) of W2-large's (A, b) pairs (``LinearSystem.__init__``), per pair;
- ``estimate_system`` of W2-large's systems (65 distinct matrices), per system;
- ``pack_host`` of batches of W2 systems and of one 1M-unknown system, ns per row;
- the plan of W2-large (10,000 W2 systems + four of 1024^2 unknowns) on two
  H200-like GPUs: where the four large systems go and the predicted finish times.

Run: ``python3 benchmarks/host_overhead.py [--count 10000] [--rows 5000000]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
from bench_w2_many import poisson2d, w2_pairs, w2_sizes  # noqa: E402

from managed_solve.devices import Device  # noqa: E402
from managed_solve.manager import DeviceManager  # noqa: E402
from managed_solve.scheduling.estimate import estimate_system  # noqa: E402
from managed_solve.scheduling.plan import Slot, packed_bytes, plan_work  # noqa: E402
from managed_solve.scheduling.validate import as_system  # noqa: E402
from managed_solve.solvers.batched import pack_host  # noqa: E402


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=10_000, help="W2 systems (W2-large: 10,000)")
    ap.add_argument("--rows", type=int, default=5_000_000, help="rows of the packed W2 batch")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    pairs = w2_pairs(w2_sizes(args.count, seed=1))
    big = poisson2d(1024)
    pairs += [(big, np.ones(1024 * 1024)) for _ in range(4)]
    print(f"W2-large: {len(pairs)} systems, {len({id(A) for A, _ in pairs})} distinct matrices, "
          f"{sum(A.shape[0] for A, _ in pairs):,} rows")

    # 1. validation of (A, b) pairs
    def validate():
        memo: dict = {}  # as solve_many keeps one per call
        return [as_system(p, i, method="auto", M=None, rtol=None, memo=memo)
                for i, p in enumerate(pairs)]

    validate()
    t = best(validate, args.repeat)
    systems = validate()
    print(f"as_system        {t * 1e3:8.1f} ms  {t / len(pairs) * 1e6:6.2f} us per pair")

    # 2. estimates, as solve_many makes them for two GPUs
    dm = DeviceManager(simulate="2x80GiB")
    ref = dm.accelerators[0]

    def estimate(part=systems):
        cache: dict = {}
        return [estimate_system(s, i, device_kind="cuda", manager=dm, reference=ref, cache=cache)
                for i, s in enumerate(part)]

    ests = estimate()
    for label, part in (("W2 systems", systems[:-4]), ("all", systems)):
        t = best(lambda part=part: estimate(part), args.repeat)
        print(f"estimate {label:11s} {t * 1e3:8.1f} ms  {t / len(part) * 1e6:6.2f} us per system")

    # 3. pack_host: W2 systems up to --rows rows, and one 1M-unknown system
    batch, rows = [], 0
    for s in systems[:-4]:
        if rows >= args.rows:
            break
        batch.append(s)
        rows += s.n
    for label, part, jacobi in (("W2 batch", batch, False), ("W2 batch, jacobi", batch, True),
                                ("one 1024^2", systems[-1:], False)):
        n = sum(s.n for s in part)
        pack_host(part, jacobi=jacobi)  # warm-up (JIT, page faults of the allocator)
        t = best(lambda part=part, jacobi=jacobi: pack_host(part, jacobi=jacobi), args.repeat)
        print(f"pack_host {label:18s} {len(part):5d} sys {n:10,d} rows {t * 1e3:8.1f} ms "
              f"{t / n * 1e9:6.2f} ns/row")

    # 4. the plan on two H200-like GPUs (planning only: nothing runs there)
    gpus = [Device("cuda", k, "H200 (planning only)", 141 << 30, bandwidth=4.0e12) for k in (0, 1)]
    slots = [Slot(str(d), int(0.9 * d.total_bytes), d.bandwidth, 0.0, "cuda") for d in gpus]
    t0 = time.perf_counter()
    plan = plan_work(ests, gpus, dm, batch_bytes=packed_bytes(systems), slots=slots)
    t = time.perf_counter() - t0
    large = {len(systems) - k for k in range(1, 5)}
    finish = plan.finish_times()
    print(f"plan_work        {t * 1e3:8.1f} ms  rows per batch {plan.rows:,}")
    for name, q in plan.queues.items():
        if not q:
            continue
        where = sum(1 for b in q for i in b.indices if i in large)
        print(f"  {name}: {len(q)} batches, large systems {where}, predicted finish "
              f"{finish.get(name, 0.0) * 1e3:.1f} ms, batch sizes "
              f"{[b.nsys for b in q][:12]}{' ...' if len(q) > 12 else ''}")
    busy = [v for v in finish.values() if v > 0]
    print(f"  imbalance max/min {max(busy) / min(busy):.3f}")


if __name__ == "__main__":
    main()
