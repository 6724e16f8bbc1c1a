"""The fused V-cycle: the cycle of :mod:`.cycle` as a fixed sequence of one-pass kernels.

The operations come from ``ops``: :class:`~.kernels.CudaOps` (``cycle.cu``)
on a GPU, :class:`~.twins.TwinOps` (their NumPy twins) on the host, where
the tests run the same sequence. Per level and cycle (Chebyshev of degree
``k``):

- pre-smoothing from zero: ``x = d = dinv b / theta``, then ``k`` steps,
  each one kernel: ``r = dinv (b - A x)``, ``d = a d + c r``,
  ``x_new = x + d``. A step takes the previous update ``d`` as
  ``x - x_prev`` from the two alternating ``x`` buffers (the one it writes
  still holds ``x_prev``); only the step after the folded first one, whose
  ``x0`` is never stored, reads a stored ``d``: a degree-1 smoothing keeps no
  ``d`` vector and writes none. The zero-start scaling is folded into the first step
  (its product reads ``dinv b / theta`` of the neighbours as it goes), so
  it costs no pass of its own; Jacobi with one sweep, which has no step
  before the restriction, keeps the elementwise scaling. The residual is recomputed from ``x`` inside the
  product rather than carried, so ``x`` alternates between two buffers (a
  row's neighbours read the old one) and no residual vector is stored;
- residual and restriction in one kernel: ``b_c = P^T (b - A x)``, scattered
  with atomics into the zeroed coarse vector. Only ``P`` is stored: the
  restriction reads P's rows once, as the prolongation does, and the
  scatter targets the coarse vector, small enough to stay in L2; a stored
  ``R`` would cost a second copy of P's bytes for no fewer ones moved;
- the coarsest solve, a dense product with the inverse;
- prolongation with the correction, ``x += P x_c``, one kernel, then
  ``k + 1`` smoothing steps (the first with ``a = 0, c = 1 / theta``).

Jacobi runs the same steps with ``a = 0, c = 1``. A level holds ``b``, two
``x`` buffers and, for degree 2 and more, ``d`` (the coarsest ``b`` and ``x``); which ``x`` buffer
ends a smoothing is fixed by the step count, so the sequence, and every
pointer in it, is the same on every run: nothing allocates, nothing is read
on the host, and the whole cycle is captured as one CUDA graph.
"""

from __future__ import annotations

from typing import Any

from .cycle import CapturedCycle


class FusedCycle(CapturedCycle):
    """One V-cycle through ``ops`` over CSR arrays ``(indptr, indices, data)`` of A and P per level.

    ``mats``: ``(A, P)`` per level as array triples in ``dtype`` (``P`` None
    on the coarsest); ``smoothers``: the :class:`~.smoothers.Smoother` of
    every level but the coarsest (their ``dinv``, steps and coefficients).
    """

    def __init__(self, xp: Any, ops: Any, mats: list[tuple[Any, Any]], smoothers: list[Any],
                 coarse_inv: Any, dtype: Any):
        self.xp, self.ops = xp, ops
        self.mats, self.smoothers, self.coarse_inv = mats, smoothers, coarse_inv
        self.sizes = [A[0].shape[0] - 1 for A, _ in mats]
        last = len(mats) - 1
        self.b = [xp.zeros(n, dtype=dtype) for n in self.sizes]
        self.xs = [(xp.zeros(n, dtype=dtype), xp.zeros(n, dtype=dtype)) if lv < last
                   else (xp.zeros(n, dtype=dtype),) for lv, n in enumerate(self.sizes)]
        # d: the update a step hands to the next where x0 is never stored (the
        # pre-smoothing's second step, Chebyshev of degree 2 and more); every
        # other step reads it from the x buffers, so degree 1 keeps no d.
        self.d = [xp.zeros(n if sm.kind == "chebyshev" and len(sm.coeffs) > 1 else 1,
                           dtype=dtype) for n, sm in zip(self.sizes[:last], smoothers, strict=True)]
        self.x = [pair[0] for pair in self.xs]  # each level's first buffer
        self.graph = None
        self._graph_keep = ()
        self._out = self.x[0]

    # -- smoothing: each returns the buffer (0 or 1) that holds x afterwards ------------
    def _pre(self, lv: int) -> int:
        sm, (A, _), n = self.smoothers[lv], self.mats[lv], self.sizes[lv]
        X, b, d = self.xs[lv], self.b[lv], self.d[lv]
        cheb = sm.kind == "chebyshev"
        scale = 1.0 / sm.theta if cheb else 1.0
        steps = sm.coeffs if cheb else ((0.0, 1.0),) * (sm.steps - 1)
        prev = 0
        if steps:  # the scaling folded into the first step: one pass fewer
            a, c = steps[0]
            # x0 is never stored: the next step takes this step's update from d
            self.ops.first(n, *A, sm.dinv, b, scale, X[1], d, a, c, int(cheb and len(steps) > 1))
            cur, steps, prev = 1, steps[1:], 1
        else:
            self.ops.scale(n, b, sm.dinv, scale, X[0], d, 0)
            cur = 0
        for a, c in steps:
            self.ops.step(n, *A, sm.dinv, b, X[cur], X[1 - cur], d, a, c, 0,
                          prev if cheb else 0)
            cur, prev = 1 - cur, 2
        return cur

    def _post(self, lv: int, cur: int) -> int:
        sm, (A, _), n = self.smoothers[lv], self.mats[lv], self.sizes[lv]
        X, b, d = self.xs[lv], self.b[lv], self.d[lv]
        cheb = sm.kind == "chebyshev"
        steps = ((0.0, 1.0 / sm.theta), *sm.coeffs) if cheb else ((0.0, 1.0),) * sm.steps
        prev = 0  # the first step after the correction has no previous update
        for a, c in steps:
            self.ops.step(n, *A, sm.dinv, b, X[cur], X[1 - cur], d, a, c, 0,
                          prev if cheb else 0)
            cur, prev = 1 - cur, 2
        return cur

    def run(self) -> None:
        """``result() = M b[0]``: the sequence of the module's docstring."""
        ops, last = self.ops, len(self.mats) - 1
        cur = [0] * (last + 1)
        for lv in range(last):
            cur[lv] = self._pre(lv)
            A, P = self.mats[lv]
            ops.zero(self.sizes[lv + 1], self.b[lv + 1])
            ops.restrict(self.sizes[lv], *A, self.b[lv], self.xs[lv][cur[lv]], *P,
                         self.b[lv + 1])
        ops.dense(self.sizes[last], self.coarse_inv, self.b[last], self.xs[last][0])
        for lv in range(last - 1, -1, -1):
            _, P = self.mats[lv]
            ops.prolong(self.sizes[lv], *P, self.xs[lv + 1][cur[lv + 1]],
                        self.xs[lv][cur[lv]])
            cur[lv] = self._post(lv, cur[lv])
        self._out = self.xs[0][cur[0]]

    def result(self) -> Any:
        """The buffer that holds ``M b[0]`` after :meth:`run` (the same one on every run)."""
        return self._out

    def nbytes(self) -> int:
        """Bytes of the cycle's own vectors and coarse inverse."""
        vecs = [*self.b, *(v for pair in self.xs for v in pair), *self.d]
        return int(self.coarse_inv.nbytes + sum(v.nbytes for v in vecs))
