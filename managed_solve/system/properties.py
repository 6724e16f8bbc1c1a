"""Properties of a matrix that choose methods: symmetry, the sign of the diagonal, a CG bound.

Each is computed on the device the matrix lies on, with one host read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _backend, config


def symmetry_workers() -> int:
    """Threads the host symmetry and diagonal tests of large matrices use (``config``)."""
    workers = config.current().symmetry_workers
    return int(workers) if workers else min(8, _backend.cpu_count())


def gershgorin(A: Any, cache: dict | None = None) -> tuple[float, float, float, float]:
    """``(lo, hi, dmin, dmax)`` of a square CSR matrix: Gershgorin's interval and the diagonal's range.

    ``lo = min(a_ii - r_i)``, ``hi = max(a_ii + r_i)`` (``r_i`` the absolute
    off-diagonal row sums) hold the eigenvalues of a symmetric A; ``dmin``
    and ``dmax`` are its extreme diagonal entries. One pass over a host
    matrix (a Numba kernel, no temporaries); on a GPU, on the device, with
    one host read. ``cache`` (one dict per call) keeps the answer by matrix object.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> gershgorin(sp.diags([-1.0, 3.0, -1.0], [-1, 0, 1], shape=(4, 4), format="csr"))
    (1.0, 5.0, 3.0, 3.0)
    """
    key = ("gershgorin", id(A))
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] is A:
        return hit[1]
    if _backend.is_scipy_sparse(A) and A.format == "csr":
        from ..kernels.symmetry import csr_gershgorin

        out = tuple(float(v) for v in csr_gershgorin(A.indptr, A.indices, A.data))
    else:
        xp = _backend.array_module(A.data)
        d = xp.asarray(A.diagonal())
        rows = xp.asarray(abs(A).sum(axis=1)).ravel()
        off = rows - xp.abs(d)
        both = xp.stack([(d - off).min(), (d + off).max(), d.min(), d.max()]) if d.size \
            else xp.zeros(4)
        out = tuple(float(v) for v in _backend.to_host(both).tolist())  # sync: one read
    if cache is not None:
        cache[key] = (A, out)
    return out  # type: ignore[return-value]


def cg_iteration_bound(A: Any, rtol: float, cache: dict | None = None) -> float:
    """Upper bound on the CG iterations a symmetric CSR matrix needs, from Gershgorin discs.

    The eigenvalues of A lie in ``[min(a_ii - r_i), max(a_ii + r_i)]`` with
    ``r_i`` the absolute off-diagonal row sums, so for a strictly diagonally
    dominant A with a positive diagonal ``kappa <= hi / lo`` and CG needs at
    most about ``0.5 * sqrt(kappa) * ln(2 / rtol)`` iterations. Infinite when
    A is not strictly diagonally dominant (a Poisson matrix: its bound says
    nothing). Easy systems for CG (a heat step with a small time step, a
    strongly screened Poisson problem) have a low bound.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> heat = sp.diags([-0.1, 1.2, -0.1], [-1, 0, 1], shape=(50, 50), format="csr")
    >>> round(cg_iteration_bound(heat, 1e-8), 1)
    11.3
    >>> cg_iteration_bound(sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(50, 50), format="csr"), 1e-8)
    inf
    """
    lo, hi, _dmin, _dmax = gershgorin(A, cache)
    if not lo > 0:
        return float("inf")
    return 0.5 * float(np.sqrt(hi / lo)) * float(np.log(2.0 / max(rtol, 1e-300)))


def is_symmetric(A: Any, cache: dict | None = None, *, exact: bool = False) -> bool:
    """Whether a CSR matrix equals its transpose, pair by pair, on the device A lies on.

    The one symmetry test of the package (``solve``'s method choice, the
    ``LinearSystem.is_symmetric_hint`` property, ``solve_many``'s routing),
    by the rule of :mod:`managed_solve.kernels.symmetry`: every pair within
    ``symmetry_rtol(A.dtype)`` (1e-12 for float64, 1.5e-5 for float32, whose
    assembly rounds mirrors apart by a few ulps) of its own size or of its
    two rows' largest entries, so that one large entry (a penalty on the
    diagonal) does not excuse differences elsewhere. A canonical matrix
    (sorted indices, no duplicates) with a symmetric pattern is tested in one pass (a Numba
    kernel on the host, one launch on a GPU); otherwise, or when the stored
    patterns differ (a small stored value facing an unstored zero may still
    pass), :func:`symmetric_pairs` decides on the stored entries and their
    mirrors.

    Parameters
    ----------
    A : scipy.sparse or cupyx.scipy.sparse CSR matrix
    cache : dict, optional
        Answers by matrix object, for callers that meet one matrix many times
        within a call (``solve_many``); an entry is reused for the same object only.
    exact : bool
        Judge by float64's ``SYMMETRY_RTOL`` (1e-12) whatever A's dtype:
        whether A may stand for ``A^T`` in a solve (a gradient's adjoint),
        rather than whether a method for symmetric matrices suits it.

    Returns
    -------
    bool

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> is_symmetric(sp.diags([1.0, 2.0, 1.0], [-1, 0, 1], shape=(4, 4), format="csr"))
    True
    >>> is_symmetric(sp.diags([1.0, 2.0], [0, 1], shape=(4, 4), format="csr"))
    False
    """
    key = id(A) if not exact or A.dtype == np.float64 else ("exact", id(A))
    if cache is not None:
        hit = cache.get(key)
        if hit is not None and hit[0] is A:
            return hit[1]
    # Here, past the cache (solve_many asks once per system of every matrix it has tested).
    from ..kernels.symmetry import DIFFERENT_PATTERN, SYMMETRY_RTOL, symmetry_rtol

    if A.nnz == 0:
        result = True
    else:
        rel = SYMMETRY_RTOL if exact else symmetry_rtol(A.dtype)
        xp = _backend.array_module(A.data)
        result = None
        if xp is np and A.has_canonical_format:
            code = _host_symmetry(A, rel, cache)
            result = None if code == DIFFERENT_PATTERN else bool(code)
        if xp is not np and getattr(A, "_has_canonical_format", None) is True:
            # Canonical (CuPy knows it, or the input checks found it): one
            # launch and one host read, the bounds kept for the policy too.
            from .device_checks import symmetry_many

            found = symmetry_many([A], rel)[0]
            if found is not None:
                code, bounds = found
                if cache is not None:
                    cache[("gershgorin", id(A))] = (A, bounds)
                result = None if code == DIFFERENT_PATTERN else bool(code)
        if result is None:
            result = _csr_symmetry(A, xp, rel)
    if cache is not None:
        cache[key] = (A, result)
    return result


def symmetric_pairs(xp: Any, a: Any, b: Any, rows: Any, cols: Any, row_max: Any,
                    rel: float) -> bool:
    """The symmetry rule of :mod:`managed_solve.kernels.symmetry` on arrays, NumPy or CuPy.

    ``a`` holds entries ``a_ij`` and ``b`` their mirrors ``a_ji`` (0 where
    not stored); ``rows`` and ``cols`` give each pair's ``i`` and ``j``
    (arrays broadcasting against ``a``: ``arange(n)[:, None]`` and
    ``arange(n)[None, :]`` for a dense A). Each pair passes when
    ``|a - b| <= rel * max(|a|, |b|, sqrt(r_i) * sqrt(r_j))``, in float64,
    with ``r = row_max()`` each row's largest ``|a_ik|`` (NaN left out),
    called only when some pair fails the first two terms. One host read,
    two when it is called.

    Examples
    --------
    >>> import numpy as np
    >>> i = np.arange(2)
    >>> def test(A):
    ...     r = lambda: np.abs(A).max(axis=1)
    ...     return symmetric_pairs(np, A, A.T, i[:, None], i[None, :], r, 1e-12)
    >>> test(np.array([[1e15, -0.5], [-1.5, 2.0]]))  # a penalty does not excuse 1.0
    False
    >>> test(np.array([[1.0, 1e-17], [0.0, 1.0]]))  # rounding against a zero: within its rows'
    True
    """
    a = a.astype(np.float64, copy=False)
    b = b.astype(np.float64, copy=False)
    diff = xp.abs(a - b)
    beyond = diff > rel * xp.maximum(xp.abs(a), xp.abs(b))  # a NaN compares as no difference
    if not bool(beyond.any()):  # sync: once, choosing the method
        return True
    root = xp.sqrt(xp.asarray(row_max()).astype(np.float64, copy=False))
    return not bool((beyond & (diff > rel * (root[rows] * root[cols]))).any())  # sync: as above


def _csr_symmetry(A: Any, xp: Any, rel: float) -> bool:
    """:func:`symmetric_pairs` of a CSR matrix in any form: each stored entry against its mirror.

    The pairs come from a float64 copy with duplicates summed; each stored
    ``(i, j)`` finds ``(j, i)`` by a binary search of the sorted keys
    ``i n + j`` (0 when not stored), so an entry whose mirror is not stored
    is judged against a zero, and no transpose is built.
    """
    n = A.shape[0]
    if A.shape[1] != n:
        return False
    C = A.astype(np.float64).tocoo()  # a copy: A itself is left as it is
    C.sum_duplicates()
    if C.nnz == 0:
        return True
    rows = C.row.astype(np.int64)
    cols = C.col.astype(np.int64)
    keys = rows * n + cols
    order = xp.argsort(keys)
    keys, rows, cols, vals = keys[order], rows[order], cols[order], C.data[order]
    mirror = cols * n + rows
    at = xp.minimum(xp.searchsorted(keys, mirror), keys.shape[0] - 1)
    b = xp.where(keys[at] == mirror, vals[at], 0.0)

    def row_max() -> Any:
        # Each row's entries by size (a NaN as 0): the last of a row is its largest.
        size = xp.abs(vals)
        size = xp.where(size == size, size, 0.0)
        by = xp.lexsort(xp.stack([size, rows]))
        last = by[xp.append(rows[by][1:] != rows[by][:-1], True)]
        out = xp.zeros(n, dtype=np.float64)
        out[rows[last]] = size[last]
        return out

    return symmetric_pairs(xp, vals, b, rows, cols, row_max, rel)


def _host_symmetry(A: Any, rel: float, cache: dict | None = None) -> int:
    """The symmetry code of a canonical host CSR matrix (``kernels.symmetry``), chunked when large.

    The one-pass kernel finds :func:`gershgorin`'s bounds in the same walk;
    they go to ``cache`` for the auto policy, which reads them next.
    """
    from ..kernels.symmetry import csr_symmetry_rows

    workers = symmetry_workers()
    # Chunks cost more in all than the one-pass kernel (a cursor window per
    # chunk, or a binary search per entry): only worth it with several cores.
    if A.nnz < config.current().symmetry_parallel_nnz or workers < 4:
        code, bounds = _one_pass(A, rel, cache)
        if cache is not None and bounds is not None:
            cache[("gershgorin", id(A))] = (A, tuple(float(v) for v in bounds))
        return int(code)
    pool = _backend.thread_pool("symmetry", workers)
    codes = [f.result() for f in [pool.submit(csr_symmetry_rows, A.indptr, A.indices, A.data, rel, lo, hi)
                                  for lo, hi in _row_chunks(A, 2 * workers)]]
    return min(codes)  # DIFFERENT_PATTERN (-1) < DIFFERENT_VALUES (0) < SYMMETRIC (1)


def _one_pass(A: Any, rel: float, cache: dict | None) -> tuple[int, tuple | None]:
    """``csr_symmetry_gershgorin``'s code and bounds, through the pattern's mirror map when shared.

    Matrices of one call that share their index arrays (a sweep's systems on
    one mesh share the symbolic phase's) share the map of each entry to its
    mirror: the first matrix walks the cursors, the second builds the map,
    the rest read their values through it (no cursors).
    """
    from ..kernels.symmetry import csr_mirror, csr_mirror_gershgorin, csr_symmetry_gershgorin

    key = ("pattern", id(A.indptr), id(A.indices))
    hit = cache.get(key) if cache is not None else None
    if hit is None or hit[0] is not A.indptr or hit[1] is not A.indices:
        if cache is not None:
            cache[key] = (A.indptr, A.indices, None)
        code, *bounds = csr_symmetry_gershgorin(A.indptr, A.indices, A.data, rel)
        return code, tuple(bounds)
    mirror = hit[2]
    if mirror is None:
        mirror = csr_mirror(A.indptr, A.indices)
        cache[key] = (A.indptr, A.indices, mirror)
    if A.nnz and not mirror.size:  # a pattern without its mirror: the caller compares A - A.T
        from ..kernels.symmetry import DIFFERENT_PATTERN

        return DIFFERENT_PATTERN, None
    code, *bounds = csr_mirror_gershgorin(A.indptr, A.indices, A.data, mirror, rel)
    return code, tuple(bounds)


def _row_chunks(A: Any, parts: int) -> list[tuple[int, int]]:
    """Row ranges of a CSR matrix holding about equal numbers of stored entries."""
    n, nnz = A.shape[0], A.nnz
    cuts = [0, *np.searchsorted(A.indptr, np.linspace(0, nnz, parts + 1)[1:-1]).tolist(), n]
    return [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True) if hi > lo]


def positive_diagonal(A: Any) -> bool:
    """Whether every diagonal entry of a square matrix is positive (CG's half of ``method="auto"``).

    Large host CSR matrices (``config.current().symmetry_parallel_nnz`` entries, with four or
    more symmetry workers) are read by a Numba kernel in row ranges on helper threads:
    ``A.diagonal()`` on one thread lies on the path before ``solve_many``'s first
    GPU batch, where every millisecond leaves the GPUs idle. Other
    matrices use their own ``diagonal()`` (SciPy's is faster than the kernel
    on one thread).

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(4, 4), format="csr")
    >>> positive_diagonal(A), positive_diagonal(-A)
    (True, False)
    """
    workers = symmetry_workers()
    if _backend.is_scipy_sparse(A) and A.format == "csr" \
            and A.nnz >= config.current().symmetry_parallel_nnz and workers >= 4:
        from ..kernels.symmetry import csr_positive_diagonal

        pool = _backend.thread_pool("symmetry", workers)
        return all(f.result() for f in [
            pool.submit(csr_positive_diagonal, A.indptr, A.indices, A.data, lo, hi)
            for lo, hi in _row_chunks(A, 2 * workers)])
    return bool((A.diagonal() > 0).all())  # sync: once, choosing the method
