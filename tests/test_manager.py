"""DeviceManager on simulated devices: dispersal, packing, admission, pinning, waiting,
spilling, concurrency, heuristic names, hints, planning, report."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import managed_solve
from managed_solve.devices import parse_simulate
from managed_solve.manager import DeviceManager
from managed_solve.sizes import default_heuristic, raw_size_of

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture
def dm():
    return DeviceManager(simulate="4x1GiB", reserved=0.0)


@pytest.fixture
def no_heuristic(monkeypatch):
    monkeypatch.setattr(managed_solve, "USE_HEURISTIC", False)


def test_dispersal_spreads_equal_work_evenly(dm):
    held = [dm.reserve(100 * MiB, disperse=True) for _ in range(12)]
    counts = {str(d): sum(r.device == d for r in held) for d in dm.accelerators}
    assert counts == {"sim:0": 3, "sim:1": 3, "sim:2": 3, "sim:3": 3}
    for r in held:
        r.release()
    assert all(dm.reserved_bytes(d) == 0 for d in dm.accelerators)


def test_dispersal_uses_predicted_time_not_only_bytes(dm):
    # One long job on sim:0; short jobs must avoid sim:0 until the others catch up.
    long = dm.reserve(10 * MiB, seconds=10.0)
    assert str(long.device) == "sim:0"
    short = [dm.reserve(10 * MiB, seconds=1.0) for _ in range(9)]
    assert all(str(r.device) != "sim:0" for r in short)


def test_pack_fills_one_device_first(dm):
    held = [dm.reserve(300 * MiB, disperse=False) for _ in range(5)]
    assert [str(r.device) for r in held] == ["sim:0"] * 3 + ["sim:1"] * 2


def test_admission_never_exceeds_capacity():
    dm = DeviceManager(simulate="2x1GiB", reserved=0.25)
    rng = np.random.default_rng(0)
    held = []
    for size in rng.integers(1, 200, size=60) * MiB:
        try:
            held.append(dm.reserve(int(size), spill=False))
        except MemoryError:
            pass
        for d in dm.accelerators:
            assert dm.reserved_bytes(d) <= dm.capacity(d) == int(0.75 * GiB)
    assert {str(r.device) for r in held} == {"sim:0", "sim:1"}


def test_live_free_memory_limits_admission(dm):
    dev = dm.get_device("sim:0")
    dev.sim_used_bytes = 900 * MiB  # another process holds most of sim:0
    r = dm.reserve(200 * MiB, disperse=False)
    assert str(r.device) != "sim:0"
    assert dm.available_bytes(dev) == 124 * MiB


def test_exclude(dm):
    assert str(dm.find_device(MiB, disperse=True, exclude=["sim:0", "sim:1"])) == "sim:2"


def test_pinning_wins_and_errors_clearly(dm):
    obj = np.zeros(10)
    dm.pin(obj, "sim:2")
    assert dm.pinned(obj) == "sim:2"
    assert str(dm.find_device(MiB, disperse=True, obj=obj)) == "sim:2"
    with dm.reserve(MiB, obj=obj) as r:
        assert str(r.device) == "sim:2"
    with pytest.raises(MemoryError, match="pinned to sim:2"):
        dm.reserve(2 * GiB, obj=obj)
    dm.unpin(obj)
    assert dm.pinned(obj) is None


def test_pin_forgets_collected_objects(dm):
    class Thing:
        pass

    t = Thing()
    dm.pin(t, "sim:1")
    assert dm.pins == [dm.get_device("sim:1")]
    del t
    import gc

    gc.collect()
    assert dm.pins == []


def test_explicit_device_too_small_is_clear_error(dm):
    with pytest.raises(MemoryError, match="asked for sim:1"):
        dm.reserve(3 * GiB, device="sim:1")
    with pytest.raises(ValueError, match="not managed"):
        dm.reserve(1, device="sim:9")


def test_waits_for_a_release_then_places():
    dm = DeviceManager(simulate="1x1GiB", reserved=0.0)
    first = dm.reserve(800 * MiB)
    threading.Timer(0.1, first.release).start()
    t0 = time.monotonic()
    second = dm.reserve(800 * MiB, timeout=5.0)
    waited = time.monotonic() - t0
    assert str(second.device) == "sim:0"
    assert 0.05 < waited < 5.0


def test_spills_to_cpu_after_timeout(caplog):
    dm = DeviceManager(simulate="1x1GiB", reserved=0.0)
    dm.reserve(800 * MiB)
    with caplog.at_level("INFO", logger="managed_solve"):
        r = dm.reserve(800 * MiB, timeout=0.05)
    assert str(r.device) == "cpu"
    assert any("spilling to the CPU" in rec.getMessage() for rec in caplog.records)
    with pytest.raises(MemoryError, match="no device can give"):
        dm.reserve(800 * MiB, timeout=0.0, spill=False)


def test_release_on_exception(dm):
    with pytest.raises(RuntimeError):
        with dm.reserve(500 * MiB, device="sim:0"):
            raise RuntimeError("work failed")
    assert dm.reserved_bytes("sim:0") == 0


def test_release_is_idempotent(dm):
    r = dm.reserve(MiB, device="sim:0")
    r.release()
    r.release()
    assert dm.reserved_bytes("sim:0") == 0


def test_a_lent_reservation_counts_the_bytes_drawn_on_it_once():
    """solve_many holds a system's bytes and lends them to the solve, which reserves its own."""
    dm = DeviceManager(simulate="2x1GiB", reserved=0.0)
    held = dm.reserve(800 * MiB, device="sim:0")
    with dm.lend(held):
        inner = dm.reserve(600 * MiB, device="sim:0")  # alone it would not fit beside held
        assert dm.reserved_bytes("sim:0") == 800 * MiB and inner.drawn == 600 * MiB
        part = dm.reserve(300 * MiB, device="sim:0")  # 200 lent, 100 from the ledger
        assert dm.reserved_bytes("sim:0") == 900 * MiB and part.drawn == 200 * MiB
        other = dm.reserve(MiB, device="sim:1")  # another device: not drawn on held
        assert other.drawn == 0 and dm.reserved_bytes("sim:1") == MiB
        with pytest.raises(MemoryError):  # 124 MiB left there: refused, and counted
            dm.reserve(200 * MiB, device="sim:0")
        assert held.refused == 1
        elsewhere = []  # another thread's request does not draw on this thread's loan
        t = threading.Thread(target=lambda: elsewhere.append(dm.reserve(100 * MiB, "sim:0")))
        t.start()
        t.join()
        assert elsewhere[0].drawn == 0 and dm.reserved_bytes("sim:0") == 1000 * MiB
    assert dm.lender("sim:0") is None  # the loan ends with the block
    inner.release()  # back to held, not to the ledger
    assert dm.reserved_bytes("sim:0") == 1000 * MiB and held.lent == 200 * MiB
    held.release()  # what part drew stays until part is released (and the other thread's)
    assert dm.reserved_bytes("sim:0") == 400 * MiB
    part.release()
    assert dm.reserved_bytes("sim:0") == 100 * MiB
    for r in (other, *elsewhere):
        r.release()
    assert dm.reserved_bytes("sim:0") == dm.reserved_bytes("sim:1") == 0


def test_a_chain_of_loans_released_out_of_order_returns_every_byte():
    dm = DeviceManager(simulate="1x1GiB", reserved=0.0)
    outer = dm.reserve(500 * MiB, device="sim:0")
    with dm.lend(outer):
        middle = dm.reserve(300 * MiB, device="sim:0")
        with dm.lend(middle):
            inner = dm.reserve(200 * MiB, device="sim:0")  # drawn on the innermost loan
    assert inner.lender is middle and middle.lender is outer
    assert dm.reserved_bytes("sim:0") == 500 * MiB
    middle.release()
    outer.release()
    assert dm.reserved_bytes("sim:0") == 200 * MiB  # inner still holds its bytes
    inner.release()
    assert dm.reserved_bytes("sim:0") == 0 and dm.available_bytes(dm.accelerators[0]) == GiB


def test_grow_adds_bytes_to_a_held_reservation_only_where_they_fit():
    dm = DeviceManager(simulate="1x1GiB", reserved=0.0)
    r = dm.reserve(600 * MiB, device="sim:0")
    dm.grow(r, 300 * MiB)
    assert r.nbytes == dm.reserved_bytes("sim:0") == 900 * MiB
    with pytest.raises(MemoryError, match="sim:0 can give only 124.0 MiB"):
        dm.grow(r, 200 * MiB)
    r.release()
    assert dm.reserved_bytes("sim:0") == 0
    with pytest.raises(MemoryError, match="released"):
        dm.grow(r, MiB)


def test_32_threads_never_overcommit():
    dm = DeviceManager(simulate="2x256MiB", reserved=0.0, wait_timeout=2.0)
    over = []
    errors = []
    barrier = threading.Barrier(32)

    def worker(seed):
        rng = np.random.default_rng(seed)
        barrier.wait()
        for _ in range(40):
            try:
                with dm.reserve(int(rng.integers(8, 96)) * MiB, spill=False) as r:
                    if dm.reserved_bytes(r.device) > dm.capacity(r.device):
                        over.append(dm.reserved_bytes(r.device))
                    time.sleep(0.0005)
            except MemoryError as exc:  # only allowed if waiting timed out
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not over
    assert all(dm.reserved_bytes(d) == 0 for d in dm.accelerators)
    assert len(errors) == 0


# -------------------------------------------------------------- sizing and the heuristic names
def test_default_heuristic_formula():
    assert default_heuristic(10_000) == 10_000 + 150
    assert managed_solve.HEURISTIC_FUNCTION(10_000) == 10_150


def test_heuristic_names_are_read_at_call_time(dm, monkeypatch):
    a = np.zeros(1000)  # 8000 bytes
    assert dm.size_of(a) == default_heuristic(8000)
    monkeypatch.setattr(managed_solve, "USE_HEURISTIC", False)
    assert dm.size_of(a) == 8000
    monkeypatch.setattr(managed_solve, "USE_HEURISTIC", True)
    monkeypatch.setattr(managed_solve, "HEURISTIC_FUNCTION", lambda s: 3 * s)
    assert dm.size_of(a) == 24000


def test_sparse_sized_by_stored_bytes(no_heuristic, dm):
    rows = np.arange(0, 100_000, 10_000)
    A = sp.csr_matrix((np.ones(10), (rows, rows)), shape=(100_000, 100_000))
    expected = A.data.nbytes + A.indices.nbytes + A.indptr.nbytes
    assert dm.size_of(A) == expected < 2 * MiB  # dense would be 80 GB
    assert raw_size_of(A.tocoo()) == A.nnz * (8 + 4 + 4)


def test_torch_sizes(no_heuristic, dm):
    torch = pytest.importorskip("torch")
    t = torch.zeros(100, 100)
    assert dm.size_of(t) == 40_000
    s = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (10_000, 10_000))
    assert dm.size_of(s) == 2 * 4 + 4 * 8
    csr = s.to_sparse_csr()
    assert dm.size_of(csr) < 100_000
    with torch.device("meta"):
        lin = torch.nn.Linear(1000, 1000)
    # parameters + gradients, sized without allocating
    assert dm.size_of(lin) == 2 * (1000 * 1000 + 1000) * 4


def test_size_of_rejects_unknown(dm):
    with pytest.raises(TypeError, match="cannot size"):
        dm.size_of(object())
    with pytest.raises(ValueError, match="negative"):
        dm.size_of(-5)


# -------------------------------------------------------------- hints
def test_hints_improve_prediction_after_repeated_records(dm):
    sig = ("poisson", 4096, "float64")
    true_seconds = 0.8
    first = dm.predict(sig, nbytes=10 * MiB, cost=1e6, device="sim:0")
    assert first.source == "model"
    errors = []
    for _ in range(5):
        dm.record(sig, true_seconds * (1 + 0.02 * np.random.default_rng(1).standard_normal()), 12 * MiB,
                  device="sim:0")
        p = dm.predict(sig, nbytes=10 * MiB, device="sim:0")
        errors.append(abs(p.seconds - true_seconds))
    assert p.source == "measured" and p.nbytes == 12 * MiB
    assert abs(first.seconds - true_seconds) > 10 * errors[-1]


def test_learned_device_speed_rebalances_dispersal():
    dm = DeviceManager(simulate="2x1GiB", reserved=0.0)
    cost = 1e9
    # sim:1 turns out 3x slower than its nominal bandwidth
    for _ in range(6):
        dm.record("w0", cost / dm.get_device("sim:0").bandwidth, device="sim:0", cost=cost)
        dm.record("w1", 3 * cost / dm.get_device("sim:1").bandwidth, device="sim:1", cost=cost)
    held = [dm.reserve(MiB, cost=cost) for _ in range(8)]
    on0 = sum(str(r.device) == "sim:0" for r in held)
    assert on0 == 6  # 3:1 split of equal work


def test_device_speed_is_learned_from_device_time_when_given():
    """Equal devices whose wall times differ by host work keep equal speeds (and equal shares)."""
    dm = DeviceManager(simulate="2x1GiB", reserved=0.0)
    cost = 1e9
    nominal = dm.get_device("sim:0").bandwidth
    for _ in range(6):
        gpu = cost / nominal
        dm.record("w0", gpu, device="sim:0", cost=cost, device_seconds=gpu)
        # sim:1's batches waited on the host as long again: wall twice the device time.
        dm.record("w1", 2 * gpu, device="sim:1", cost=cost, device_seconds=gpu)
    assert dm.speed(dm.get_device("sim:1")) == pytest.approx(dm.speed(dm.get_device("sim:0")))
    held = [dm.reserve(MiB, cost=cost) for _ in range(8)]
    assert sum(str(r.device) == "sim:0" for r in held) == 4
    # The hint keeps the wall time (what a caller waits for).
    assert dm.hints()["w1"]["seconds"] == pytest.approx(2 * cost / nominal)
    # Without device time, wall time is the speed's measure (as before).
    dm.record("w1", 4 * cost / nominal, device="sim:1", cost=cost)
    assert dm.speed(dm.get_device("sim:1")) < 0.7 * dm.speed(dm.get_device("sim:0"))
    with pytest.raises(ValueError, match="device_seconds"):
        dm.record("w1", 1.0, device="sim:1", cost=cost, device_seconds=float("inf"))


def test_hints_bounded_and_saved(tmp_path):
    dm = DeviceManager(simulate="1x1GiB", max_hints=10)
    for i in range(25):
        dm.record(("sig", i), 0.1 * i, 100, device="sim:0")
    hints = dm.hints()
    assert len(hints) == 10 and repr(("sig", 24)) in hints and repr(("sig", 0)) not in hints
    path = tmp_path / "hints.json"
    dm.save_hints(str(path))
    other = DeviceManager(simulate="1x1GiB", hints_path=str(path))
    assert other.predict(("sig", 24), device="sim:0").seconds == pytest.approx(2.4)
    bad = tmp_path / "bad.json"
    bad.write_text('{"hints": {"a": {"seconds": "x"}}}')
    with pytest.raises(ValueError, match="not a hints file"):
        other.load_hints(str(bad))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"hints": {"a": {"seconds": 1.0,', "not valid JSON"),
        ("", "not valid JSON"),
        ('{"hints": {"a": {"seconds": "x", "peak_bytes": 1, "count": 1, "device": "cpu"}}}',
         r"hints\['a'\]\.seconds = 'x'"),
        ('{"hints": {"a": {"seconds": -2.5, "peak_bytes": 1, "count": 1, "device": "cpu"}}}',
         r"hints\['a'\]\.seconds = -2\.5: expected a finite number >= 0"),
        ('{"hints": {"a": {"seconds": NaN, "peak_bytes": 1, "count": 1, "device": "cpu"}}}', "finite"),
        ('{"hints": {"a": {"seconds": 1, "peak_bytes": -1, "count": 1, "device": "cpu"}}}', "peak_bytes = -1"),
        ('{"hints": {"a": {"seconds": 1, "peak_bytes": 1, "count": true, "device": "cpu"}}}', "count = True"),
        ('{"hints": {"a": {"seconds": 1, "peak_bytes": 1, "count": 1, "device": 3}}}', "device = 3"),
        ('{"hints": {"a": {"seconds": 1, "count": 1, "device": "cpu", "colour": 1}}}',
         r"unknown field\(s\) \['colour'\]; missing field\(s\) \['peak_bytes'\]"),
        ('{"hints": {"a": [1, 2]}}', r"hints\['a'\] must be an object"),
        ('{"hints": [], "speed": {}}', "'hints' must be an object, found list"),
        ('{"speed": {"cpu": "fast"}}', r"speed\['cpu'\] = 'fast'"),
        ('{"speed": {"cpu": 0}}', "expected a speed > 0"),
        ('{"speed": {"cpu": -1e9}}', r"speed\['cpu'\] = -1000000000\.0"),
        ("[1, 2, 3]", "expected a JSON object at the top, found list"),
        ('{"hints": {}, "extra": 1}', r"unknown field\(s\) \['extra'\] at the top"),
        ('{"version": 99, "hints": {}}', "version 99"),
    ],
)
def test_bad_hints_file_warns_naming_it_and_starts_empty(tmp_path, text, problem):
    path = tmp_path / "hints.json"
    path.write_text(text)
    with pytest.warns(RuntimeWarning, match=re.escape(repr(str(path))) + ".*" + problem):
        dm = DeviceManager(simulate="1x1GiB", hints_path=str(path))
    fresh = DeviceManager(simulate="1x1GiB")
    assert dm.hints() == {} and dm.speed(dm.cpu) == fresh.speed(fresh.cpu)
    dm.record("sig", 0.5, 10, device="sim:0")
    dm.save_hints()  # the next save replaces the bad file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DeviceManager(simulate="1x1GiB", hints_path=str(path)).hints()["sig"]["seconds"] == 0.5


def test_load_hints_refuses_a_bad_file_and_keeps_what_it_holds(tmp_path):
    dm = DeviceManager(simulate="1x1GiB")
    dm.record("kept", 1.0, 10, device="sim:0")
    bad = tmp_path / "bad.json"
    bad.write_text('{"hints": {"new": {"seconds": 1, "peak_bytes": 1, "count": 1, "device": "cpu"},'
                   ' "bad": {"seconds": -1, "peak_bytes": 1, "count": 1, "device": "cpu"}}}')
    with pytest.raises(ValueError, match=re.escape(repr(str(bad))) + r".*hints\['bad'\]\.seconds = -1"):
        dm.load_hints(str(bad))
    assert list(dm.hints()) == ["kept"]  # validated as a whole: nothing of the bad file was taken


def test_hints_file_without_version_or_iterations_still_loads(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"hints": {"a": {"seconds": 2.0, "peak_bytes": 5, "count": 3, "device": "sim:0"}},'
                    ' "speed": {"sim:0": 1e12, "cuda:7": 5e11}}')
    dm = DeviceManager(simulate="1x1GiB", hints_path=str(path))
    assert dm.hints()["a"] == {"seconds": 2.0, "peak_bytes": 5, "count": 3, "device": "sim:0", "iterations": 0}
    assert dm.speed(dm.get_device("sim:0")) == 1e12  # cuda:7 is not here: ignored


def test_concurrent_saves_from_threads_never_leave_an_unloadable_file(tmp_path):
    path = str(tmp_path / "hints.json")
    managers = [DeviceManager(simulate="1x1GiB", hints_path=path) for _ in range(10)]
    for i, m in enumerate(managers):
        for j in range(50):  # a file of some size, so a torn write would show
            m.record(f"thread{i}-sig{j}", 0.1 * j, 1000 * j, device="sim:0", iterations=j)
    start = threading.Barrier(len(managers) + 1)
    errors = []

    def save(m):
        start.wait()
        try:
            for _ in range(20):
                m.save_hints()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(m,)) for m in managers]
    for t in threads:
        t.start()
    start.wait()
    reads = 0
    while any(t.is_alive() for t in threads):  # readers see the old file or a new one, never a torn one
        if os.path.exists(path):
            DeviceManager(simulate="1x1GiB").load_hints(path)
            reads += 1
    for t in threads:
        t.join()
    assert not errors and reads > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = DeviceManager(simulate="1x1GiB", hints_path=path).hints()
    assert len(loaded) == 50 and len({k.split("-")[0] for k in loaded}) == 1  # one writer's file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["hints.json"]  # no temporary files left


_SAVER = """
import sys
from managed_solve.manager import DeviceManager
path, who = sys.argv[1], sys.argv[2]
dm = DeviceManager(simulate="1x1GiB")
for j in range(200):
    dm.record(f"{who}-sig{j}", 0.1 * j, 1000 * j, device="sim:0")
for _ in range(30):
    dm.save_hints(path)
"""


def test_concurrent_saves_from_processes_never_leave_an_unloadable_file(tmp_path):
    path = str(tmp_path / "hints.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(managed_solve.__file__).parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _SAVER, path, f"proc{i}"], env=env,
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    while any(p.poll() is None for p in procs):
        if os.path.exists(path):
            DeviceManager(simulate="1x1GiB").load_hints(path)
    assert [p.wait() for p in procs] == [0] * 4, [p.stderr.read() for p in procs]
    loaded = DeviceManager(simulate="1x1GiB", hints_path=path).hints()
    assert len(loaded) == 200 and len({k.split("-")[0] for k in loaded}) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["hints.json"]


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_a_failed_save_leaves_the_previous_file_intact(tmp_path, monkeypatch, fail_at):
    path = tmp_path / "hints.json"
    dm = DeviceManager(simulate="1x1GiB", hints_path=str(path))
    dm.record("first", 1.0, 10, device="sim:0")
    dm.save_hints()
    before = path.read_bytes()
    dm.record("second", 2.0, 20, device="sim:0")

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, fail_at, disk_full)  # the write fails part way
    with pytest.raises(OSError, match="No space left"):
        dm.save_hints()
    monkeypatch.undo()
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["hints.json"]
    assert list(DeviceManager(simulate="1x1GiB", hints_path=str(path)).hints()) == ["first"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes into read-only directories")
def test_a_save_into_a_read_only_directory_leaves_the_previous_file_intact(tmp_path):
    path = tmp_path / "hints.json"
    dm = DeviceManager(simulate="1x1GiB", hints_path=str(path))
    dm.record("first", 1.0, 10, device="sim:0")
    dm.save_hints()
    before = path.read_bytes()
    dm.record("second", 2.0, 20, device="sim:0")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(PermissionError):
            dm.save_hints()
    finally:
        tmp_path.chmod(0o700)
    assert path.read_bytes() == before


def test_record_rejects_values_a_hints_file_could_not_hold(dm):
    with pytest.raises(ValueError, match="cost"):
        dm.record("x", 1.0, device="sim:0", cost=float("inf"))
    with pytest.raises(ValueError, match="peak_bytes"):
        dm.record("x", 1.0, -5)


def test_record_rejects_bad_time(dm):
    with pytest.raises(ValueError, match="seconds"):
        dm.record("x", float("nan"))


# -------------------------------------------------------------- plan and report
def test_plan_is_a_dry_run(no_heuristic, dm):
    items = [400 * MiB] * 9 + [5 * GiB]
    plan = dm.plan(items)
    assert [str(p.device) for p in plan[:8]] == ["sim:0", "sim:1", "sim:2", "sim:3"] * 2
    assert plan[-1].spilled and str(plan[-1].device) == "cpu"
    assert all(dm.reserved_bytes(d) == 0 for d in dm.accelerators)


def test_plan_meta_module_without_allocating(no_heuristic):
    torch = pytest.importorskip("torch")
    dm = DeviceManager(simulate="2x64MiB", reserved=0.0)
    with torch.device("meta"):
        big = torch.nn.Linear(4096, 4096)  # 128 MiB with grads: fits nowhere
        small = torch.nn.Linear(1024, 1024)  # 8 MiB
    plan = dm.plan([small, big])
    assert str(plan[0].device) == "sim:0" and not plan[0].spilled
    assert plan[1].spilled


def test_report_table(dm):
    with dm.reserve(100 * MiB, device="sim:1"):
        text = dm.report()
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["device", "name", "total"]
    row = next(line for line in lines if line.startswith("sim:1"))
    assert "100.0 MiB" in row and "1.0 GiB" in row
    assert any(line.startswith("cpu") for line in lines)


def test_constructor_validation():
    with pytest.raises(ValueError, match="reserved"):
        DeviceManager(simulate="1GiB", reserved=1.5)
    with pytest.raises(ValueError, match="devices"):
        DeviceManager(devices=[])


def test_default_manager_is_lazy_and_shared(monkeypatch):
    from managed_solve.manager import set_default_manager

    previous = set_default_manager(None)
    try:
        monkeypatch.setenv("MANAGED_SOLVE_SIMULATE", "2x1GiB")
        a = managed_solve.device_manager
        assert a is managed_solve.device_manager
        assert [str(d) for d in a.accelerators] == ["sim:0", "sim:1"]
        assert set_default_manager(None) is a
    finally:
        set_default_manager(previous)


def test_explicit_device_list():
    devs = parse_simulate("2x1GiB")
    dm = DeviceManager(devices=devs)
    assert dm.accelerators == devs and str(dm.cpu) == "cpu"


def test_torch_devices_are_accepted_by_name():
    torch = pytest.importorskip("torch")
    dm = DeviceManager(devices=[torch.device("cpu")])
    assert [str(d) for d in dm.devices] == ["cpu"] and dm.cpu is dm.devices[0]
    assert [str(d) for d in DeviceManager(devices=torch.device("cpu")).devices] == ["cpu"]
    assert str(dm.get_device(torch.device("cpu"))) == "cpu"
    mixed = DeviceManager(devices=[torch.device("cpu"), "sim:1"], simulate="2x1GiB")
    assert [str(d) for d in mixed.devices] == ["cpu", "sim:1"]


@pytest.mark.parametrize("item", [object(), 3.5, None])
def test_devices_that_are_not_devices_name_the_argument_and_the_fix(item):
    with pytest.raises(TypeError, match=r"DeviceManager\(devices=\.\.\.\): item 1, .* names no device.*"
                                        r"'cuda:0'.*torch\.device"):
        DeviceManager(devices=["cpu", item])


# -------------------------------------------------------------- real GPUs
@pytest.mark.multi_gpu
def test_dispersal_over_real_gpus():
    dm = DeviceManager(simulate=None, devices=None, reserved=0.1)
    gpus = [d for d in dm.accelerators if d.kind == "cuda"]
    held = [dm.reserve(256 * MiB, disperse=True) for _ in range(2 * len(gpus))]
    counts = [sum(r.device == g for r in held) for g in gpus]
    assert counts == [2] * len(gpus)


def test_tensor_subclasses_sized_as_tensors(no_heuristic, dm):
    torch = pytest.importorskip("torch")

    class Sub(torch.Tensor):
        pass

    dense = torch.zeros(10, 10).as_subclass(Sub)
    assert dm.size_of(dense) == 400
    sparse = torch.eye(1000).to_sparse_csr()
    assert dm.size_of(sparse) == 1000 * 4 + 1001 * 8 + 1000 * 8


def test_hints_remember_iterations(tmp_path):
    dm = DeviceManager(simulate="1x1GiB")
    sig = (4096, 20000, "float64", "cg", "csr")
    assert dm.predict(sig, device="sim:0").iterations is None
    dm.record(sig, 0.01, 1000, device="sim:0", iterations=137)
    assert dm.predict(sig, device="sim:0").iterations == 137
    dm.record(sig, 0.01, 1000, device="sim:0")  # a record without a count keeps the last one
    assert dm.predict(sig, device="sim:0").iterations == 137
    path = tmp_path / "h.json"
    dm.save_hints(str(path))
    assert DeviceManager(simulate="1x1GiB", hints_path=str(path)).predict(sig).iterations == 137


def test_a_spill_warns_once_with_the_reason_and_the_fix():
    from managed_solve.devices import DeviceWarning, forget_warnings

    forget_warnings()
    dm = DeviceManager(simulate="1x1GiB", reserved=0.0)
    held = dm.reserve(800 * MiB)
    with pytest.warns(DeviceWarning, match=r"fit on no GPU \(sim:0: .* free\).*Fix: "):
        r = dm.reserve(800 * MiB, timeout=0.0)
    assert str(r.device) == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert str(dm.find_device(800 * MiB)) == "cpu"  # once per process
    cpu_only = DeviceManager(devices=["cpu"])
    forget_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no GPU at all: running on the CPU is no spill
        cpu_only.find_device(800 * MiB)
    r.release()
    held.release()
    forget_warnings()


def test_plan_view_answers_as_the_three_questions_it_replaces():
    """plan_view: each device's room, speed and predicted finish, as the methods give them."""
    dm = DeviceManager(simulate="2x1GiB")
    a, b = dm.accelerators
    with dm.reserve(300 * MiB, device=a, seconds=2.0):
        dm.record("work", 0.5, device=b, cost=4e9)  # b learns a speed of its own
        view = dm.plan_view([a, b, dm.cpu])
        assert view == [(dm.available_bytes(d), dm.speed(d), dm.predicted_finish(d))
                        for d in (a, b, dm.cpu)]
        assert view[0][0] < view[1][0] and view[0][2] == 2.0 and view[1][2] == 0.0


# -------------------------------------------------------------- argument checks
@pytest.mark.parametrize("bad, error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                        (-1.0, ValueError), ("1", TypeError)])
def test_timeouts_are_refused_unless_finite_seconds(bad, error):
    """A NaN wait never ends: it is refused before any reservation, never waited on.

    The reservation asked for fits, so code that accepted the timeout returns at once
    instead of waiting.
    """
    with pytest.raises(error, match=r"DeviceManager\(wait_timeout=.*seconds >= 0.*wait_timeout=1\.0"):
        DeviceManager(simulate="1x1GiB", wait_timeout=bad)
    dm = DeviceManager(simulate="1x1GiB")
    with pytest.raises(error, match=r"reserve\(timeout=.*seconds >= 0.*timeout=None"):
        dm.reserve(10, device="sim:0", timeout=bad)
    assert dm.reserved_bytes("sim:0") == 0


def test_max_hints_is_a_count_and_zero_keeps_none():
    for bad, error in [(-1, ValueError), (1.5, ValueError), ("3", TypeError), (True, TypeError)]:
        with pytest.raises(error, match=r"DeviceManager\(max_hints=.*integer >= 0.*max_hints=4096"):
            DeviceManager(simulate="1x1GiB", max_hints=bad)
    dm = DeviceManager(simulate="1x1GiB", max_hints=0)
    dm.record("work", 1.0, device="sim:0")
    assert dm.hints() == {}


def test_settings_of_the_wrong_type_name_the_argument():
    with pytest.raises(TypeError, match=r"DeviceManager\(simulate=2\): .*simulate='2x1GiB'"):
        DeviceManager(simulate=2)
    with pytest.raises(TypeError, match=r"DeviceManager\(reserved='0\.1'\): expected a number.*reserved=0\.1"):
        DeviceManager(simulate="1x1GiB", reserved="0.1")


@pytest.mark.parametrize("kwargs, named", [
    ({"seconds": float("nan")}, r"reserve\(seconds=nan\)"),
    ({"seconds": -1e9}, r"reserve\(seconds=-1000000000\.0\)"),
    ({"cost": float("nan")}, r"reserve\(cost=nan\)"),
])
def test_reserve_refuses_predictions_that_would_corrupt_the_ledger(kwargs, named):
    dm = DeviceManager(simulate="1x1GiB")
    with pytest.raises(ValueError, match=named):
        dm.reserve(10, **kwargs)
    assert dm.reserved_bytes("sim:0") == 0 and dm.predicted_finish(dm.accelerators[0]) == 0.0
    assert "nan" not in dm.report()


def test_negative_bytes_and_bad_predictions_are_refused():
    dm = DeviceManager(simulate="1x1GiB")
    with pytest.raises(ValueError, match=r"find_device\(nbytes=-5\): expected a byte count >= 0"):
        dm.find_device(-5)
    with pytest.raises(ValueError, match=r"find_device\(seconds=nan\)"):
        dm.find_device(10, seconds=float("nan"))
    with pytest.raises(ValueError, match=r"predict\(nbytes=-1\): expected a byte count >= 0"):
        dm.predict(None, nbytes=-1)
    with pytest.raises(ValueError, match=r"predict\(cost=-1\.0\)"):
        dm.predict(None, cost=-1.0)


def test_plan_takes_one_time_per_item():
    dm = DeviceManager(simulate="1x1GiB")
    with pytest.raises(ValueError, match=r"plan\(seconds=\.\.\.\): 1 times for 2 items; give one"):
        dm.plan([10, 20], seconds=[1.0])
    with pytest.raises(ValueError, match=r"plan\(seconds\[1\]=nan\)"):
        dm.plan([10, 20], seconds=[1.0, float("nan")])
    with pytest.raises(TypeError, match=r"plan\(seconds=2\.0\): expected a list of 2"):
        dm.plan([10, 20], seconds=2.0)
    assert [p.seconds for p in dm.plan([10, 20], seconds=[1.0, 2.0])] == [1.0, 2.0]


def test_a_manager_argument_that_is_no_manager_is_refused_naming_it():
    from managed_solve.manager import manager_or_default

    with pytest.raises(TypeError, match=r"solve\(manager='cpu'\): expected a DeviceManager or None.*"
                                        r"device='cpu'"):
        manager_or_default("cpu", "solve")
    dm = DeviceManager(simulate="1x1GiB")
    assert manager_or_default(dm, "solve") is dm
    assert isinstance(manager_or_default(None, "solve"), DeviceManager)


def test_a_numpy_integer_byte_count_is_a_count_not_a_scalar_of_eight_bytes():
    """np.int64(2**29) went through nbytes (8, a scalar's size) and reserved 12 bytes."""
    dm = DeviceManager(simulate="1x4GiB")
    as_int = dm.reserve(1 << 29, "sim:0")
    as_numpy = dm.reserve(np.int64(1 << 29), "sim:0")
    try:
        assert as_numpy.nbytes == as_int.nbytes >= 1 << 29
    finally:
        as_int.release()
        as_numpy.release()
    assert dm.size_of(np.float32(100.0)) == dm.size_of(100)
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        dm.size_of(np.float64(-3.0))
