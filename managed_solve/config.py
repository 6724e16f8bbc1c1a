"""Library settings: one frozen :class:`Settings` object, changed only through :func:`override`.

Every tunable the library reads at run time lives here, so a run can be
reproduced from one object and a test can change a setting without touching
module globals. Environment variables are read here and nowhere else.

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
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Environment variables the library reads (see :func:`environment`): its own two,
#: and two that name where other libraries keep files (CuPy's compiled-module
#: cache, cuDSS's OpenMP threading layer).
ENV_DEVICES = "MANAGED_SOLVE_DEVICES"
ENV_SIMULATE = "MANAGED_SOLVE_SIMULATE"
ENV_CUPY_CACHE_DIR = "CUPY_CACHE_DIR"
ENV_CUDSS_THREADING_LIB = "CUDSS_THREADING_LIB"
_ENV = (ENV_DEVICES, ENV_SIMULATE, ENV_CUPY_CACHE_DIR, ENV_CUDSS_THREADING_LIB)


@dataclass(frozen=True)
class Settings:
    """Run-time settings of the library (read-only; see :func:`override`).

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

    work_stealing: bool = True
    pause_gc: bool = False
    switch_interval: float | None = None
    # -- solve_many (scheduling/)
    head_switch_interval: float | None = None
    head_start_systems: int = 256
    batches_per_device: int = 4
    batch_rows: int | None = None
    lanes_per_device: int = 2
    prefetch_min_nnz: int = 1 << 20
    prefetch_small_nnz: int = 1 << 12
    prefetch_all_cores: int = 4
    prefetch_workers: int | None = None
    # -- matrix properties (system/properties.py)
    symmetry_parallel_nnz: int = 1 << 20
    symmetry_workers: int | None = None

    # -- Ray clusters (cluster.py)
    ray_chunk_timeout: float = 600.0

    # sharded solver (managed_solve.sharded)
    sharded_check_every: int = 8
    sharded_cache: bool = True

    # -- batched Krylov engine (solvers/batched/)
    pack_chunk_nnz: int = 1 << 19
    batched_graph_max_rows: int = 1 << 20
    batched_graph_batches: bool = True
    batched_compact_fraction: float = 0.5
    batched_compact_min_rows: int = 1 << 15
    batched_vector_min_nnz_per_row: int = 32
    batched_block_max_rows: int = 1 << 14
    batched_block_threads: int = 1024
    batched_block_shared_memory: bool = True
    batched_gmres_graphs: bool = True
    batched_gmres_vectorised_on_host: bool = False
    # -- host threads: the batched kernels, solve_many's input checks, LU solves (_threads.py;
    #    host_blas_threads: _backend.py)
    host_threads: int | None = None
    host_parallel_min_work: float = 2e5
    host_row_parallel_min_rows: int = 1 << 18
    host_row_parallel_min_cores: int = 4
    host_blas_threads: int | None = None
    # -- direct solves on the host (solvers/direct.py)
    lu_solve_columns: int = 4

    def __post_init__(self) -> None:
        rows = self.batched_block_max_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"override(batched_block_max_rows={rows!r}): expected an integer "
                             ">= 0 (rows of a batch's largest system; 0 turns the route off)")
        threads = self.batched_block_threads
        if (isinstance(threads, bool) or not isinstance(threads, int) or threads % 32
                or not 32 <= threads <= 1024):
            raise ValueError(f"override(batched_block_threads={threads!r}): expected a multiple "
                             "of 32 from 32 to 1024 (threads of a CUDA block)")
        shared = self.batched_block_shared_memory
        if not isinstance(shared, bool):
            raise ValueError(f"override(batched_block_shared_memory={shared!r}): expected True or "
                             "False (whether a block per system keeps its vectors in shared memory)")
        lanes = self.lanes_per_device
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"override(lanes_per_device={lanes!r}): expected an integer >= 1 "
                             "(1 computes one batch at a time on each accelerator)")

    def replace(self, **changes) -> Settings:
        """A copy with ``changes`` applied (names checked, see :func:`override`)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(
                f"override({', '.join(unknown)}=...): no such setting; "
                f"the settings are {', '.join(sorted(names))}."
            )
        return dataclasses.replace(self, **changes)


_lock = threading.Lock()
_current = Settings()


def current() -> Settings:
    """The settings in force now (the same object for every thread)."""
    return _current


@contextmanager
def override(**changes) -> Iterator[Settings]:
    """Change settings for the duration of a ``with`` block (process-wide).

    The settings are process-wide, not thread-local: worker threads started
    by ``solve_many`` read the same object. Blocks may nest; each restores
    what it found.

    Raises
    ------
    TypeError
        A name that is not a setting.
    """
    global _current
    with _lock:
        previous = _current
        _current = previous.replace(**changes)
    try:
        yield _current
    finally:
        with _lock:
            _current = previous


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
