"""``AMGPreconditioner``: a smoothed-aggregation hierarchy applied as one V-cycle, ``r -> M r``.

The set-up runs where the matrix lives: on a GPU our own set-up
(:mod:`.hierarchy`, CuPy and cupyx); on the CPU PyAMG's
``smoothed_aggregation_solver`` by default (our set-up stays selectable with
``setup="native"``, the same code as on the GPU). Either way the V-cycle
is ours, unless ``cycle="pyamg"`` hands the application to PyAMG's own
(Gauss-Seidel smoothed) preconditioner on the host: on the host
:class:`~.cycle.VCycle`, on a GPU the fused kernels of :mod:`.fused`
(``cycle.cu``), captured as one CUDA graph.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ... import _backend
from ...system.cost import amg_bytes
from . import hierarchy
from .cycle import VCycle
from .fused import FusedCycle
from .pyamg_setup import aggregation_operators, improve_candidates, levels_of, pyamg_solver
from .smoothers import NAMES as SMOOTHERS
from .smoothers import make_smoother

SETUPS = ("auto", "native", "pyamg")
#: Streams (each with a cycle of its own) a GPU block's columns are spread over.
BLOCK_LANES = 4
#: Default Chebyshev degrees (see ``degree`` of :class:`AMGPreconditioner`).
#: CG iterations to rtol 1e-8 on 2D Poisson 511^2 / 1023^2 and 3D 48^3, our
#: set-up: degree 1: 13 / 15 / 9, degree 2: 11 / 14 / 8, degree 3: 11 / 13 / 7,
#: at 11, 15.6 and 20.2 matrix-passes' worth of bytes a cycle (2D).
GPU_DEGREE, HOST_DEGREE = 1, 2
CYCLES = ("auto", "native", "pyamg")


class AMGPreconditioner:
    """Smoothed-aggregation algebraic multigrid as a preconditioner (one V-cycle per call).

    Parameters
    ----------
    A : scipy.sparse or cupyx.scipy.sparse matrix
        Square; CSR, or BSR (its block size becomes ``blocksize``).
    setup : {"auto", "native", "pyamg"}
        Who builds the hierarchy. ``"auto"``: PyAMG for a matrix on the CPU
        when PyAMG is installed, else our set-up (always on a GPU).
    nullspace : array (n, K), optional
        Near-null-space vectors (constants by default; rigid-body modes for
        elasticity).
    blocksize : int, optional
        Unknowns per node: aggregation keeps a node's unknowns together.
    theta : float
        Strength threshold of the symmetric measure (0 keeps all couplings;
        :data:`~.hierarchy.THETA` by default, for either set-up).
    smoother : {"chebyshev", "jacobi", "l1_jacobi"}
    degree : int, optional
        Chebyshev polynomial degree (SpMVs per smoothing). By default 1 on a
        GPU, 2 on the host. On a GPU a cycle streams the matrix ``2 degree + 2``
        times and costs its bytes: degree 1 reads it 4 times against 6, for
        one or two more CG iterations on 2D and 3D Poisson (a fifth less
        memory traffic to the same tolerance); on the host the degree-2
        cycle keeps the iteration counts of PyAMG's.
    sweeps : int
        Jacobi steps per smoothing.
    max_coarse, max_levels : int
        Coarsening stops at ``max_coarse`` unknowns or ``max_levels`` levels;
        the coarsest matrix is inverted densely.
    dtype : dtype, optional
        Precision of the V-cycle (e.g. ``"float32"`` inside a float64 Krylov
        loop: the residual is cast down, cycled and cast up). A's by default.
    cycle : {"auto", "native", "pyamg"}
        Who applies the V-cycle: ours, or PyAMG's (host, ``setup="pyamg"``).
    graph : bool, optional
        Capture the V-cycle as a CUDA graph (CuPy only; on by default there).
    seed : int
        Seed of the aggregation's pseudo-random priorities.

    Attributes
    ----------
    levels : list of Level
    operator_complexity, grid_complexity : float
    nbytes : int
        Memory the hierarchy adds to A (coarse matrices, transfers, work vectors).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.amg import amg
    >>> T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(40, 40))
    >>> A = sp.kronsum(T, T).tocsr()
    >>> M = amg(A, setup="native", max_coarse=50)
    >>> len(M.levels) > 1, bool(M(np.ones(1600)) @ np.ones(1600) > 0)
    (True, True)
    """

    def __init__(self, A: Any, *, setup: str = "auto", nullspace: Any = None,
                 blocksize: int | None = None, theta: float = hierarchy.THETA, smoother: str = "chebyshev",
                 degree: int | None = None, sweeps: int = 1, max_coarse: int = 500, max_levels: int = 10,
                 dtype: Any = None, cycle: str = "auto", graph: bool | None = None,
                 seed: int = 0):
        if not (_backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A)):
            raise TypeError(f"amg(A): A must be a scipy.sparse or cupyx.scipy.sparse matrix, got "
                            f"{type(A).__name__}. M='amg' needs the matrix's entries; pass M=None "
                            "or 'jacobi' for an operator.")
        if A.ndim != 2 or A.shape[0] != A.shape[1]:
            raise ValueError(f"amg(A): A must be square, got shape {A.shape}.")
        if setup not in SETUPS:
            raise ValueError(f"amg(setup={setup!r}): expected one of {', '.join(SETUPS)}.")
        if cycle not in CYCLES:
            raise ValueError(f"amg(cycle={cycle!r}): expected one of {', '.join(CYCLES)}.")
        if smoother not in SMOOTHERS:
            raise ValueError(f"amg(smoother={smoother!r}): expected one of {', '.join(SMOOTHERS)}.")
        self.xp = _backend.array_module(A.data)
        self.sparse = _backend.sparse_module(self.xp)
        if blocksize is None:
            blocksize = A.blocksize[0] if getattr(A, "format", "") == "bsr" else 1
        self.blocksize = int(blocksize)
        A = A.tocsr()
        n = A.shape[0]
        if self.blocksize < 1 or n % self.blocksize:
            raise ValueError(f"amg(blocksize={blocksize!r}): must divide n = {n}.")
        on_host = self.xp is np
        if setup == "auto":
            setup = "pyamg" if on_host and _backend.optional_module("pyamg") is not None \
                else "native"
        if setup == "pyamg" and not on_host:
            raise ValueError("amg(setup='pyamg'): PyAMG runs on the host; A is on a GPU. Use "
                             "setup='native' (the default there).")
        if cycle == "pyamg" and setup != "pyamg":
            raise ValueError("amg(cycle='pyamg') applies PyAMG's own hierarchy: it needs "
                             "setup='pyamg'.")
        self.setup = setup
        self.cycle = "native" if cycle == "auto" else cycle
        self.nullspace = self._check_nullspace(nullspace, n)
        if degree is None:
            degree = GPU_DEGREE if not on_host else HOST_DEGREE
        self.theta, self.smoother, self.degree, self.sweeps = float(theta), smoother, degree, sweeps
        self.max_coarse, self.max_levels, self.seed = int(max_coarse), int(max_levels), int(seed)
        self.dtype = np.dtype(dtype) if dtype is not None else np.dtype(A.dtype)
        self.graph = (not on_host) if graph is None else bool(graph) and not on_host
        self.shape = A.shape
        #: Krylov loops read their residual every ``check_every`` iterations. A
        #: cycle costs milliseconds on a GPU, against microseconds for the read,
        #: so every iteration (no iterations past convergence); None: the loop's own.
        self.check_every = None if on_host else 1
        self._ml: Any = None
        self._build(A)

    def _check_nullspace(self, B: Any, n: int) -> Any:
        xp = self.xp
        if B is None:
            return None  # the constants, made where the set-up needs them (not kept)
        B = xp.asarray(B, dtype=xp.float64)
        if B.ndim == 1:
            B = B[:, None]
        if B.ndim != 2 or B.shape[0] != n or B.shape[1] < 1:
            raise ValueError(f"amg(nullspace=...): expected an array of shape (n, K) with n = {n}, "
                             f"got shape {tuple(B.shape)}.")
        return B

    # -- set-up ----------------------------------------------------------------
    def _build(self, A: Any, kept: list | None = None) -> None:
        """The set-up; ``kept``: the levels whose aggregates PyAMG is handed (its own cycle's
        numeric re-setup)."""
        B = self.nullspace
        if B is None:
            B = self.xp.ones((A.shape[0], 1), dtype=self.xp.float64)
        if self.setup == "pyamg":
            ml = pyamg_solver(A, B, theta=self.theta, max_coarse=self.max_coarse,
                              max_levels=self.max_levels,
                              aggregates=None if kept is None else aggregation_operators(kept))
            self._ml = ml
            levels = levels_of(ml, self.xp)
            # The couplings that hold the aggregates together, tested on update
            # (PyAMG's strength measure is ours, on the scalar entries it was given).
            levels[0].strong = kept[0].strong if kept is not None else hierarchy.held_bits(
                levels[0], self.theta, self.xp, self.sparse)
        else:
            levels = hierarchy.build(
                A, B, self.xp, self.sparse, theta=self.theta,
                blocksize=self.blocksize, max_coarse=self.max_coarse,
                max_levels=self.max_levels, seed=self.seed)
        # The candidates as given (None: the constants): a re-setup relaxes and
        # refits from them, as the set-up did.
        levels[0].B = self.nullspace
        self.levels = levels
        self._make_cycle()

    def _cast(self, M: Any) -> Any:
        """``M`` with its values in the cycle's dtype (a copy only where it differs; indices shared)."""
        dt = self.dtype
        if M is None or M.dtype == dt:
            return M
        C = self.sparse.csr_matrix((M.data.astype(dt), M.indices, M.indptr), shape=M.shape)
        C.indices, C.indptr = M.indices, M.indptr  # the constructor may have copied them
        return C

    def _make_cycle(self, checked: bool = False) -> None:
        """The cycle over ``self.levels``; ``checked``: the same kernel sequence's capture was
        checked before (a numeric re-setup), so this one's is not checked again."""
        xp, dt = self.xp, self.dtype
        cast = self._cast
        self._block: Any = None  # the block cycle of the last width used, made on use
        self._lane_list: Any = None  # GPU: cycles and streams for blocks, made on use

        smoothers = []
        for lev in self.levels[:-1]:
            smoothers.append(make_smoother(self.smoother, lev.A, lev.dinv.astype(dt, copy=False),
                                           lev.rho, xp, degree=self.degree, sweeps=self.sweeps))
        inv = hierarchy.coarse_inverse(self.levels[-1].A, xp).astype(dt)
        for i, lev in enumerate(self.levels):  # a lower-precision cycle: no higher copies kept
            lev.A, lev.P = (lev.A if i == 0 else cast(lev.A)), cast(lev.P)
        if xp is np:
            mats = [(cast(lev.A), cast(lev.P)) for lev in self.levels]
            self._cycle: Any = VCycle(xp, mats, smoothers, inv, dt)
        else:
            from .kernels import CudaOps  # CuPy only

            ops = CudaOps(dt, xp.cuda.Device().id)
            self._cycle = FusedCycle(xp, ops, csr_arrays(self.levels, dt, xp), smoothers, inv, dt)
        for lev in self.levels:
            lev.dinv = None  # a set-up temporary: the smoothers hold their scaling
        self._pyamg_M = self._ml.aspreconditioner(cycle="V") if self.cycle == "pyamg" else None
        if self.graph:
            self._cycle.capture(xp, check=not checked)

    def update(self, values: Any) -> None:
        """New values of A on the same pattern: keep the aggregates, recompute the rest.

        ``values``: A's ``data`` array in CSR order, or a matrix of the same
        pattern (stored any way: unsorted rows and duplicate entries are
        brought to A's canonical form first). Everything numeric is set up
        again on the new values (the relaxed near-null space, the tentative
        and smoothed prolongators and their damping, the Galerkin levels,
        the smoothers, the coarse inverse); the aggregates, which follow the
        strength of A's couplings, are kept unless the new values weaken a
        coupling inside one of them (:func:`~.hierarchy.weakened_inside`),
        where the whole set-up is redone. A preconditioner passed as ``M=`` to a
        :class:`~managed_solve.Solver` is the caller's: ``Solver.update``
        leaves it as it is, and this method refreshes it.

        Raises
        ------
        ValueError
            A matrix of another pattern (its values would be read on A's
            pattern), or values of another count; the hierarchy is left as
            it was.
        """
        A0 = self.levels[0].A
        if hasattr(values, "tocsr"):
            B = hierarchy.as_csr(values)  # unsorted or duplicate entries: A0's canonical form
            if not self._same_pattern(B, A0):
                raise ValueError(
                    f"AMGPreconditioner.update(A2): A2 has another sparsity pattern than the "
                    f"matrix the hierarchy was set up on (shape {B.shape}, {B.nnz} stored entries "
                    f"against {A0.shape}, {A0.nnz}, or as many in other places); update takes new "
                    "values on the same pattern. Set up a new preconditioner for the new "
                    "pattern: amg(A2).")
            data = B.data
        else:
            data = self.xp.asarray(values)
            if data.shape != A0.data.shape:
                raise ValueError(f"AMGPreconditioner.update(values): expected {A0.nnz} values, "
                                 f"got shape {tuple(data.shape)}.")
        A = self.sparse.csr_matrix((data.astype(A0.dtype), A0.indices, A0.indptr), shape=A0.shape)
        A.has_canonical_format = True  # A0's pattern, made canonical at set-up: not checked again
        xp, sparse = self.xp, self.sparse
        if hierarchy.weakened_inside(self.levels[0], A, self.theta, xp, sparse):
            self._build(A)  # the kept aggregates no longer follow A's strong couplings
        elif self.cycle == "pyamg":  # PyAMG's own cycle needs PyAMG's own levels
            self._build(A, kept=self.levels)
        else:
            hierarchy.refresh(self.levels, A, xp, sparse, improve=improve_candidates
                              if self.setup == "pyamg" else hierarchy.relax_candidates)
            self._make_cycle(checked=getattr(self._cycle, "graph", None) is not None)

    def _same_pattern(self, B: Any, A0: Any) -> bool:
        """Whether the canonical CSR ``B`` has A0's pattern: its index arrays, or equal ones.

        The re-setup puts B's values on A0's pattern, whose Galerkin products
        it reuses: values stored elsewhere would make another matrix. Arrays
        A0 shares need no reading; others are compared where A0 lies.
        """
        if B.shape != A0.shape or B.nnz != A0.nnz:
            return False
        if B.indptr is A0.indptr and B.indices is A0.indices:
            return True
        xp = self.xp
        return bool(xp.array_equal(xp.asarray(B.indptr), A0.indptr)) and \
            bool(xp.array_equal(xp.asarray(B.indices), A0.indices))  # sync: once an update

    # -- application -------------------------------------------------------------
    def __call__(self, r: Any) -> Any:
        """One V-cycle: ``M r`` (r of shape (n,) or (n, k)), in r's dtype."""
        if getattr(r, "ndim", 1) == 2:
            if self._pyamg_M is None and isinstance(self._cycle, VCycle):
                return self._block_cycle(r.shape[1]).apply(r, r.dtype)
            if self._pyamg_M is None and isinstance(self._cycle, FusedCycle):
                return self._lanes_apply(r)
            return self.xp.stack([self(r[:, j]) for j in range(r.shape[1])], axis=1)
        if self._pyamg_M is not None:
            return self._pyamg_M.matvec(r).astype(r.dtype, copy=False)
        return self._cycle.apply(r, r.dtype)

    matvec = __call__

    def _lanes_apply(self, R: Any) -> Any:
        """``M R`` for a GPU block: one fused cycle a column, the columns spread over streams.

        A fused cycle (a CUDA graph a vector) beats one cycle of library
        SpMMs over the whole block (figures in docs/performance.md), but its
        coarse levels are short kernels that leave the GPU mostly idle; up
        to :data:`BLOCK_LANES` cycles, each with its own vectors and graph
        on its own stream, overlap them. The answer is column-major, the
        GPU blocks' layout.
        """
        xp = self.xp
        n, k = R.shape
        lanes = self._lanes(k)
        out = xp.empty((n, k), dtype=R.dtype, order="F")
        main = xp.cuda.get_current_stream()
        ready = main.record()
        for _cycle, stream in lanes:
            stream.wait_event(ready)  # R is made on the caller's stream
        for j in range(k):
            cycle, stream = lanes[j % len(lanes)]
            with stream:
                xp.copyto(cycle.b[0], R[:, j], casting="unsafe")
                if cycle.graph is not None:
                    cycle.graph.launch()
                else:
                    cycle.run()
                xp.copyto(out[:, j], cycle.result(), casting="unsafe")
        for _cycle, stream in lanes:
            main.wait_event(stream.record())
        return out

    def _lanes(self, k: int) -> list[tuple[Any, Any]]:
        """Cycles and streams for :meth:`_lanes_apply`: the preconditioner's own cycle first.

        More lanes are made (once) only while their vectors take at most a
        tenth of the GPU's free memory.
        """
        xp, c = self.xp, self._cycle
        if self._lane_list is None:
            self._lane_list = [(c, xp.cuda.Stream(non_blocking=True))]
        want = min(int(k), BLOCK_LANES)
        if len(self._lane_list) < want:
            free, _total = xp.cuda.runtime.memGetInfo()
            per = max(1, c.nbytes() - int(c.coarse_inv.nbytes))
            want = min(want, len(self._lane_list) + int(0.1 * free) // per)
            while len(self._lane_list) < want:
                lane = FusedCycle(xp, c.ops, c.mats, c.smoothers, c.coarse_inv, self.dtype)
                if c.graph is not None:  # the own cycle's capture was checked: so is this one's
                    lane.capture(xp, check=False)
                self._lane_list.append((lane, xp.cuda.Stream(non_blocking=True)))
        return self._lane_list[:max(1, min(int(k), len(self._lane_list)))]

    def _block_cycle(self, k: int) -> VCycle:
        """The host V-cycle on (n, k) blocks: each level's matrices read once for all k columns.

        The same levels, smoothers and coarse inverse as the one-vector
        cycle, every product an SpMM, so a block's columns get what k
        one-vector cycles give (up to rounding) in less time on the host
        (figures in docs/performance.md). Kept for the last width used (its
        vectors are k times a cycle's).
        """
        if self._block is None or self._block.x[0].shape[1] != k:
            c = self._cycle
            smoothers = [dataclasses.replace(sm, dinv=sm.dinv[:, None]) for sm in c.smoothers]
            self._block = None  # the previous width's vectors go first
            self._block = VCycle(self.xp, c.mats, smoothers, c.coarse_inv, self.dtype, columns=k)
        return self._block

    @property
    def fused_cycle(self) -> FusedCycle | None:
        """The fused GPU cycle (a CG loop binds it to its own vectors), None on the host."""
        return self._cycle if isinstance(self._cycle, FusedCycle) and self._pyamg_M is None \
            else None

    # -- reports -------------------------------------------------------------------
    @property
    def operator_complexity(self) -> float:
        """Stored entries of all levels over those of A."""
        return sum(lev.A.nnz for lev in self.levels) / self.levels[0].A.nnz

    @property
    def grid_complexity(self) -> float:
        """Unknowns of all levels over those of A."""
        return sum(lev.A.shape[0] for lev in self.levels) / self.levels[0].A.shape[0]

    @property
    def nbytes(self) -> int:
        """Device (or host) bytes the hierarchy holds beyond A itself.

        Every array the levels, the smoothers and the cycle hold, counted
        once (a float64 cycle shares the levels' matrices), less A's own.
        """
        c = self._cycle
        held = [a for lev in self.levels for a in lev.arrays()]
        held += [sm.dinv for sm in c.smoothers]
        if isinstance(c, FusedCycle):
            held += [a for mats in c.mats for M in mats if M is not None for a in M]
        else:
            held += [a for mats in c.mats for M in mats if M is not None
                     for a in (M.data, M.indices, M.indptr)]
        if self.nullspace is not None:
            held.append(self.nullspace)
        A0 = self.levels[0].A
        fine = {id(A0.data), id(A0.indices), id(A0.indptr)}
        unique = {id(a): a for a in held if id(a) not in fine}
        return int(sum(a.nbytes for a in unique.values()) + c.nbytes())

    def __repr__(self) -> str:
        sizes = " > ".join(str(lev.A.shape[0]) for lev in self.levels)
        return (f"AMGPreconditioner({self.setup} set-up, {self.smoother} smoother, levels {sizes}, "
                f"operator complexity {self.operator_complexity:.2f})")


def amg(A: Any, **options: Any) -> AMGPreconditioner:
    """A smoothed-aggregation AMG preconditioner for ``A`` (see :class:`AMGPreconditioner`)."""
    return AMGPreconditioner(A, **options)


def csr_arrays(levels: list, dtype: Any, xp: Any) -> list[tuple[Any, Any]]:
    """``(A, P)`` of every level as ``(indptr, indices, data)`` triples for :class:`~.fused.FusedCycle`.

    Values in ``dtype`` (a copy only where the levels' dtype differs),
    indices int32 (shared with the levels' matrices where they already are).
    """
    def triple(M: Any) -> Any:
        if M is None:
            return None
        return (M.indptr.astype(xp.int32, copy=False), M.indices.astype(xp.int32, copy=False),
                M.data.astype(dtype, copy=False))

    return [(triple(lev.A), triple(lev.P)) for lev in levels]


def hierarchy_bytes_estimate(n: int, nnz: int, itemsize: int = 8,
                             cycle_itemsize: int | None = None, *, fused: bool = False) -> int:
    """A planning estimate of :attr:`AMGPreconditioner.nbytes` before the set-up.

    The cost model's :func:`~managed_solve.system.cost.amg_bytes`; ``fused``:
    the GPU's fused cycle (four vectors a level), else the host's (five).
    """
    return amg_bytes(n, nnz, itemsize=itemsize, cycle_itemsize=cycle_itemsize,
                     vectors=4 if fused else 5)
