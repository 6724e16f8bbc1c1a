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


def is_symmetric(A: Any, cache: dict | None = None) -> bool:
    """Whether a CSR matrix equals its transpose (to 1e-12 relative), on the device A lies on.

    The one symmetry test of the package (``solve``'s method choice, the
    ``LinearSystem.is_symmetric_hint`` property, ``solve_many``'s routing).
    With sorted indices and a symmetric pattern the test is one transpose and
    three comparisons (about half the cost of ``abs(A - A.T).max()``);
    otherwise, or when the stored patterns differ (stored values below the
    tolerance may still make A symmetric), the difference ``A - A.T`` decides.

    Parameters
    ----------
    A : scipy.sparse or cupyx.scipy.sparse CSR matrix
    cache : dict, optional
        Answers by matrix object, for callers that meet one matrix many times
        within a call (``solve_many``); an entry is reused for the same object only.

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
    if cache is not None:
        hit = cache.get(id(A))
        if hit is not None and hit[0] is A:
            return hit[1]
    if A.nnz == 0:
        result = True
    else:
        xp = _backend.array_module(A.data)
        result = None
        if xp is np and A.has_canonical_format:
            from ..kernels.symmetry import DIFFERENT_PATTERN

            code = _host_symmetry(A, 1e-12, cache)
            result = None if code == DIFFERENT_PATTERN else bool(code)
        if xp is not np and getattr(A, "_has_canonical_format", None) is True:
            # Canonical (CuPy knows it, or the input checks found it): one
            # launch and one host read, the bounds kept for the policy too.
            from .device_checks import symmetry_many

            found = symmetry_many([A], 1e-12)[0]
            if found is not None:
                from ..kernels.symmetry import DIFFERENT_PATTERN

                code, bounds = found
                if cache is not None:
                    cache[("gershgorin", id(A))] = (A, bounds)
                result = None if code == DIFFERENT_PATTERN else bool(code)
        if result is None:
            scale = float(xp.abs(A.data).max())  # sync: one read per distinct matrix
            limit = 1e-12 * scale
            if xp is not np and A.has_sorted_indices:
                T = A.T.tocsr()  # sorted indices, like A
                if bool(xp.array_equal(T.indptr, A.indptr)) and bool(  # sync: as above
                        xp.array_equal(T.indices, A.indices)):
                    result = bool(float(xp.abs(T.data - A.data).max()) <= limit)  # sync: as above
            if result is None:
                d = A - A.T
                result = bool(d.nnz == 0 or float(abs(d).max()) <= limit)  # sync: as above
    if cache is not None:
        cache[id(A)] = (A, result)
    return result




def _host_symmetry(A: Any, rel: float, cache: dict | None = None) -> int:
    """The symmetry code of a canonical host CSR matrix (``kernels.symmetry``), chunked when large.

    The one-pass kernel finds :func:`gershgorin`'s bounds in the same walk;
    they go to ``cache`` for the auto policy, which reads them next.
    """
    from ..kernels.symmetry import abs_max, csr_symmetry_rows

    workers = symmetry_workers()
    # Chunks cost more in all than the one-pass kernel (a cursor window per
    # chunk, or a binary search per entry): only worth it with several cores.
    if A.nnz < config.current().symmetry_parallel_nnz or workers < 4:
        code, bounds = _one_pass(A, rel, cache)
        if cache is not None and bounds is not None:
            cache[("gershgorin", id(A))] = (A, tuple(float(v) for v in bounds))
        return int(code)
    pool = _backend.thread_pool("symmetry", workers)
    nnz = A.nnz
    chunks = _row_chunks(A, 2 * workers)
    step = -(-nnz // (2 * workers))
    scale = max(f.result() for f in [pool.submit(abs_max, A.data, k, min(k + step, nnz))
                                     for k in range(0, nnz, step)])
    limit = rel * scale
    codes = [f.result() for f in [pool.submit(csr_symmetry_rows, A.indptr, A.indices, A.data, limit, lo, hi)
                                  for lo, hi in chunks]]
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
