"""Settings (``managed_solve/config.py``): override blocks from several threads, and checked values.

The settings in force are the defaults with every active override block's
changes applied in the order entered; leaving a block takes out its own
changes only. The thread tests order every enter and exit with events, so
their outcome does not depend on timing.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading

import numpy as np
import pytest

from managed_solve import config

DEFAULTS = config.Settings()
WAIT = 30.0  # seconds an event may take before the test fails instead of hanging


def run_in_order(*steps):
    """Run each ``(thread, action)`` in the order given, each action on its own named thread.

    Thread names are any hashable; an action runs on the thread of that name,
    after the previous step has finished. Returns what each action returned, in order.
    """
    names = list(dict.fromkeys(name for name, _ in steps))
    go = [threading.Event() for _ in steps]
    done = [threading.Event() for _ in steps]
    out: list = [None] * len(steps)
    errors: list[BaseException] = []

    def body(name):
        try:
            for k, (who, action) in enumerate(steps):
                if who != name:
                    continue
                assert go[k].wait(WAIT), f"step {k} never started"
                if errors:  # an earlier step failed: stop without running this one
                    return
                out[k] = action()
                done[k].set()
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)
            for e in done:
                e.set()

    threads = [threading.Thread(target=body, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for k in range(len(steps)):
        go[k].set()
        assert done[k].wait(WAIT), f"step {k} did not finish"
        if errors:
            for e in go:
                e.set()
            break
    for t in threads:
        t.join(WAIT)
    if errors:
        raise errors[0]
    return out


class Block:
    """An override block entered and left by separate calls (each on the thread that runs it)."""

    def __init__(self, **changes):
        self.cm = config.override(**changes)

    def enter(self):
        return self.cm.__enter__()

    def leave(self):
        self.cm.__exit__(None, None, None)
        return config.current()


def seen(*names):
    return lambda: tuple(getattr(config.current(), n) for n in names)


@pytest.mark.parametrize("a_leaves_first", [True, False])
def test_interleaved_blocks_of_two_threads_each_take_out_only_their_own_change(a_leaves_first):
    """A enters, B enters, one leaves, the other leaves: what is in force after each step."""
    a, b = Block(batches_per_device=111), Block(work_stealing=False)
    first, second = (("A", a), ("B", b)) if a_leaves_first else (("B", b), ("A", a))
    names = ("batches_per_device", "work_stealing")
    out = run_in_order(
        ("A", a.enter), ("B", b.enter), ("A", seen(*names)),
        (first[0], first[1].leave), (second[0], seen(*names)),
        (second[0], second[1].leave), ("A", seen(*names)), ("B", seen(*names)))
    assert out[2] == (111, False)  # both blocks in force, on either thread
    assert out[4] == ((4, False) if a_leaves_first else (111, True))  # the one still inside keeps its own
    assert out[6] == out[7] == (4, True)  # both left: the defaults, on every thread
    assert config.current() == DEFAULTS


@pytest.mark.parametrize("a_leaves_first", [True, False])
def test_two_threads_setting_the_same_setting_the_later_block_wins_while_active(a_leaves_first):
    a, b = Block(batches_per_device=111), Block(batches_per_device=222)
    first, second = (("A", a), ("B", b)) if a_leaves_first else (("B", b), ("A", a))
    out = run_in_order(
        ("A", a.enter), ("B", b.enter), ("A", seen("batches_per_device")),
        (first[0], first[1].leave), ("A", seen("batches_per_device")),
        (second[0], second[1].leave), ("B", seen("batches_per_device")))
    assert out[2] == (222,)
    assert out[4] == ((222,) if a_leaves_first else (111,))
    assert out[6] == (4,)
    assert config.current() == DEFAULTS


def test_three_threads_leaving_in_any_order_restore_the_defaults():
    a, b, c = Block(batches_per_device=5), Block(host_threads=2), Block(batches_per_device=7)
    names = ("batches_per_device", "host_threads")
    out = run_in_order(("A", a.enter), ("B", b.enter), ("C", c.enter), ("A", seen(*names)),
                       ("B", b.leave), ("A", seen(*names)), ("C", c.leave), ("A", seen(*names)),
                       ("A", a.leave))
    assert out[3] == (7, 2)
    assert out[5] == (7, None)
    assert out[7] == (5, None)
    assert out[8] == DEFAULTS and config.current() == DEFAULTS


def test_a_thread_started_inside_a_block_reads_the_block_s_settings():
    """Process-wide: the worker threads solve_many starts see their caller's override."""
    got = []
    with config.override(lanes_per_device=1, work_stealing=False):
        t = threading.Thread(target=lambda: got.append(seen("lanes_per_device", "work_stealing")()))
        t.start()
        t.join(WAIT)
    assert got == [(1, False)]


def test_nested_blocks_on_one_thread_restore_the_outer_block_s_settings():
    with config.override(batches_per_device=7, host_threads=3) as outer:
        assert outer.batches_per_device == 7 and outer.host_threads == 3
        with config.override(batches_per_device=9) as inner:
            assert inner is config.current()
            assert (inner.batches_per_device, inner.host_threads) == (9, 3)
        assert config.current().batches_per_device == 7
        assert config.current().host_threads == 3
        assert config.current() == outer
    assert config.current() == DEFAULTS


def test_an_exception_leaving_blocks_restores_each_one_s_settings():
    with pytest.raises(KeyError):
        with config.override(batches_per_device=3):
            raise KeyError("x")
    assert config.current() == DEFAULTS
    with config.override(batches_per_device=7):
        with pytest.raises(RuntimeError):
            with config.override(batches_per_device=9, sharded_cache=False):
                raise RuntimeError
        assert config.current().batches_per_device == 7
        assert config.current().sharded_cache is True
    assert config.current() == DEFAULTS


def test_an_exception_on_another_thread_takes_out_only_that_thread_s_block():
    a = Block(batches_per_device=5)

    def b_fails():
        try:
            with config.override(host_threads=2):
                raise ValueError("inside B")
        except ValueError:
            return seen("batches_per_device", "host_threads")()

    out = run_in_order(("A", a.enter), ("B", b_fails), ("A", seen("batches_per_device", "host_threads")),
                       ("A", a.leave))
    assert out[1] == out[2] == (5, None)
    assert config.current() == DEFAULTS


def test_a_refused_block_changes_nothing_even_beside_an_active_one():
    with config.override(batches_per_device=6):
        before = config.current()
        with pytest.raises(ValueError, match="pack_chunk_nnz"):
            with config.override(work_stealing=False, pack_chunk_nnz=0):
                pass
        with pytest.raises(TypeError, match="no such setting"):
            with config.override(work_stealing=False, batches_per_devices=2):
                pass
        assert config.current() is before
    assert config.current() == DEFAULTS


# Each setting: values it takes, values of the wrong type, values out of its range,
# from its documented meaning (Settings' docstring). Counts are at least 1,
# thresholds at least 0, seconds above 0, None only where documented.
NAN, INF = math.nan, math.inf
BOOL = ([True, False], ["no", 1, 0, None, np.float64(1.0)], [])
COUNT = ([1, 2, 7, np.int64(3)], ["4", 4.0, True, None], [0, -3])
COUNT_OR_NONE = ([None, 1, 8], ["4", 4.0, False], [0, -1])
THRESHOLD = ([0, 1, 1 << 40, np.int32(5)], ["4", 1.5, True, None], [-1])
SECONDS_OR_NONE = ([None, 5e-4, 1, np.float32(0.25)], ["5e-4", True], [0.0, -1e-3, NAN, INF])

RULES = {
    "work_stealing": BOOL,
    "pause_gc": BOOL,
    "switch_interval": SECONDS_OR_NONE,
    "head_switch_interval": SECONDS_OR_NONE,
    "head_start_systems": THRESHOLD,
    "batches_per_device": COUNT,
    "batch_rows": COUNT_OR_NONE,
    "lanes_per_device": COUNT,
    "prefetch_min_nnz": THRESHOLD,
    "prefetch_small_nnz": THRESHOLD,
    "prefetch_all_cores": THRESHOLD,
    "prefetch_workers": COUNT_OR_NONE,
    "symmetry_parallel_nnz": THRESHOLD,
    "symmetry_workers": COUNT_OR_NONE,
    "ray_chunk_timeout": ([0.5, 600, 1e6], ["600", None, True], [0, -1.0, NAN, INF]),
    "sharded_check_every": COUNT,
    "sharded_cache": BOOL,
    "pack_chunk_nnz": COUNT,
    "batched_graph_max_rows": THRESHOLD,
    "batched_graph_batches": BOOL,
    "batched_compact_fraction": ([0.0, 0.5, 1.0, 1], ["0.5", None, True], [-0.1, 1.5, NAN]),
    "batched_compact_min_rows": THRESHOLD,
    "batched_vector_min_nnz_per_row": THRESHOLD,
    "batched_block_max_rows": THRESHOLD,
    "batched_block_threads": ([32, 96, 1024], ["64", 64.0, True, None], [0, 31, 100, 1056, 2048, -32]),
    "batched_block_shared_memory": BOOL,
    "batched_gmres_graphs": BOOL,
    "batched_gmres_vectorised_on_host": BOOL,
    "host_threads": COUNT_OR_NONE,
    "host_parallel_min_work": ([0, 0.0, 2e5], ["1", None, True], [-1.0, INF, NAN, 10**400]),
    "host_row_parallel_min_rows": THRESHOLD,
    "host_row_parallel_min_cores": THRESHOLD,
    "host_blas_threads": COUNT_OR_NONE,
    "lu_solve_columns": COUNT,
}


def cases(which):
    return [pytest.param(name, value, id=f"{name}={value!r:.24}")
            for name, rule in RULES.items() for value in rule[which]]


def test_every_setting_has_its_rules_here():
    assert set(RULES) == {f.name for f in dataclasses.fields(config.Settings)}


@pytest.mark.parametrize(("name", "value"), cases(0))
def test_a_value_of_the_setting_s_type_and_range_is_taken(name, value):
    with config.override(**{name: value}) as s:
        held = getattr(s, name)
        assert held == value or (held is None and value is None)
        assert getattr(config.current(), name) == held
        if value is not None:  # ints held as int, reals as float, bools as bool
            assert type(held) is type(getattr(DEFAULTS, name)) or getattr(DEFAULTS, name) is None
    assert getattr(config.Settings(**{name: value}), name) == held
    assert config.current() == DEFAULTS


@pytest.mark.parametrize(("name", "value"), cases(1))
def test_a_value_of_the_wrong_type_is_refused_naming_the_setting(name, value):
    pattern = re.escape(f"{name}={value!r}") + ".*expected"
    with pytest.raises(TypeError, match=pattern) as refused:
        with config.override(**{name: value}):
            pass
    assert isinstance(refused.value, ValueError)  # `except ValueError` catches every refusal
    with pytest.raises(TypeError, match=pattern):
        config.Settings(**{name: value})
    assert config.current() == DEFAULTS


@pytest.mark.parametrize(("name", "value"), cases(2))
def test_a_value_out_of_the_setting_s_range_is_refused_naming_the_setting(name, value):
    pattern = re.escape(f"{name}={value!r}") + ".*expected"
    with pytest.raises(ValueError, match=pattern) as refused:
        with config.override(**{name: value}):
            pass
    assert not isinstance(refused.value, TypeError)
    with pytest.raises(ValueError, match=pattern):
        config.Settings(**{name: value})
    assert config.current() == DEFAULTS


def test_the_message_says_what_is_accepted():
    with pytest.raises(ValueError, match=r"host_threads=-3 .*expected an integer >= 1 or None"):
        with config.override(host_threads=-3):
            pass
    with pytest.raises(TypeError, match=r"work_stealing='no' is a str; expected True or False"):
        with config.override(work_stealing="no"):
            pass
    with pytest.raises(ValueError, match=r"ray_chunk_timeout=nan is not finite"):
        with config.override(ray_chunk_timeout=float("nan")):
            pass
    with pytest.raises(ValueError, match=r"batched_compact_fraction=1.5 .*from 0 to 1"):
        with config.override(batched_compact_fraction=1.5):
            pass
