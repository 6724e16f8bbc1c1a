"""Step 1 of ``solve_many``: the call's arguments, then each input as a :class:`LinearSystem`.

:func:`validate_call` is the step: a bad argument of the call raises at
once; the inputs' host arrays are checked for NaN and Inf, and the auto
policy's tests of their host matrices run, in one pass over the cores
(:func:`.host_checks.check_inputs`); then each input becomes a
LinearSystem, a bad one an ``INVALID_INPUT`` result (:func:`invalid_result`)
while the other systems go on. The Ray backend validates on its driver with
the same functions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..result import SolveResult, Status
from ..system import METHODS, LinearSystem, check_preconditioner
from ..system.method import settle_auto
from . import host_checks

RETURN_ON = ("device", "host")
ON_ERROR = ("return", "raise")


@dataclass
class Checked:
    """What validation hands to the estimate step: the call's systems, by input position."""

    systems: list[LinearSystem | None]  # None where the input is invalid
    results: list[SolveResult | None]  # INVALID_INPUT results where it is; None elsewhere
    cache: dict  # the auto policy's tests of this call's matrices (symmetry, bounds), by id
    grad: bool  # some system's inputs require grad


def validate_call(systems: Iterable[Any], *, method: str, M: Any, rtol: float | None,
                  return_on: str, on_error: str, progress: bool) -> Checked:
    """Check the call's arguments (raising on a bad one), then every input (:class:`Checked`).

    The finite check of the inputs' host arrays and the auto policy's tests
    of their host matrices run first, many a kernel call on every core
    (:func:`.host_checks.check_inputs`); the tests' answers stay in
    ``Checked.cache`` for the estimate step.

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
    memo = host_checks.check_inputs(items, method, cache)
    results, checked = validate_all(items, method=method, M=M, rtol=rtol, memo=memo)
    valid = [checked.get(i) for i in range(len(items))]
    return Checked(valid, results, cache, any(s is not None and s.grad is not None for s in valid))


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
    for i, item in enumerate(items):
        try:
            valid[i] = as_system(item, i, method=method, M=M, rtol=rtol, memo=memo)
        except (TypeError, ValueError) as exc:
            results[i] = invalid_result(exc, i, item)
    return results, valid


def prefill_finite(items: list, memo: dict) -> int:
    """Mark in ``memo`` the arrays of :func:`.host_checks.finite_candidates` found finite, in one pass.

    Arrays with a NaN or an Inf are left out, so the LinearSystem checks
    them itself and names the bad one. Returns the number of arrays marked.
    """
    arrays = host_checks.finite_candidates(items)
    if not arrays:
        return 0
    found = host_checks.finite_arrays(arrays)
    for a in found:
        memo[id(a)] = a
    return len(found)
