"""Smoothers of the V-cycle: damped Jacobi, l1-Jacobi and Chebyshev.

Every smoother is a fixed polynomial in ``D^-1 A`` applied to the scaled
residual, ``x <- x + p(D^-1 A) D^-1 (b - A x)``, with the same polynomial
before and after the coarse correction, so the V-cycle is a symmetric
operator when A is symmetric (valid inside CG). They write into work
vectors given to them (``out=`` forms; only the SpMV allocates) and read
nothing back on the host.

- ``"jacobi"``: ``sweeps`` steps with weight ``omega / rho(D^-1 A)``
  (``omega = 4/3``, the smoothing-optimal weight for Laplacians).
- ``"l1_jacobi"``: ``D`` replaced by the l1 row norms ``sum_j |a_ij|``
  (Baker, Falgout, Kolev and Yang 2011): convergent without an eigenvalue
  estimate.
- ``"chebyshev"``: the Chebyshev polynomial ``p`` of degree ``degree``
  (``degree`` SpMVs from a zero guess, one more after the coarse
  correction) smallest on ``[rho / ratio, rho]`` of ``D^-1 A``, the
  upper end raised by 10% against an underestimated ``rho``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .spectral import safe_inverse

NAMES = ("chebyshev", "jacobi", "l1_jacobi")
JACOBI_OMEGA = 4.0 / 3.0
#: ``rho / lower end`` of the interval the Chebyshev smoother damps. Smoothing
#: leaves the low end to the coarse grid; 8 beat 4, 15 and 30 on 2D and 3D
#: Poisson V-cycles (degrees 2 and 3).
CHEBYSHEV_RATIO = 8.0


def chebyshev_coefficients(lower: float, upper: float, degree: int) -> tuple[float, tuple]:
    """``(theta, ((a_k, b_k), ...))`` of the Chebyshev iteration for a spectrum in [lower, upper].

    The three-term recurrence of Saad's Algorithm 12.1, as host floats:
    every step's coefficients are known before the first application, so
    applying the polynomial reads nothing back from the device.
    """
    theta, delta = 0.5 * (upper + lower), 0.5 * (upper - lower)
    sigma = theta / delta
    coeffs = []
    rho = 1.0 / sigma
    for _ in range(int(degree)):
        rho_new = 1.0 / (2.0 * sigma - rho)
        coeffs.append((rho_new * rho, 2.0 * rho_new / delta))
        rho = rho_new
    return theta, tuple(coeffs)


@dataclass
class Smoother:
    """A polynomial smoother set up for one level's matrix."""

    kind: str
    xp: Any
    dinv: Any  # the scaling (with Jacobi's weight folded in)
    steps: int  # sweeps (Jacobi) or SpMVs of the polynomial (Chebyshev)
    theta: float = 1.0
    coeffs: tuple = ()

    def apply(self, A: Any, b: Any, x: Any, res: Any, d: Any, *, zero: bool) -> None:
        """Smooth ``A x = b`` in place; ``zero`` says x is 0 on entry (skips a residual)."""
        if self.kind == "chebyshev":
            self._chebyshev(A, b, x, res, d, zero)
        else:
            self._jacobi(A, b, x, res, zero)

    def _residual(self, A: Any, b: Any, x: Any, res: Any, zero: Any) -> None:
        """``res = dinv (b - A x)``."""
        xp = self.xp
        if zero:
            xp.multiply(self.dinv, b, out=res)
        else:
            xp.subtract(b, A @ x, out=res)
            res *= self.dinv

    def _jacobi(self, A: Any, b: Any, x: Any, res: Any, zero: bool) -> None:
        for s in range(self.steps):
            first = zero and s == 0
            self._residual(A, b, x, res, first)
            if first:
                x[...] = res
            else:
                x += res

    def _chebyshev(self, A: Any, b: Any, x: Any, res: Any, d: Any, zero: bool) -> None:
        xp = self.xp
        self._residual(A, b, x, res, zero)
        xp.multiply(res, 1.0 / self.theta, out=d)
        if zero:
            x[...] = d
        else:
            x += d
        for a, c in self.coeffs:
            t = A @ d
            t *= self.dinv
            res -= t
            d *= a
            d += c * res
            x += d


def make_smoother(kind: str, A: Any, dinv: Any, rho: float, xp: Any, *, degree: int = 2,
                  sweeps: int = 1, ratio: float | None = None) -> Smoother:
    """The smoother ``kind`` for a level with ``D^-1`` ``dinv`` and ``rho(D^-1 A)`` ``rho``."""
    if kind == "jacobi":
        return Smoother(kind, xp, (JACOBI_OMEGA / rho) * dinv, int(sweeps))
    if kind == "l1_jacobi":
        l1 = abs(A) @ xp.ones(A.shape[0], dtype=A.dtype)
        return Smoother(kind, xp, safe_inverse(xp, l1), int(sweeps))
    if kind == "chebyshev":
        upper = 1.1 * rho
        lower = upper / float(ratio if ratio is not None else CHEBYSHEV_RATIO)
        theta, coeffs = chebyshev_coefficients(lower, upper, degree)
        return Smoother(kind, xp, dinv, int(degree), theta=theta, coeffs=coeffs)
    raise ValueError(f"amg(smoother={kind!r}): expected one of {', '.join(NAMES)}.")

