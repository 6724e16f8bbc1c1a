"""SolveResult and Status: what a solve returns. Not converging is a status, not an exception."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from . import _backend


class Status(enum.Enum):
    """Outcome of one solve, with a readable message (Lineax's ``RESULTS``)."""

    CONVERGED = "converged"
    MAXITER = "maxiter"
    BREAKDOWN = "breakdown"
    INVALID_INPUT = "invalid_input"
    DEVICE_ERROR = "device_error"
    LEAST_SQUARES = "least_squares"

    @property
    def message(self) -> str:
        return {
            Status.CONVERGED: "the residual met the requested tolerance",
            Status.MAXITER: "the iteration limit was reached before the tolerance was met; "
            "raise maxiter, loosen rtol, or add a preconditioner (M='jacobi')",
            Status.BREAKDOWN: "the method broke down (a zero or negative curvature or a "
            "vanishing inner product); for an indefinite or non-symmetric matrix use "
            "method='minres' or method='gmres'",
            Status.INVALID_INPUT: "the system was rejected as input",
            Status.DEVICE_ERROR: "the device failed while solving (out of memory or a driver error)",
            Status.LEAST_SQUARES: "b is not in the range of the singular A: x is a least-squares "
            "solution (make b consistent, e.g. zero-sum for a pure Neumann problem)",
        }[self]


class SolveError(RuntimeError):
    """Raised by :meth:`SolveResult.raise_for_status` for a result that did not converge."""

    def __init__(self, message: str, result: SolveResult | None = None):
        super().__init__(message)
        self.result = result


@dataclass
class SolveResult:
    """The solution of one linear system and how it was obtained.

    Attributes
    ----------
    x : array
        The solution, on the device where it was solved (NumPy on the CPU,
        CuPy on a GPU). None for an ``INVALID_INPUT`` result.
    status : Status
    iterations : int
    residual_norm : float
        True residual ``||b - A x||`` checked after the solve (not the
        recursively updated one).
    device : str
        ``"cpu"``, ``"cuda:1"``, ...
    seconds : float
        Wall time of the solve on that device.
    message : str
        What happened, with the fix where there is one.
    name : str or None
        The system's name.
    info : dict
        Details of the path taken, by key where it applies: ``path``,
        ``host_syncs`` (host waits on the GPU with nothing queued behind),
        ``checkpoints`` and ``compactions`` (batched GPU core),
        ``gpu_seconds`` (device time of the batched GPU solve, from CUDA
        events; wall time far above it means the host kept the GPU waiting),
        ``batch``, ``batch_size`` and ``reserved_bytes`` (``solve_many``).
    """

    x: Any
    status: Status
    iterations: int = 0
    residual_norm: float = float("nan")
    b_norm: float = float("nan")
    device: str = "cpu"
    seconds: float = 0.0
    method: str = ""
    message: str = ""
    name: str | None = None
    info: dict = field(default_factory=dict)
    column_status: tuple[Status, ...] | None = None

    @property
    def converged(self) -> bool:
        return self.status is Status.CONVERGED

    @property
    def relative_residual(self) -> Any:
        """``||b - A x|| / ||b||`` (the norm itself when b is zero); per column for a 2-D b."""
        if np.ndim(self.b_norm):
            b = np.asarray(self.b_norm, dtype=np.float64)
            r = np.asarray(self.residual_norm, dtype=np.float64)
            usable = np.isfinite(b) & (b != 0)
            return np.where(usable, r / np.where(usable, b, 1.0), r)
        if not np.isfinite(self.b_norm) or self.b_norm == 0:
            return self.residual_norm
        return self.residual_norm / self.b_norm

    def raise_for_status(self) -> SolveResult:
        """Return self if converged, else raise :class:`SolveError` with the message."""
        if not self.converged:
            who = f" ({self.name})" if self.name else ""
            raise SolveError(
                f"solve{who}: {self.status.name}: {self.message or self.status.message}", self
            )
        return self

    def to_numpy(self) -> np.ndarray:
        """x as a NumPy array (a copy only when x is on a GPU)."""
        self._need_x("to_numpy")
        return np.asarray(_backend.to_host(self.x))

    def to_cupy(self, device: int | None = None):
        """x as a CuPy array (no copy when already on that GPU)."""
        self._need_x("to_cupy")
        cp = _backend.cupy()
        if device is None:
            return cp.asarray(self.x)
        with cp.cuda.Device(device):
            return cp.asarray(self.x)

    def to_torch(self):
        """x as a torch tensor sharing memory with ``x`` (DLPack, zero-copy, same device).

        When A's values or b were torch tensors requiring grad, the tensor is
        attached to the autograd graph (see :meth:`attach`).
        """
        attached = self.__dict__.get("_torch")
        if attached is not None:
            return attached
        self._need_x("to_torch")
        from .dlpack import as_torch

        return as_torch(self.x)

    def attach(self, tensor: Any) -> None:
        """Make ``to_torch()`` return ``tensor``: x attached to autograd by the layer that solved.

        The attachment is not pickled or copied (a graph stays in its process).
        """
        self.__dict__["_torch"] = tensor

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_torch", None)
        return state

    def _need_x(self, what: str) -> None:
        if self.x is None:
            raise ValueError(
                f"SolveResult.{what}(): this result has no solution (status {self.status.name}: "
                f"{self.message or self.status.message})"
            )

    def __repr__(self) -> str:
        n = None if self.x is None else getattr(self.x, "shape", (None,))[0]
        if self.column_status is not None:  # a 2-D b: the worst column
            k = len(self.column_status)
            its = int(np.max(self.iterations))
            rel = float(np.max(self.relative_residual))
            return (f"SolveResult(status={self.status.name}, n={n}, columns={k}, "
                    f"iterations<={its}, relative_residual<={rel:.3g}, device={self.device!r}, "
                    f"seconds={self.seconds:.3g})")
        return (
            f"SolveResult(status={self.status.name}, n={n}, iterations={self.iterations}, "
            f"relative_residual={self.relative_residual:.3g}, device={self.device!r}, "
            f"seconds={self.seconds:.3g})"
        )


class SlicedResult(SolveResult):
    """A result of a packed batch whose ``x`` is cut from the batch's solution when first read.

    Making a CuPy view costs microseconds, which over tens of thousands of
    results is work that ``solve_many`` would otherwise do on the GPU
    worker's thread between two batches; most callers read few of the ``x``.
    Everything else is a :class:`SolveResult`; a copy or a pickle is one, and
    ``dataclasses.replace`` works as on any result.
    """

    @classmethod
    def cut_many(cls, packed_x: Any, offsets: list[int], statuses: list[Status],
                 iterations: list[int], residual_norms: list[float], b_norms: list[float],
                 device: str, seconds: float, method: str, messages: list[str],
                 names: list[str | None], info: dict) -> list[SlicedResult]:
        """The results of a batch's systems, system k's ``x`` to be ``packed_x[offsets[k]:offsets[k + 1]]``.

        Lists by system; each result gets its own copy of ``info``. The
        constructor stays SolveResult's.

        Examples
        --------
        >>> x = np.arange(5.0)
        >>> a, b = SlicedResult.cut_many(x, [0, 2, 5], [Status.CONVERGED] * 2, [3, 4], [1e-9, 2e-9],
        ...                              [1.0, 1.0], "cpu", 0.1, "cg", ["", ""], ["a", "b"], {})
        >>> b.x.tolist(), b.name, b.info is a.info
        ([2.0, 3.0, 4.0], 'b', False)
        """
        new = object.__new__
        out = []
        for lo, hi, status, its, r, bn, message, name in zip(
                offsets[:-1], offsets[1:], statuses, iterations, residual_norms, b_norms,
                messages, names, strict=True):
            self = new(cls)
            d = self.__dict__
            # Three entries, not a tuple: a tuple holding an array is one more object
            # for the garbage collector to scan per result, and with many results a
            # full collection holds the GIL for that long.
            d["_src"], d["_lo"], d["_hi"] = packed_x, lo, hi
            d["status"], d["iterations"], d["residual_norm"], d["b_norm"] = status, its, r, bn
            d["device"], d["seconds"], d["method"], d["message"], d["name"], d["info"] = (
                device, seconds, method, message, name, info.copy())
            out.append(self)
        return out

    @property  # type: ignore[override]
    def x(self) -> Any:
        d = self.__dict__
        src = d.pop("_src", None)
        if src is not None:
            d["_x"] = src[d.pop("_lo"):d.pop("_hi")]
        return d.get("_x")

    @x.setter
    def x(self, value: Any) -> None:
        d = self.__dict__
        for key in ("_src", "_lo", "_hi"):
            d.pop(key, None)
        d["_x"] = value

    def __reduce__(self):
        return SolveResult, tuple(getattr(self, f.name) for f in fields(SolveResult))
