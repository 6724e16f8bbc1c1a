"""Library settings: one frozen :class:`Settings` object, changed only through :func:`override`.

Every tunable the library reads at run time lives here, so a run can be
reproduced from one object and a test can change a setting without touching
module globals. Each value is checked where it is set, so a wrong one is
refused naming the setting instead of failing inside a later solve.
Environment variables are read here and nowhere else.

Examples
--------
>>> import managed_solve as ms
>>> ms.config.current().work_stealing
True
>>> with ms.config.override(work_stealing=False):
...     ms.config.current().work_stealing
False
>>> ms.config.current().work_stealing
True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

#: Environment variables the library reads (see :func:`environment`): its own two,
#: and two that name where other libraries keep files (CuPy's compiled-module
#: cache, cuDSS's OpenMP threading layer).
ENV_DEVICES = "MANAGED_SOLVE_DEVICES"
ENV_SIMULATE = "MANAGED_SOLVE_SIMULATE"
ENV_CUPY_CACHE_DIR = "CUPY_CACHE_DIR"
ENV_CUDSS_THREADING_LIB = "CUDSS_THREADING_LIB"
_ENV = (ENV_DEVICES, ENV_SIMULATE, ENV_CUPY_CACHE_DIR, ENV_CUDSS_THREADING_LIB)


_ACCEPTS = "managed_solve.accepts"


class SettingTypeError(TypeError, ValueError):
    """A setting given a value of the wrong type (a ``str`` where an integer is expected).

    A ``TypeError``, and a ``ValueError`` too, so ``except ValueError``
    around :func:`override` catches every refused value.
    """


@dataclass(frozen=True)
class _Accepts:
    """The values one setting accepts: its type, its range, whether None."""

    kind: type  # bool, int (integers, not bools) or float (finite reals)
    least: float | None = None  # smallest value accepted
    above: float | None = None  # values must be greater than this
    most: float | None = None  # largest value accepted
    step: int | None = None  # values are multiples of this
    optional: bool = False  # None accepted
    why: str = ""  # what the bounds mean, where the docstring's words are not obvious

    def describe(self) -> str:
        """The accepted values in words, for an error message."""
        if self.kind is bool:
            text = "True or False"
        else:
            text = "an integer" if self.kind is int else "a finite number"
            if self.step is not None:
                text += f", a multiple of {self.step},"
            if self.least is not None and self.most is not None:
                text += f" from {self.least:g} to {self.most:g}"
            elif self.least is not None:
                text += f" >= {self.least:g}"
            elif self.above is not None:
                text += f" > {self.above:g}"
        if self.optional:
            text += " or None"
        return text + (f" ({self.why})" if self.why else "")

    def check(self, name: str, value: object) -> object:
        """``value`` as the setting holds it (ints as int, reals as float); refused when out of bounds."""
        if value is None and self.optional:
            return None
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        else:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not ok:
            raise SettingTypeError(f"setting {name}={value!r} is a {type(value).__name__}; "
                                   f"expected {self.describe()}")
        if self.kind is bool:
            return value
        try:
            number = self.kind(value)
        except OverflowError:  # an integer beyond a float's range, given to a float setting
            number = math.inf
        if self.kind is float and not math.isfinite(number):
            raise ValueError(f"setting {name}={value!r} is not finite; expected {self.describe()}")
        if ((self.least is not None and number < self.least)
                or (self.above is not None and number <= self.above)
                or (self.most is not None and number > self.most)
                or (self.step is not None and number % self.step)):
            raise ValueError(f"setting {name}={value!r} is out of range; expected {self.describe()}")
        return number


def _setting(default: object, kind: type, **accepts) -> Any:
    """A field of :class:`Settings` with its default and the values it accepts (``_Accepts``)."""
    return dataclasses.field(default=default, metadata={_ACCEPTS: _Accepts(kind, **accepts)})


@dataclass(frozen=True)
class Settings:
    """Run-time settings of the library (read-only; see :func:`override`).

    Every value is checked when it is set (``Settings(...)``,
    :func:`override`), against the type and range its entry below gives:
    bool settings take ``True`` or ``False`` only, int settings integers
    (not bools, not strings), float settings finite real numbers, and None
    only where the entry says so. Counts (threads, workers, batches, lanes,
    rows per batch, entries per piece, iterations, columns) are at least 1;
    thresholds (the size, work or cores from which something happens) at
    least 0; seconds greater than 0; a fraction from 0 to 1. A wrong type
    raises :class:`SettingTypeError`, a value out of range ``ValueError``,
    both naming the setting, the value and the values accepted.

    Attributes
    ----------
    work_stealing : bool
        In ``solve_many``, a device whose queue runs dry takes batches queued
        on a slower device of the same kind. Off, every batch runs where the
        plan put it (placement then depends on the plan alone, not on timing).
    pause_gc : bool
        ``solve_many`` pauses Python's cyclic garbage collector while it runs
        (its pauses stall the threads that feed the GPUs). Process-wide, so
        off unless the caller opts in.
    switch_interval : float or None
        Seconds for ``sys.setswitchinterval`` while ``solve_many`` feeds two or
        more GPUs (a shorter interval, e.g. 5e-4, hands the GIL to the
        GPU-feeding threads sooner). Process-wide, so None (unchanged) unless
        the caller opts in.
    head_switch_interval : float or None
        Seconds for ``sys.setswitchinterval`` while ``solve_many`` estimates
        and plans beside workers it already started (see
        ``head_start_systems``; e.g. 1e-4: the started workers' many CUDA calls
        each wait for the GIL). None (unchanged) unless the caller opts in.
    head_start_systems : int
        A ``solve_many`` call with more systems than this (on accelerators)
        starts the systems that run alone before the others are estimated
        and planned.
    batches_per_device : int
        Batches each device should get at least, so longest-first dispersal
        has small pieces left to even out the finish times.
    batch_rows : int or None
        Rows per batch, replacing the rule of ``batches_per_device`` and the
        device kind's target (None: that rule).
    lanes_per_device : int
        Batches each accelerator computes at once in ``solve_many``, each on
        its own CUDA stream (its own worker thread): a batch staged while
        another computes starts at once, and two batches of small systems
        fill the GPU where one leaves it partly idle. 1 computes them in turn.
    prefetch_min_nnz : int
        Host matrices with at least this many stored entries have their
        "auto" method tested on helper threads while ``solve_many`` estimates
        the other systems.
    prefetch_small_nnz : int
        On hosts of at least ``prefetch_all_cores`` cores, every distinct
        host matrix with at least this many entries is tested there (after
        the large ones), one helper-thread task each. Only matrices the
        many-matrix pass cannot read go this way (those not in canonical
        form); the others, below ``prefetch_min_nnz`` and
        ``symmetry_parallel_nnz``, are tested many a kernel call on every
        core from the start of the call, beside validation.
    prefetch_all_cores : int
        Cores from which the small matrices' tests go to helper threads too.
    prefetch_workers : int or None
        Helper threads for those tests (None: half the cores, 2 to 8).
    symmetry_parallel_nnz : int
        Host CSR matrices with at least this many stored entries have their
        symmetry and diagonal tested in row chunks on helper threads.
    symmetry_workers : int or None
        Threads for those chunked tests (None: up to 8, one per core). Fewer
        than four runs the one-pass test on the calling thread.
    ray_chunk_timeout : float
        Seconds a chunk of systems may stay with one Ray actor before the
        actor counts as hung and the chunk goes to another (the first answer
        wins, so a late one is not counted twice).
    sharded_check_every : int
        Iterations between host reads of the residual in a sharded solve on
        GPUs: each read drains every device's queue, the iterations in
        between cost nothing extra, so a solve runs up to this many
        iterations past convergence. Simulated devices read every iteration
        (a read is free there). ``check_every=`` of a call overrides it.
    sharded_cache : bool
        ``solve_sharded`` keeps the set-up of a matrix (partition, arrays on
        the devices) while the matrix object lives, so the next solve with
        it skips the set-up. Off, every call sets up again and the device
        memory is released after the solve.
    pack_chunk_nnz : int
        Batched engine: stored entries per piece when host systems are copied
        into a batch (one piece per thread of the packing pool).
    batched_graph_max_rows : int
        Batched engine (GPU): a single system of at most this many rows
        replays its CG/BiCGStab iterations as CUDA graphs; above it an
        iteration's kernels are long enough to hide launch latency.
    batched_graph_batches : bool
        Batched engine (GPU): batches of several systems replay CUDA graphs
        at every size (off: only up to ``batched_graph_max_rows``).
    batched_compact_fraction : float
        Batched engine (GPU): once the running systems hold at most this
        fraction of the rows the kernels walk, the kernels walk only theirs.
    batched_compact_min_rows : int
        Batched engine (GPU): no compaction below this many rows walked.
    batched_vector_min_nnz_per_row : int
        Batched engine (GPU): mean stored entries per row from which the
        products use a warp per row instead of a thread per row.
    batched_block_max_rows : int
        Batched engine (GPU): a CG batch of several systems, none of over
        this many rows, runs with a thread block per system, every
        iteration in one launch (0: always the row kernels).
    batched_block_threads : int
        Batched engine (GPU): threads of a block that iterates one system
        (a multiple of 32, at most 1024).
    batched_block_shared_memory : bool
        Batched engine (GPU): a block keeps its system's p, q and x in
        shared memory when the batch's largest system fits there (off:
        in device memory; the iterates are the same).
    batched_gmres_graphs : bool
        Batched engine (GPU): GMRES replays a chunk of Arnoldi steps seen in
        an earlier restart cycle as a CUDA graph (off: direct launches).
    batched_gmres_vectorised_on_host : bool
        Batched engine: NumPy batches run GMRES's whole-batch device loop
        instead of the per-system Numba kernel (for comparing the two).
    host_threads : int or None
        Threads a batch on the CPU uses at most (the calling thread
        included; None: one per core this process may run on, at most
        ``NUMBA_NUM_THREADS``). 1 keeps every host kernel of a batch on the
        calling thread.
    host_parallel_min_work : float
        Predicted work of a CPU batch (stored entries plus rows, times
        predicted iterations; about a nanosecond each on one core) below
        which it runs on the calling thread alone: waking a helper costs
        tens of microseconds.
    host_row_parallel_min_rows : int
        Rows from which one system alone on the CPU sweeps its rows on
        several threads (on hosts of ``host_row_parallel_min_cores`` cores
        or more); below, or on fewer cores, its sweeps are serial.
    host_row_parallel_min_cores : int
        Cores a host needs for the row-parallel sweeps of one system: each
        sweep ends at a barrier that waits for the slowest thread, which on
        a small host shared with other processes costs more than the second
        core gives.
    host_blas_threads : int or None
        Threads of the OpenBLAS behind SciPy's BLAS while a ``solve_many``
        call runs (None: left as they are). The call's host LU workers (the
        supernodal Cholesky's dense products) each call BLAS beside the
        batched kernels' threads; a threaded BLAS then runs more threads
        than there are cores, and 1 keeps each worker on its own core. A
        process-wide setting, held for the call and given back after the
        last concurrent call ends; no effect where SciPy's BLAS is not an
        OpenBLAS this package finds.
    lu_solve_columns : int
        Columns a host LU (SuperLU) solves a call when it solves a block of
        right-hand sides: in pieces this narrow BLAS keeps each supernode's
        small products on the calling thread, where with wider pieces it
        hands them to its threads at a cost above the work
        (:mod:`managed_solve.solvers.direct`).
    """

    work_stealing: bool = _setting(True, bool)
    pause_gc: bool = _setting(False, bool)
    switch_interval: float | None = _setting(None, float, above=0.0, optional=True)
    # -- solve_many (scheduling/)
    head_switch_interval: float | None = _setting(None, float, above=0.0, optional=True)
    head_start_systems: int = _setting(256, int, least=0)
    batches_per_device: int = _setting(4, int, least=1)
    batch_rows: int | None = _setting(None, int, least=1, optional=True)
    lanes_per_device: int = _setting(2, int, least=1,
                                     why="1 computes one batch at a time on each accelerator")
    prefetch_min_nnz: int = _setting(1 << 20, int, least=0)
    prefetch_small_nnz: int = _setting(1 << 12, int, least=0)
    prefetch_all_cores: int = _setting(4, int, least=0)
    prefetch_workers: int | None = _setting(None, int, least=1, optional=True)
    # -- matrix properties (system/properties.py)
    symmetry_parallel_nnz: int = _setting(1 << 20, int, least=0)
    symmetry_workers: int | None = _setting(None, int, least=1, optional=True)

    # -- Ray clusters (cluster.py)
    ray_chunk_timeout: float = _setting(600.0, float, above=0.0)

    # sharded solver (managed_solve.sharded)
    sharded_check_every: int = _setting(8, int, least=1)
    sharded_cache: bool = _setting(True, bool)

    # -- batched Krylov engine (solvers/batched/)
    pack_chunk_nnz: int = _setting(1 << 19, int, least=1)
    batched_graph_max_rows: int = _setting(1 << 20, int, least=0)
    batched_graph_batches: bool = _setting(True, bool)
    batched_compact_fraction: float = _setting(0.5, float, least=0.0, most=1.0)
    batched_compact_min_rows: int = _setting(1 << 15, int, least=0)
    batched_vector_min_nnz_per_row: int = _setting(32, int, least=0)
    batched_block_max_rows: int = _setting(1 << 14, int, least=0,
                                           why="rows of a batch's largest system; 0 turns the route off")
    batched_block_threads: int = _setting(1024, int, least=32, most=1024, step=32,
                                          why="threads of a CUDA block")
    batched_block_shared_memory: bool = _setting(True, bool)
    batched_gmres_graphs: bool = _setting(True, bool)
    batched_gmres_vectorised_on_host: bool = _setting(False, bool)
    # -- host threads: the batched kernels, solve_many's input checks, LU solves (_threads.py;
    #    host_blas_threads: _backend.py)
    host_threads: int | None = _setting(None, int, least=1, optional=True)
    host_parallel_min_work: float = _setting(2e5, float, least=0.0)
    host_row_parallel_min_rows: int = _setting(1 << 18, int, least=0)
    host_row_parallel_min_cores: int = _setting(4, int, least=0)
    host_blas_threads: int | None = _setting(None, int, least=1, optional=True)
    # -- direct solves on the host (solvers/direct.py)
    lu_solve_columns: int = _setting(4, int, least=1)

    def __post_init__(self) -> None:
        # Checked where a value is set, so a wrong one is refused naming the
        # setting instead of failing later inside a solve that reads it.
        for f in dataclasses.fields(self):
            value = f.metadata[_ACCEPTS].check(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)

    def replace(self, **changes) -> Settings:
        """A copy with ``changes`` applied (names and values checked, see :func:`override`)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(
                f"override({', '.join(unknown)}=...): no such setting; "
                f"the settings are {', '.join(sorted(names))}."
            )
        return dataclasses.replace(self, **changes)


_DEFAULTS = Settings()
_lock = threading.Lock()
# The changes of the override blocks now entered, by an entry number, in the
# order entered; the settings in force are derived from them alone, so a block
# that leaves takes out its own changes and nobody else's.
_active: dict[int, dict[str, object]] = {}
_entries = itertools.count()
_current = _DEFAULTS


def _recompute() -> None:
    """Set the settings in force from the active blocks (the caller holds ``_lock``)."""
    global _current
    merged: dict[str, object] = {}
    for changes in _active.values():
        merged.update(changes)
    _current = dataclasses.replace(_DEFAULTS, **merged) if merged else _DEFAULTS


def current() -> Settings:
    """The settings in force now (the same object for every thread; see :func:`override`)."""
    return _current


@contextmanager
def override(**changes) -> Iterator[Settings]:
    """Change settings for the duration of a ``with`` block (process-wide).

    The settings in force are the defaults with the changes of every block
    now active applied in the order the blocks were entered: where two
    active blocks set the same setting, the one entered later wins while it
    is active. Leaving a block takes out its own changes only, whatever the
    thread and whatever the order blocks are left in (an exception leaving
    the block too); once every block has been left, the defaults are in
    force again. Nested blocks on one thread therefore behave as a stack:
    leaving the inner block brings back what the outer one set.

    The settings are process-wide, not thread-local: every thread reads the
    same object through :func:`current`, so the worker threads that
    ``solve_many`` starts see the caller's block. So does every other thread
    of the process: a block entered on one thread changes what a concurrent
    call on another thread reads, for as long as the block is active. Run
    calls that need different values of one setting in turn (or in separate
    processes), not concurrently.

    Parameters
    ----------
    **changes
        Settings of :class:`Settings` and their values, each checked here
        (type and range, as that setting's documentation says) before any
        setting changes.

    Yields
    ------
    Settings
        The settings in force once the block is entered.

    Raises
    ------
    TypeError
        A name that is not a setting, or a value of the wrong type
        (:class:`SettingTypeError`, a ``ValueError`` too).
    ValueError
        A value out of the setting's range, or a float that is not finite.

    Examples
    --------
    >>> import managed_solve as ms
    >>> with ms.config.override(batches_per_device=8):
    ...     with ms.config.override(batches_per_device=2, work_stealing=False):
    ...         (ms.config.current().batches_per_device, ms.config.current().work_stealing)
    ...     ms.config.current().batches_per_device
    (2, False)
    8
    >>> ms.config.current().batches_per_device
    4
    """
    checked = _DEFAULTS.replace(**changes)
    mine = {name: getattr(checked, name) for name in changes}
    with _lock:
        entry = next(_entries)
        _active[entry] = mine
        _recompute()
        entered = _current
    try:
        yield entered
    finally:
        with _lock:
            del _active[entry]
            _recompute()


def environment(name: str) -> str | None:
    """The value of one of the library's environment variables, read now (None when unset).

    The variables are read at call time, so a process may set them after
    importing the package.
    """
    if name not in _ENV:
        raise ValueError(f"environment({name!r}): not a variable this library reads; "
                         f"expected one of {', '.join(_ENV)}.")
    value = os.environ.get(name)
    return value if value else None
