"""The cost and byte model of one system: iterations, bytes streamed, bytes held.

The one home of the per-system estimates that placement and planning use
(``solve``'s reservation, ``solve_many``'s estimates and batches). The
batched engine's own workspace model (a packed batch's allocations) stays
beside those allocations in the batched engine.

Cost model: one unpreconditioned CG iteration streams at least
``nnz*(w+i) + 4n + 11*n*w`` bytes (w value width, i index width). CG on a
2D Poisson-like matrix needs about ``0.1 * ln(2/rtol) * sqrt(n)`` iterations
(SciPy's cg on 16..128 squared grids at rtol 1e-8 needs 1.75..1.87 sqrt(n));
BiCGStab about 0.7 times as many, with two products each. The product (bytes
per iteration x iterations) is the predicted cost in bytes streamed, which
the DeviceManager turns into seconds with each device's learned speed.
"""

from __future__ import annotations

import math

import numpy as np

# Work vectors of each method besides A and b (x included); GMRES(30) keeps
# its basis of 30 vectors plus three.
_WORK_VECTORS = {"cg": 4, "bicgstab": 7, "gmres": 30 + 3, "minres": 8, "direct": 0}


def predict_iterations(n: int, *, rtol: float = 1e-8, method: str = "cg",
                       maxiter: int | None = None) -> float:
    """Expected Krylov iterations for an ``n``-unknown Poisson-like system.

    Examples
    --------
    >>> round(predict_iterations(96 * 96, rtol=1e-8))
    183
    """
    rtol = min(max(float(rtol), 1e-16), 0.5)
    its = 0.1 * math.log(2.0 / rtol) * math.sqrt(max(int(n), 1))
    if method == "bicgstab":
        its *= 0.7
    its = max(its, 1.0)
    if maxiter is not None:
        its = min(its, float(maxiter))
    return its


def predict_iterations_array(n: np.ndarray, rtol: np.ndarray, *, method: str = "cg",
                             maxiter: np.ndarray | None = None) -> np.ndarray:
    """:func:`predict_iterations` of many systems at once (arrays of sizes and tolerances).

    Examples
    --------
    >>> predict_iterations_array(np.array([96 * 96, 100]), np.array([1e-8, 1e-8]),
    ...                          maxiter=np.array([1000, 5])).round().tolist()
    [183.0, 5.0]
    """
    rtol = np.clip(np.asarray(rtol, dtype=np.float64), 1e-16, 0.5)
    its = 0.1 * np.log(2.0 / rtol) * np.sqrt(np.maximum(np.asarray(n, dtype=np.float64), 1.0))
    if method == "bicgstab":
        its *= 0.7
    its = np.maximum(its, 1.0)
    if maxiter is not None:
        its = np.minimum(its, np.asarray(maxiter, dtype=np.float64))
    return its


def bytes_per_iteration(n: int, nnz: int, *, itemsize: int = 8, index_itemsize: int = 4,
                        method: str = "cg", jacobi: bool = False) -> float:
    """Fewest bytes one iteration streams (CSR product plus vector updates).

    Examples
    --------
    >>> bytes_per_iteration(100, 460)  # 5-point stencil: about 150 bytes a row
    14720.0
    """
    spmv = nnz * (itemsize + index_itemsize) + 4 * n
    if method == "bicgstab":
        return float(2 * spmv + (20 + 2 * jacobi) * n * itemsize)
    if method == "gmres":
        # Classical Gram-Schmidt twice against 15 basis vectors on average
        # (restart 30): each pass reads them twice (dot products, then the
        # update), plus w's reads and writes and the new vector.
        return float(spmv + (4 * 15 + 10 + 2 * jacobi) * n * itemsize)
    return float(spmv + (11 + 2 * jacobi) * n * itemsize)


def solve_bytes(n: int, nnz: int, *, itemsize: int = 8, index_itemsize: int = 4,
                method: str = "cg", nsys: int = 1, jacobi: bool = False) -> int:
    """Device bytes to hold a (packed) system and solve it: CSR, b, x, work vectors.

    The planner's model, used until the batched engine's own prediction of
    a batch is given. Vectors: b, x, the method's workspace, the inverse
    diagonal with Jacobi, a row-to-system map and per-system scalars.
    """
    vectors = {"cg": 4, "bicgstab": 7, "gmres": 33}.get(method, 7) + 2 + (1 if jacobi else 0)
    csr = nnz * (itemsize + index_itemsize) + (n + 1) * index_itemsize
    per_system = 64 + (7_700 if method == "gmres" else 0)  # GMRES: its Hessenberg columns
    return int(csr + vectors * n * itemsize + 4 * n + per_system * nsys)


def krylov_cost(n: int, nnz: int, *, rtol: float, maxiter: int | None, method: str = "cg",
                itemsize: int = 8, index_itemsize: int = 4, jacobi: bool = False
                ) -> tuple[float, float, int]:
    """(predicted iterations, bytes the whole solve streams, device bytes it holds) of a Krylov solve.

    :func:`predict_iterations`, :func:`bytes_per_iteration` times those
    iterations, and :func:`solve_bytes`: the planner's three numbers for one
    system in a batch.

    Examples
    --------
    >>> its, streamed, held = krylov_cost(100, 460, rtol=1e-8, maxiter=None)
    >>> round(its), streamed == bytes_per_iteration(100, 460) * its, held == solve_bytes(100, 460)
    (19, True, True)
    """
    its = predict_iterations(n, rtol=rtol, method=method, maxiter=maxiter)
    streamed = bytes_per_iteration(n, nnz, itemsize=itemsize, index_itemsize=index_itemsize,
                                   method=method, jacobi=jacobi) * its
    held = solve_bytes(n, nnz, itemsize=itemsize, index_itemsize=index_itemsize, method=method,
                       jacobi=jacobi)
    return its, streamed, held


def workspace_bytes(method: str, n: int, nnz: int, *, itemsize: int = 8,
                    preconditioned: bool = False, amg: bool = False) -> int:
    """Extra bytes one solve needs besides the system: x plus the method's work vectors.

    For ``"direct"``, the fill-in of a sparse LU, bounded roughly by 20 x nnz;
    ``amg``: an AMG hierarchy's bytes too (:func:`amg_bytes`).

    Examples
    --------
    >>> workspace_bytes("cg", 10, 28)
    320
    """
    if method == "direct":
        return int(20 * nnz * (itemsize + 4))
    vectors = _WORK_VECTORS.get(method, 7) + (1 if preconditioned else 0)
    return int(vectors * n * itemsize) + (amg_bytes(n, nnz, itemsize=itemsize) if amg else 0)


def amg_bytes(n: int, nnz: int, *, itemsize: int = 8, cycle_itemsize: int | None = None,
              vectors: int = 5) -> int:
    """Bytes a smoothed-aggregation hierarchy (``M="amg"``) adds to A, before its set-up.

    Measured on 2D (5 entries a row) and 3D (7) Poisson with the default
    strength threshold, interpolated in the mean row length ``d``:
    coarse-level entries ``0.45 + 0.25 (d - 5)`` per fine entry (operator
    complexity - 1), ``P`` entries ``3.18 + 1.17 (d - 5)`` per fine row over
    all levels, ``1.18 - 0.015 (d - 5)`` unknowns on all levels but the
    coarsest per fine unknown. Counted: the coarse matrices, the
    prolongators, the aggregates (int32) and per level ``vectors`` vectors
    in the cycle's precision (``cycle_itemsize``, the matrix's by default):
    the host cycle's b, x, residual, update and the smoother's scaling (5),
    the GPU's fused cycle's b, two x and the scaling (4). A lower-precision
    cycle keeps the coarse levels in its precision only, and a copy of A's values.

    Examples
    --------
    >>> round(amg_bytes(1_000_000, 4_996_000) / (4_996_000 * 12 + 4_000_004), 2)
    1.98
    """
    cyc = itemsize if cycle_itemsize is None else int(cycle_itemsize)
    d = min(max(nnz / max(n, 1), 3.0), 9.0) - 5.0
    coarse, p_rows, grid = 0.45 + 0.25 * d, 3.18 + 1.17 * d, 1.18 - 0.015 * d
    rows = grid * n
    total = (coarse * nnz + p_rows * n) * (cyc + 4)  # coarse A and P: values and indices
    total += 2 * 4 * rows  # row pointers of the coarse A and of P
    total += 4 * rows + vectors * cyc * rows  # aggregates; the cycle's vectors
    if cyc != itemsize:
        total += nnz * cyc  # the cycle's copy of A's values
    return int(total)
