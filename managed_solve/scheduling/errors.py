"""The errors of ``solve_many``: the one it raises, and how it tells device failures from bugs."""

from __future__ import annotations

from ..result import SolveError, SolveResult


class SolveManyError(SolveError):
    """Raised by ``solve_many(..., on_error="raise")`` after every system finished.

    Attributes
    ----------
    results : list of SolveResult
        All results, in input order (the converged ones too).
    failed : list of int
        Input positions of the systems that did not converge.
    """

    def __init__(self, message: str, results: list[SolveResult], failed: list[int]):
        super().__init__(message, results[failed[0]] if failed else None)
        self.results = results
        self.failed = failed


class Regroup(Exception):
    """A deferred batch whose systems' methods differ, or some of whose tests failed.

    The runner delivers the failed ones as invalid inputs and runs the
    others as one batch per method (:meth:`.runner.Runner.regroup`).

    Attributes
    ----------
    by_method : dict of str to list of int
        The systems (input positions) of each method found.
    bad : list of (int, Exception)
        The systems whose method could not be found, with the error.
    """

    def __init__(self, by_method: dict[str, list[int]], bad: list[tuple[int, Exception]]):
        super().__init__(f"a deferred batch of methods {sorted(by_method)} and {len(bad)} "
                         "invalid systems")
        self.by_method = by_method
        self.bad = bad


def is_device_error(exc: BaseException) -> bool:
    """Out-of-memory and CUDA runtime/driver errors: worth retrying on another device.

    ``MemoryError`` covers :class:`~managed_solve.devices.SimulatedOutOfMemory`
    and CuPy's ``OutOfMemoryError`` (a ``MemoryError`` subclass); CuPy's
    ``CUDARuntimeError``/``CUDADriverError`` and cuSPARSE/cuBLAS errors are
    recognised by their module, so cupy need not be imported to ask.

    Examples
    --------
    >>> is_device_error(MemoryError("out of memory")), is_device_error(ZeroDivisionError())
    (True, False)
    """
    if isinstance(exc, MemoryError):
        return True
    for cls in type(exc).__mro__:
        mod = cls.__module__ or ""
        if mod.startswith(("cupy_backends", "cupy.cuda", "numba.cuda")) and cls is not Exception:
            return True
    return False


def raise_for_failures(results: list[SolveResult], call: str = "solve_many") -> None:
    """Raise :class:`SolveManyError` listing the systems that did not converge (none: return)."""
    failed = [i for i, r in enumerate(results) if not r.converged]
    if not failed:
        return
    lines = [f"systems[{i}]{_named(results[i].name, i)}: {results[i].status.name}: "
             f"{results[i].message or results[i].status.message}" for i in failed[:20]]
    more = f"\n... and {len(failed) - 20} more" if len(failed) > 20 else ""
    raise SolveManyError(
        f"{call}: {len(failed)} of {len(results)} systems did not converge:\n"
        + "\n".join(lines) + more + "\nPass on_error='return' to get them back with "
        "their status instead.", results, failed)


def _named(name: str | None, i: int) -> str:
    """`` (name)`` for a system the caller named; nothing where the name is its position."""
    return "" if not name or name == f"systems[{i}]" else f" ({name})"
