"""Step 1 of ``solve_many``: the call's arguments, then each input as a :class:`LinearSystem`.

:func:`validate_call` is the step: a bad argument of the call raises at
once; the inputs' host arrays are checked for NaN and Inf, and the auto
policy's tests of their host matrices run, in one pass over the cores
(:func:`check_inputs`); then each input becomes a
LinearSystem, a bad one an ``INVALID_INPUT`` result (:func:`invalid_result`)
while the other systems go on. The Ray backend validates on its driver with
the same functions.

The host checks, many matrices a kernel call, on the host-kernel threads.

Two passes read every input once more than the solve does: validation's
check for NaN and Inf (A's entries, b) and the auto policy's symmetry and
Gershgorin test of each distinct matrix. With one matrix per system that is
hundreds of small calls; each takes the GIL back when it returns, and
beside the call's other Python threads each re-take may wait for the
interpreter's switch interval. Here the arrays' addresses are read once
and ranges of them go out to the caller and the host-kernel helpers
(:func:`managed_solve._threads.run_kernels`), one GIL-free
kernel call (:mod:`managed_solve.kernels.checks`) per range.

Both passes give what the per-matrix functions give (the same kernels'
bodies): :class:`FinitePass` finds the arrays for the memo that
:class:`~managed_solve.LinearSystem` reads, and :class:`SymmetryPass` fills
the cache that :func:`managed_solve.system.is_symmetric` and
:func:`managed_solve.system.properties.gershgorin` read. The symmetry
kernels also check the entries they walked for NaN and Inf (still in
cache), so ``solve_many`` leaves those ``data`` arrays out of the finite
pass (:meth:`SymmetryPass.covered`) and adds the ones found finite to the
memo (:meth:`SymmetryPass.finite_data`): each array is read from memory
once. Validation runs both at once (:func:`check_inputs`) before its loop,
the calling thread among the workers: helpers that finish a kernel call and
want the GIL back then wait for no Python loop of the caller's (each such
wait may last the interpreter's switch interval).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _backend, config
from .._threads import run_kernels
from ..result import SolveResult, Status
from ..system import METHODS, LinearSystem, check_preconditioner
from ..system.linear_system import host_csr_systems
from ..system.method import settle_auto

RETURN_ON = ("device", "host")
ON_ERROR = ("return", "raise")


@dataclass
class Checked:
    """What validation hands to the estimate step: the call's systems, by input position."""

    systems: list[LinearSystem | None]  # None where the input is invalid
    results: list[SolveResult | None]  # INVALID_INPUT results where it is; None elsewhere
    cache: dict  # the auto policy's tests of this call's matrices (symmetry, bounds), by id
    grad: bool  # some system's inputs require grad
    least: int  # stored entries from which a matrix is not in the tests' pass (:func:`pass_least`)


def validate_call(systems: Iterable[Any], *, method: str, M: Any, rtol: float | None,
                  return_on: str, on_error: str, progress: bool) -> Checked:
    """Check the call's arguments (raising on a bad one), then every input (:class:`Checked`).

    The finite check of the inputs' host arrays and the auto policy's tests
    of their host matrices run first, many a kernel call on every core
    (:func:`check_inputs`); the tests' answers stay in ``Checked.cache`` for
    the estimate step, with the size from which a matrix was left out of
    them (``Checked.least``).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> A = sp.identity(4, format="csr")
    >>> c = validate_call([(A, np.ones(4)), (A, np.ones(3))], method="auto", M=None, rtol=None,
    ...                   return_on="device", on_error="return", progress=False)
    >>> [s is not None for s in c.systems], c.results[1].status.name
    ([True, False], 'INVALID_INPUT')
    """
    check_arguments(method, M, rtol, return_on, on_error, progress)
    items = list(systems)
    cache: dict = {}
    least = pass_least()
    memo = check_inputs(items, method, cache, least)
    results, checked = validate_all(items, method=method, M=M, rtol=rtol, memo=memo)
    valid = [checked.get(i) for i in range(len(items))]
    return Checked(valid, results, cache, any(s is not None and s.grad is not None for s in valid),
                   least)


def check_arguments(method: str, M: Any, rtol: float | None, return_on: str, on_error: str,
                    progress: bool) -> None:
    """Raise on a bad argument of the call (``ValueError``/``TypeError`` naming it).

    Examples
    --------
    >>> check_arguments("auto", None, 1e-8, "device", "return", False)
    >>> check_arguments("lu", None, None, "device", "return", False)
    Traceback (most recent call last):
    ...
    ValueError: solve_many(method='lu'): expected one of auto, cg, bicgstab, gmres, minres, direct
    """
    call = "solve_many"
    if method not in METHODS:
        raise ValueError(f"{call}(method={method!r}): expected one of {', '.join(METHODS)}")
    check_preconditioner(M, call)
    if rtol is not None and not (isinstance(rtol, (int, float)) and math.isfinite(rtol) and rtol >= 0):
        raise ValueError(f"{call}(rtol={rtol!r}): expected a finite number >= 0, e.g. 1e-8, or None "
                         "to keep each system's own")
    if return_on not in RETURN_ON:
        raise ValueError(f"{call}(return_on={return_on!r}): expected 'device' (x stays where it "
                         "was solved) or 'host' (NumPy arrays)")
    if on_error not in ON_ERROR:
        raise ValueError(f"{call}(on_error={on_error!r}): expected 'return' (failed systems come "
                         "back with their status) or 'raise'")
    if not isinstance(progress, bool):
        raise TypeError(f"{call}(progress={progress!r}): expected True or False")


def as_system(item: Any, i: int, *, method: str, M: Any, rtol: float | None,
              memo: dict | None = None) -> LinearSystem:
    """One input as a LinearSystem with solve_many's overrides applied; raises on bad input.

    ``memo`` (one dict per call) remembers the arrays already found finite, so
    a matrix shared by many ``(A, b)`` pairs is scanned for NaN and Inf once.

    Raises
    ------
    TypeError, ValueError
        The input is not a system, or not a valid one (the message names it).
    """
    if isinstance(item, LinearSystem):
        # b = 0: x = 0 exactly, whatever x0 (as solve does). A GPU b is read
        # with the call's others, in one wait (validate_all).
        if item.x0 is not None and isinstance(item.b, np.ndarray) and not item.b.any():
            item = with_x0(item, None)
        if method == "auto" and M is None and rtol is None:
            return item
        s = object.__new__(LinearSystem)
        s.__dict__.update(item.__dict__)
        if method != "auto":
            if s.kind == "operator" and method == "direct":
                raise ValueError(f"solve_many(systems[{i}]): method='direct' needs the matrix "
                                 "entries; this system's A is an operator")
            s.method = method
        if M is not None:
            s.M = settle_auto(M, s.kind, s.n, s.method)
        if rtol is not None:
            if rtol == 0 and s.atol == 0:
                raise ValueError(f"solve_many(rtol=0): systems[{i}] has atol=0 too, so nothing "
                                 "can converge; give a positive rtol")
            s.rtol = float(rtol)
        return s
    if isinstance(item, (tuple, list)) and len(item) == 2:
        A, b = item
        return LinearSystem(A, b, rtol=1e-8 if rtol is None else rtol, method=method,
                            M="auto" if M is None else M, name=f"systems[{i}]",
                            _finite_memo=memo)
    raise TypeError(
        f"solve_many(systems[{i}]): expected a LinearSystem or an (A, b) pair, got "
        f"{type(item).__name__}. Build one with managed_solve.LinearSystem(A, b)."
    )


def invalid_result(exc: Exception, i: int, item: Any) -> SolveResult:
    """The ``INVALID_INPUT`` result of input ``i``, with the error's message."""
    name = getattr(item, "name", None) or f"systems[{i}]"
    return SolveResult(None, Status.INVALID_INPUT, name=name, method="",
                       message=f"{type(exc).__name__}: {exc}")


def with_x0(s: LinearSystem, x0: Any) -> LinearSystem:
    """A shallow copy of ``s`` starting from ``x0`` (the arrays are shared, not copied)."""
    t = object.__new__(LinearSystem)
    t.__dict__.update(s.__dict__)
    t.x0 = x0
    return t


def validate_all(items: list, *, method: str, M: Any, rtol: float | None,
                 memo: dict | None = None
                 ) -> tuple[list[SolveResult | None], dict[int, LinearSystem]]:
    """Every input as a LinearSystem (``valid``) or an INVALID_INPUT result (``results``).

    One memo of the arrays found finite serves the whole call, so a matrix
    shared by many ``(A, b)`` pairs is scanned for NaN and Inf once. Without
    a ``memo`` from the caller, the pairs' host arrays are scanned first,
    many a kernel call over the host's cores (:func:`prefill_finite`); each
    LinearSystem then finds its arrays in the memo.
    """
    results: list[SolveResult | None] = [None] * len(items)
    valid: dict[int, LinearSystem] = {}
    if memo is None:
        memo = {}
        prefill_finite(items, memo)
    # Pairs of the constructor's quick path in one call (the call's options checked once);
    # as_system builds the rest, and raises their errors.
    quick = host_csr_systems(items, rtol=1e-8 if rtol is None else rtol, method=method,
                             M="auto" if M is None else M, memo=memo)
    for i, item in enumerate(items):
        try:
            s = quick[i]
            if isinstance(s, Exception):
                raise s
            valid[i] = s if s is not None else as_system(item, i, method=method, M=M, rtol=rtol,
                                                          memo=memo)
        except (TypeError, ValueError) as exc:
            results[i] = invalid_result(exc, i, item)
    drop_x0_of_zero_b(valid)
    return results, valid


def drop_x0_of_zero_b(valid: dict[int, LinearSystem]) -> None:
    """The systems of ``valid`` with an x0 and a GPU b of zeros, without their x0 (x = 0 exactly).

    One reduction per b, read back per device in one copy: a wait for each
    system would cost more than the check.
    """
    by_device: dict[int, list[int]] = {}
    for i, s in valid.items():
        if s.x0 is not None and _backend.is_cupy_array(s.b):
            by_device.setdefault(s.b.device.id, []).append(i)
    for dev, idx in by_device.items():
        cp = _backend.cupy()
        with cp.cuda.Device(dev):
            nonzero = cp.stack([valid[i].b.any() for i in idx]).get()  # sync: one per device
        for i, keep in zip(idx, nonzero.tolist(), strict=True):
            if not keep:
                valid[i] = with_x0(valid[i], None)


def prefill_finite(items: list, memo: dict) -> int:
    """Mark in ``memo`` the arrays of :func:`finite_candidates` found finite, in one pass.

    Arrays with a NaN or an Inf are left out, so the LinearSystem checks
    them itself and names the bad one. Returns the number of arrays marked.
    """
    arrays = finite_candidates(items)
    if not arrays:
        return 0
    found = finite_arrays(arrays)
    for a in found:
        memo[id(a)] = a
    return len(found)


# --------------------------------------------------------------------------- the host checks
#: Below this many arrays (or matrices) a pass is left to the per-array
#: functions: an address table and a hand-out cost more than a few calls.
MIN_ARRAYS = 16
#: Ranges handed out per participating thread (balance against hand-outs).
RANGES_PER_THREAD = 4
#: Predicted nanoseconds per stored entry of the symmetry test (the cursor
#: walk, its pattern check included; calibrated on W2's matrices, see the CPU
#: section of docs/performance.md) and per entry of the finite check (a
#: streaming read).
SYMMETRY_NS, FINITE_NS = 1.5, 1.0


# float64 first: the commonest dtype, found by identity.
_FLOATS = (np.dtype(np.float64), np.dtype(np.float32))


def run_all(passes: Sequence[Any]) -> None:
    """Every kernel call of ``passes`` (objects with ``work``, ``count`` and ``jobs()``), one hand-out.

    The calling thread and the host-kernel helpers claim ranges of each
    pass's items (:func:`managed_solve._threads.run_kernels`, threads by
    the host-threads rule for the passes' predicted nanoseconds).
    """
    run_kernels([job for p in passes for job in p.jobs()], sum(p.work for p in passes),
                sum(p.count for p in passes), RANGES_PER_THREAD)


def _addresses(arrays: Sequence[np.ndarray]) -> np.ndarray:
    from ..kernels.packing import addresses

    return addresses(arrays)


class FinitePass:
    """The finite-entry check of arrays (1-D, C-contiguous, float32 or float64), tables read here.

    One :func:`~managed_solve.kernels.checks.all_finite_many` call per range
    of arrays; :meth:`finite` gives the same answer as
    :func:`managed_solve.system.inputs.all_finite` for each array.
    """

    def __init__(self, arrays: Sequence[np.ndarray]):
        by_dtype: dict[np.dtype, list[np.ndarray]] = {}
        for a in arrays:
            by_dtype.setdefault(a.dtype, []).append(a)
        self.groups = []
        for dt, group in by_dtype.items():
            lengths = np.fromiter((a.shape[0] for a in group), np.int64, len(group))
            self.groups.append((group, _addresses(group), lengths, np.empty(0, dt),
                                np.zeros(len(group), dtype=np.uint8)))
        self.count = len(arrays)
        self.work = FINITE_NS * float(sum(int(g[2].sum()) for g in self.groups))

    def jobs(self) -> list:
        """``(kernel, args, weights)`` per dtype: one kernel call per range of arrays (:func:`run_all`)."""
        from ..kernels.checks import all_finite_many

        return [(all_finite_many, (addresses, lengths, like, flags), lengths.astype(np.float64))
                for _group, addresses, lengths, like, flags in self.groups]

    def finite(self) -> list[np.ndarray]:
        """The arrays found finite (after :func:`run_all`)."""
        return [a for group, *_x, flags in self.groups
                for a, ok in zip(group, flags.tolist(), strict=True) if ok]


def finite_arrays(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The arrays among ``arrays`` whose entries are all finite (:class:`FinitePass`, run now)."""
    work = FinitePass(arrays)
    run_all([work])
    return work.finite()


def symmetry_candidate(A: Any, least: int | None = None) -> bool:
    """Whether :func:`check_symmetry` takes a matrix: a non-empty float SciPy CSR, contiguous.

    ``least``: and fewer stored entries than that (the many-matrix pass's,
    :func:`pass_least`). Not known to be out of canonical form: SciPy's
    flags are read where it has found them, not computed (that is a pass
    over the pattern of its own); the kernels check the pattern as they
    walk it (``NOT_CANONICAL``).
    """
    nnz = _csr_nnz(A)
    if nnz is None:
        return False
    data, indices, indptr = A.data, A.indices, A.indptr
    # The walk reads indptr[0..n], and indices and data up to its last entry: arrays
    # of other lengths (a matrix changed after SciPy built it) go to the full check.
    return (nnz > 0 and (least is None or nnz < least) and data.dtype in _FLOATS
            and indptr.shape[0] == A.shape[0] + 1 and data.shape[0] == indices.shape[0]
            and getattr(A, "_has_canonical_format", True) is not False
            and getattr(A, "_has_sorted_indices", True) is not False
            and data.flags.c_contiguous and indices.flags.c_contiguous
            and indptr.flags.c_contiguous)


def _csr_nnz(A: Any) -> int | None:
    """A SciPy CSR matrix's stored entries; None for anything else.

    The exact SciPy types by identity, their count read from ``indptr``
    (what their ``nnz`` returns, without its two calls): the inputs'
    checks ask this of every input.
    """
    if type(A) in _backend.scipy_csr_types():
        return int(A.indptr[-1])
    if _backend.is_scipy_sparse(A) and A.format == "csr":
        return A.nnz
    return None


def check_symmetry(mats: Sequence[Any], cache: dict, rel: float | None = None) -> None:
    """The symmetry code and Gershgorin bounds of host CSR matrices into ``cache``, largest first.

    ``mats``: distinct matrices passing :func:`symmetry_candidate`. Each
    gets the entries :func:`managed_solve.system.is_symmetric` leaves
    (``cache[id(A)]``, unless its stored pattern is not symmetric: then
    ``is_symmetric`` applies the rule to the entries and their mirrors
    itself) and the Gershgorin bounds (``cache[("gershgorin", id(A))]``),
    by the same symmetry rule (:mod:`managed_solve.kernels.symmetry`;
    ``rel`` the ``symmetry_rtol`` of each matrix's dtype unless given).
    :func:`symmetry_pass` then :meth:`SymmetryPass.run`.
    """
    symmetry_pass(mats, rel).run(cache)


class SymmetryPass:
    """The address tables of :func:`check_symmetry`, read on the calling thread; the kernels anywhere.

    A caller that runs the kernels on a helper thread (:meth:`run`) builds
    this first: the helper then holds the GIL only to hand out ranges and to
    store the answers, not for a Python loop over the matrices.
    """

    def __init__(self, groups: list):
        # (matrices, kernel arguments, codes, bounds, finite, whole) per dtype triple;
        # whole: each matrix's data array where the walk reads all of it, else None.
        self.groups = groups
        self.count = sum(len(g[0]) for g in groups)
        self.work = SYMMETRY_NS * float(sum(int(g[1][4].sum()) for g in groups))

    def jobs(self) -> list:
        """``(kernel, args, weights)`` per dtype triple: one kernel call per range of matrices."""
        from ..kernels.checks import csr_symmetry_gershgorin_many

        return [(csr_symmetry_gershgorin_many, args, args[4].astype(np.float64))
                for _mats, args, *_answers in self.groups]

    def store(self, cache: dict) -> None:
        """Each matrix's answers into ``cache`` (after :func:`run_all`).

        A matrix the walk found canonical is marked so (SciPy's flag): its
        later ``sum_duplicates`` and checks then skip their own pass. One
        that is not gets no answer here (the per-matrix test, after the
        matrix is made canonical, gives it).
        """
        from ..kernels.symmetry import DIFFERENT_PATTERN, NOT_CANONICAL

        for group, _args, codes, bounds, *_rest in self.groups:
            for A, code, b in zip(group, codes.tolist(), map(tuple, bounds.tolist()), strict=True):
                if code == NOT_CANONICAL:
                    continue
                A.has_canonical_format = True
                key = id(A)
                if code != DIFFERENT_PATTERN:
                    cache[key] = (A, bool(code))
                cache[("gershgorin", key)] = (A, b)

    def covered(self) -> set[int]:
        """The ids of the ``data`` arrays whose finite check the kernels make.

        Each matrix's stored entries, when they are its whole ``data`` (a
        longer array is left to the finite check of whole arrays).
        """
        return {id(d) for *_x, whole in self.groups for d in whole if d is not None}

    def finite_data(self) -> list[np.ndarray]:
        """The :meth:`covered` ``data`` arrays found finite (after :func:`run_all`)."""
        return [d for _group, _args, _codes, _bounds, finite, whole in self.groups
                for d, ok in zip(whole, finite.tolist(), strict=True) if ok and d is not None]

    def valid_patterns(self) -> list:
        """The matrices whose walk checked their whole pattern (after :func:`run_all`).

        The walk refuses row pointers that do not start at 0, fall back or
        run past the entries, and columns not below n. A square matrix it
        found canonical, whose ``data`` it read whole, is a valid CSR
        pattern (the lengths of ``indptr`` and ``indices`` were checked
        before the walk, :func:`symmetry_candidate`), and LinearSystem need
        not read it again (its memo of matrices).
        """
        from ..kernels.symmetry import NOT_CANONICAL

        return [A for group, args, codes, _bounds, _finite, whole in self.groups
                for A, code, d, n in zip(group, codes.tolist(), whole, args[3].tolist(), strict=True)
                if code != NOT_CANONICAL and d is not None and A.shape[1] == n]

    def run(self, cache: dict) -> None:
        """Run the kernels over every range, then store the answers in ``cache``."""
        run_all([self])
        self.store(cache)


def symmetry_pass(mats: Sequence[Any], rel: float | None = None) -> SymmetryPass:
    """:func:`check_symmetry`'s tables: the matrices largest first, by dtypes, with their addresses.

    Each dtype's group is judged with its own ``symmetry_rtol`` unless ``rel`` is given.
    """
    from ..kernels.symmetry import symmetry_rtol
    exact = _backend.scipy_csr_types()
    sizes = np.fromiter((int(A.indptr[-1]) if type(A) in exact else A.nnz for A in mats),
                        np.int64, len(mats))  # a CSR's nnz, without its property's calls
    by_dtype: dict[tuple, list] = {}
    for k in np.argsort(-sizes, kind="stable").tolist():  # largest first, then in input order
        A = mats[k]
        by_dtype.setdefault((A.indptr.dtype, A.indices.dtype, A.data.dtype), []).append(k)
    groups = []
    for (pdt, idt, ddt), ks in by_dtype.items():
        group = [mats[k] for k in ks]
        nnzs = sizes[ks]
        codes = np.zeros(len(group), dtype=np.int8)
        bounds = np.zeros((len(group), 4), dtype=np.float64)
        finite = np.zeros(len(group), dtype=np.uint8)
        data = [A.data for A in group]
        args = (_addresses([A.indptr for A in group]), _addresses([A.indices for A in group]),
                _addresses(data), np.fromiter((A.shape[0] for A in group), np.int64, len(group)),
                nnzs, np.empty(0, pdt), np.empty(0, idt), np.empty(0, ddt),
                symmetry_rtol(ddt) if rel is None else float(rel), codes,
                bounds, finite)
        whole = [d if d.shape[0] == nnz else None for d, nnz in zip(data, nnzs.tolist(), strict=True)]
        groups.append((group, args, codes, bounds, finite, whole))
    return SymmetryPass(groups)


# --------------------------------------------------------------------------- the inputs' pass
def check_inputs(items: Sequence[Any], method: str, cache: dict,
                 least: int | None = None) -> dict[int, Any]:
    """Both passes over ``solve_many``'s raw inputs, one hand-out; the memo of arrays found finite.

    The auto policy's tests of the inputs' host matrices (:func:`input_matrices`,
    answers into ``cache``) and validation's finite check of the arrays those
    tests do not read (:func:`finite_candidates`) run together, the calling
    thread among the workers (helpers waiting for the GIL would otherwise
    wait on validation's loop). ``least``: :func:`pass_least` unless given.
    Returns ``{id(array): array}`` of the arrays found finite, the memo
    :class:`~managed_solve.LinearSystem` reads.
    """
    tests = symmetry_pass(input_matrices(items, method, pass_least() if least is None else least))
    # The tested matrices' entries are checked for NaN and Inf by the same kernel calls.
    finite = FinitePass(finite_candidates(items, tests.covered()))
    run_all([tests, finite])
    tests.store(cache)
    memo = {id(a): a for a in finite.finite()}
    memo.update((id(a), a) for a in tests.finite_data())
    memo.update((id(A), A) for A in tests.valid_patterns())
    return memo


def pass_least() -> int:
    """Stored entries from which a matrix's test is left out of the many-matrix pass.

    The chunked test's size (setting ``symmetry_parallel_nnz``), or
    ``prefetch_min_nnz`` if smaller: from there a matrix's test runs on its
    own beside the estimate loop
    (:func:`managed_solve.scheduling.estimate.prefetch_methods`).
    """
    settings = config.current()
    return min(settings.symmetry_parallel_nnz, settings.prefetch_min_nnz)


def pass_tested(s: LinearSystem, least: int) -> bool:
    """Whether the many-matrix pass tests ``s``'s matrix (``least``: :func:`pass_least`)."""
    return (s.kind == "csr" and s.method == "auto" and type(s.b) is np.ndarray
            and symmetry_candidate(s.A, least))


def input_matrices(items: Sequence[Any], method: str, least: int) -> list:
    """The distinct host matrices of ``solve_many``'s raw inputs that :func:`pass_tested` would take.

    Read before validation, so their tests run beside it: ``(A, b)`` pairs of
    a SciPy CSR ``A`` (:func:`symmetry_candidate`) and a NumPy ``b``, and
    LinearSystems, when the call leaves the method to "auto". A matrix that
    validation replaces (a dtype conversion) is tested again under its new
    object; an invalid input's answer is never read.
    """
    found: dict[int, Any] = {}
    if method != "auto":
        return []
    for item in items:
        # The commonest input, a tuple, skips the LinearSystem test.
        if type(item) is not tuple and isinstance(item, LinearSystem):
            if not pass_tested(item, least):
                continue
            A = item.A
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            A, b = item
            if type(b) is not np.ndarray or id(A) in found or not symmetry_candidate(A, least):
                continue
        else:
            continue
        found.setdefault(id(A), A)
    return list(found.values())


def _scannable(a: Any) -> bool:
    """A 1-D C-contiguous float32/float64 NumPy array (what the many-array finite check reads)."""
    return type(a) is np.ndarray and a.ndim == 1 and a.dtype in _FLOATS \
        and a.flags.c_contiguous


def finite_candidates(items: Sequence[Any], covered: Collection[int] = ()) -> list:
    """The distinct host arrays of ``(A, b)`` pairs the many-array finite check reads.

    Each pair's SciPy CSR ``A.data`` and NumPy ``b``; arrays it cannot read
    (other types, strided views, integer dtypes) are left to the
    LinearSystem's own check, and so are those whose ids are in ``covered``
    (checked elsewhere: :meth:`SymmetryPass.covered`). None (an empty list)
    below ``MIN_ARRAYS`` arrays: a few checks cost less one by one.
    """
    arrays: dict[int, Any] = dict.fromkeys(covered)
    exact = _backend.scipy_csr_types()
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            continue
        A, b = item
        if type(A) in exact or (_backend.is_scipy_sparse(A) and A.format == "csr"):
            data = A.data
            if id(data) not in arrays and _scannable(data):
                arrays[id(data)] = data
        if id(b) not in arrays and _scannable(b):
            arrays[id(b)] = b
    found = [a for a in arrays.values() if a is not None]
    return found if len(found) >= MIN_ARRAYS else []
