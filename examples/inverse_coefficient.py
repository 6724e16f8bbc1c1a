"""Recover a diffusion coefficient from noisy solutions, by gradient descent through ``solve_many``.

The forward model is ``-div(kappa grad u_s) = f_s`` on the unit square with
``u_s = 0`` on the boundary, for 64 sources ``f_s``, discretised with the
5-point finite-volume stencil on an m x m grid of unknowns. Given noisy
observations of every ``u_s``, we look for ``kappa(x, y)``:

1. ``log kappa`` lives on a coarse c x c grid (the parameters ``theta``) and
   is interpolated bilinearly to the fine grid's nodes: fewer unknowns than
   data, and a smooth field by construction.
2. The operator's CSR values are assembled in torch from kappa (each face's
   coefficient, the mean of its two nodes' kappa, added to four entries):
   ``values`` is a differentiable function of ``theta``; the pattern is fixed.
3. Every step solves the 64 systems with one ``ms.solve_many`` call (batched
   on a GPU, LU on the CPU) and ``loss.backward()`` solves their 64 adjoints
   on what the forward prepared; torch carries ``dL/dvalues`` back to
   ``theta``; Adam updates it.
4. The loss is the mean squared misfit to the observations plus a small
   smoothness penalty on ``theta``.

Run: ``python examples/inverse_coefficient.py [--small] [--device cpu|cuda:0]``
(a GPU by default when there is one; ``--small`` runs a small grid on the
CPU); prints ``rel_error_start=...``, ``rel_error_end=...`` (relative L2
error of kappa on the grid against the true field), ``loss_start=...`` and
``loss_end=...``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.sparse as sp

import managed_solve as ms


def true_log_kappa(x, y):
    """The field to recover: a conductive inclusion and a resistive one on a slight gradient."""
    return (0.6 * np.exp(-((x - 0.3) ** 2 + (y - 0.65) ** 2) / 0.03)
            - 0.5 * np.exp(-((x - 0.7) ** 2 + (y - 0.3) ** 2) / 0.04) + 0.2 * (x - 0.5))


def interpolation(m, c):
    """(m+2)^2 x c^2 matrix: bilinear interpolation from a c x c grid to the (m+2)^2 nodes.

    Both grids span the closed unit square; the fine one includes the
    boundary nodes, whose kappa the boundary faces use.
    """
    t = np.linspace(0.0, 1.0, m + 2) * (c - 1)
    k = np.minimum(np.floor(t).astype(int), c - 2)
    w = t - k
    one_d = sp.csr_matrix((np.concatenate([1 - w, w]),
                           (np.tile(np.arange(m + 2), 2), np.concatenate([k, k + 1]))),
                          shape=(m + 2, c))
    return sp.kron(one_d, one_d).toarray()  # node (i, j) at i * (m + 2) + j


def stencil(m):
    """The operator's fixed CSR pattern and how each face's coefficient enters its values.

    Returns ``(indptr, indices, slots, faces, signs, face_nodes)``: value
    ``slots[k]`` receives ``signs[k] * kappa_face[faces[k]] / h^2``, and
    face f joins the nodes ``face_nodes[f]`` (indices into the (m+2)^2 grid
    of nodes, boundary included). Unknowns are the interior nodes, row-major.
    """
    N = m + 2
    node = np.arange(N * N).reshape(N, N)
    unknown = -np.ones((N, N), dtype=np.int64)
    unknown[1:-1, 1:-1] = np.arange(m * m).reshape(m, m)
    # Every face between two nodes of which at least one is an unknown.
    pairs = [(node[:-1, :].ravel(), node[1:, :].ravel()), (node[:, :-1].ravel(), node[:, 1:].ravel())]
    a = np.concatenate([p[0] for p in pairs])
    b = np.concatenate([p[1] for p in pairs])
    ua, ub = unknown.ravel()[a], unknown.ravel()[b]
    keep = (ua >= 0) | (ub >= 0)
    a, b, ua, ub = a[keep], b[keep], ua[keep], ub[keep]
    f = np.arange(a.size)
    rows, cols, faces, signs = [], [], [], []
    for u, v in ((ua, ub), (ub, ua)):
        on = u >= 0  # each unknown end: + on its diagonal, - to an unknown neighbour
        rows += [u[on]]
        cols += [u[on]]
        faces += [f[on]]
        signs += [np.ones(on.sum())]
        both = on & (v >= 0)
        rows += [u[both]]
        cols += [v[both]]
        faces += [f[both]]
        signs += [-np.ones(both.sum())]
    rows, cols = np.concatenate(rows), np.concatenate(cols)
    pattern = sp.csr_matrix((np.ones(rows.size), (rows, cols)), shape=(m * m, m * m))
    pattern.sort_indices()
    where = sp.csr_matrix((np.arange(1, pattern.nnz + 1, dtype=np.float64), pattern.indices,
                           pattern.indptr), shape=pattern.shape)
    slots = np.asarray(where[rows, cols]).ravel().astype(np.int64) - 1
    return (pattern.indptr, pattern.indices, slots, np.concatenate(faces), np.concatenate(signs),
            np.stack([a, b], axis=1))


class Problem:
    """The grid, the sources, and the differentiable assembly, as torch tensors on ``device``."""

    def __init__(self, torch, m, c, n_sources, noise, device, seed=0):
        self.torch, self.m, self.device = torch, m, device
        h = 1.0 / (m + 1)
        t = lambda a, dt=torch.float64: torch.as_tensor(np.asarray(a), dtype=dt, device=device)  # noqa: E731
        indptr, indices, slots, faces, signs, face_nodes = stencil(m)
        self.crow, self.col = t(indptr, torch.int64), t(indices, torch.int64)
        self.nnz = indices.size
        self.slots, self.faces = t(slots, torch.int64), t(faces, torch.int64)
        self.coef = t(signs / h ** 2)
        self.face_nodes = t(face_nodes, torch.int64)
        self.P = t(interpolation(m, c))
        xs = np.linspace(0.0, 1.0, m + 2)
        X, Y = np.meshgrid(xs, xs, indexing="ij")
        self.kappa_true = t(np.exp(true_log_kappa(X, Y)).ravel())
        # Sources: a few Gaussian bumps each, at random places (every region gets excited).
        rng = np.random.default_rng(seed)
        Xi, Yi = X[1:-1, 1:-1].ravel(), Y[1:-1, 1:-1].ravel()
        F = np.zeros((n_sources, m * m))
        for s in range(n_sources):
            for cx, cy, amp in zip(rng.uniform(0.1, 0.9, 3), rng.uniform(0.1, 0.9, 3),
                                   rng.uniform(0.5, 1.5, 3), strict=True):
                F[s] += amp * np.exp(-((Xi - cx) ** 2 + (Yi - cy) ** 2) / 0.01) * 100.0
        self.sources = [t(f) for f in F]
        # Observations: the true field's solutions, plus noise of `noise` x their RMS.
        with torch.no_grad():
            clean = self.solve(self.values(self.kappa_true))
        scale = float(torch.stack(clean).pow(2).mean().sqrt())
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        self.observed = [u + t(torch.randn(u.shape, generator=gen, dtype=torch.float64).numpy())
                         * noise * scale for u in clean]
        self.data_scale = scale ** 2

    def kappa(self, theta):
        """kappa at the (m+2)^2 nodes from the coarse log-kappa ``theta`` (c^2 values)."""
        return self.torch.exp(self.P @ theta)

    def values(self, kappa):
        """The operator's CSR values: each face's mean kappa, scattered into its four entries."""
        face_kappa = 0.5 * (kappa[self.face_nodes[:, 0]] + kappa[self.face_nodes[:, 1]])
        contrib = self.coef * face_kappa[self.faces]
        zeros = self.torch.zeros(self.nnz, dtype=kappa.dtype, device=kappa.device)
        return zeros.index_add(0, self.slots, contrib)

    def solve(self, values):
        """All sources' solutions for one operator: one ``solve_many`` call, attached to autograd."""
        A = (self.crow, self.col, values)
        results = ms.solve_many([ms.LinearSystem(A, f, rtol=1e-10) for f in self.sources],
                                on_error="raise")
        return [r.to_torch() for r in results]

    def misfit(self, us):
        torch = self.torch
        return torch.stack([(u - d).pow(2).mean() for u, d in zip(us, self.observed, strict=True)]
                           ).mean() / self.data_scale

    def rel_error(self, kappa):
        return float((kappa - self.kappa_true).norm() / self.kappa_true.norm())


def smoothness(torch, theta, c):
    """Mean squared difference of neighbouring coarse values (a discrete H1 seminorm)."""
    T = theta.reshape(c, c)
    return (T[1:, :] - T[:-1, :]).pow(2).mean() + (T[:, 1:] - T[:, :-1]).pow(2).mean()


def run(m, c, n_sources, steps, lr, noise, reg, device, verbose=True):
    torch = ms._backend.torch_module()
    problem = Problem(torch, m, c, n_sources, noise, device)
    theta = torch.zeros(c * c, dtype=torch.float64, device=device, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=lr)
    err_start = problem.rel_error(problem.kappa(theta).detach())
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        opt.zero_grad()
        us = problem.solve(problem.values(problem.kappa(theta)))
        misfit = problem.misfit(us)
        loss = misfit + reg * smoothness(torch, theta, c)
        loss.backward()
        opt.step()
        losses.append(float(misfit.detach()))
        if verbose and (step % max(1, steps // 10) == 0 or step == steps - 1):
            err = problem.rel_error(problem.kappa(theta).detach())
            print(f"step {step:4d}  misfit {losses[-1]:.3e}  kappa rel. error {err:.3f}")
    seconds = time.perf_counter() - t0
    err_end = problem.rel_error(problem.kappa(theta).detach())
    return err_start, err_end, losses[0], losses[-1], seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a small grid on the CPU (seconds)")
    ap.add_argument("--device", default=None, help="cpu or cuda:i (default: a GPU if any)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--sources", type=int, default=64)
    args = ap.parse_args(argv)
    torch = ms._backend.torch_module()
    if args.small:
        m, c, steps, lr = 16, 6, 40, 0.1
        device = args.device or "cpu"
    else:
        m, c, steps, lr = 96, 12, 150, 0.05
        device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    steps = args.steps if args.steps is not None else steps
    print(f"recovering kappa on a {m}x{m} grid ({c}x{c} parameters) from {args.sources} "
          f"noisy solutions, {steps} Adam steps on {device}")
    err0, err1, loss0, loss1, seconds = run(m, c, args.sources, steps, lr, noise=0.01, reg=1e-4,
                                            device=device)
    print(f"{steps} steps in {seconds:.1f} s ({seconds / steps * 1e3:.0f} ms a step: "
          f"{args.sources} solves and their adjoints)")
    print(f"rel_error_start={err0:.4f}")
    print(f"rel_error_end={err1:.4f}")
    print(f"loss_start={loss0:.4e}")
    print(f"loss_end={loss1:.4e}")
    return err0, err1, loss0, loss1


if __name__ == "__main__":
    main()
