"""The host steps of ``solve_many`` before its first batch, on W2 with one matrix per system: a diagnostic.

Runs, one by one and in the order ``solve_many``'s steps run them
(``scheduling.validate.validate_call``, ``estimate_call``, ``plan_call``),
the steps before the runner starts (the input tables of the symmetry and
finite checks, the kernels over every core, validation, the method
prefetch, the estimates, the plan), then ``pack_host`` of the systems in
batches of 100, and prints each step's median milliseconds over the
rounds. No GPU needed: the estimates and the plan are those of a call on
one (simulated) GPU. Compare two checkouts by running it under each
(``PYTHONPATH=<checkout>``) on the same machine, one after the other.

Run: ``python3 benchmarks/w2_host_steps.py [--count 400] [--rounds 15]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
from bench_w2_many import RTOL, poisson2d, w2_sizes  # noqa: E402

from managed_solve.manager import DeviceManager  # noqa: E402
from managed_solve.scheduling import estimate as estimation  # noqa: E402
from managed_solve.scheduling import validate as validation  # noqa: E402
from managed_solve.scheduling.many import select_devices  # noqa: E402
from managed_solve.scheduling.plan import packed_bytes, plan_work  # noqa: E402
from managed_solve.solvers.batched import pack_host  # noqa: E402


def steps(items: list, manager: DeviceManager) -> dict[str, float]:
    """Seconds of each step of one call's start (up to the runner, then packing)."""
    t: dict[str, float] = {}
    clock = time.perf_counter
    t0 = clock()
    cache: dict = {}
    least = validation.pass_least()
    mats = validation.input_matrices(items, "auto", least)
    t1 = clock()
    tests = validation.symmetry_pass(mats)
    t2 = clock()
    finite = validation.FinitePass(validation.finite_candidates(items, tests.covered()))
    t3 = clock()
    validation.run_all([tests, finite])
    t4 = clock()
    tests.store(cache)
    memo = {id(a): a for a in finite.finite()}
    memo.update((id(a), a) for a in tests.finite_data())
    _results, checked = validation.validate_all(items, method="auto", M=None, rtol=RTOL, memo=memo)
    valid = [checked.get(i) for i in range(len(items))]
    t5 = clock()
    devs = select_devices(manager, None, True, valid)
    kind = next(d.kind for d in devs if d.kind != "cpu")
    found = estimation.host_matrices(valid, cache, least)
    early = estimation.prefetch_methods(valid, kind, cache, skip={id(A) for A in found})
    early.update(estimation.start_host_matrices(found, cache))
    for f in early.values():
        f.result()
    t6 = clock()
    memo = estimation.shares_matrices(valid)  # as estimate_call decides
    ests = [estimation.estimate_system(s, i, device_kind=kind, manager=manager,
                                       reference=devs[0], cache=cache, memo=memo)
            for i, s in enumerate(valid)]
    t7 = clock()
    plan_work(ests, devs, manager, batch_bytes=packed_bytes(valid))
    t8 = clock()
    for lo in range(0, len(valid), 100):
        pack_host(valid[lo:lo + 100])
    t9 = clock()
    t.update({"input_matrices": t1 - t0, "symmetry_pass tables": t2 - t1,
              "finite tables": t3 - t2, "run_all (kernels)": t4 - t3,
              "store + validate_all": t5 - t4, "devices + prefetch": t6 - t5,
              "estimates": t7 - t6, "plan_work": t8 - t7, "before the runner": t8 - t0,
              "pack_host (batches of 100)": t9 - t8})
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=400, help="W2 systems, each its own matrix")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    items = [(poisson2d(m), np.ones(m * m)) for m in w2_sizes(args.count)]
    manager = DeviceManager(simulate="1x80GiB")
    steps(items, manager)  # compiles, fills caches
    rounds = [steps(items, manager) for _ in range(args.rounds)]
    print(f"W2, {args.count} systems, one matrix each: median ms over {args.rounds} rounds")
    for key in rounds[0]:
        ms = 1e3 * statistics.median(r[key] for r in rounds)
        print(f"  {key:28s} {ms:8.2f} ms  {1e3 * ms / args.count:6.1f} us a system")


if __name__ == "__main__":
    main()
