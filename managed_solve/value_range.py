"""Whether the entries an assembly would make fit its value type, decided before any kernel runs.

Entries below the value type's smallest normal number are stored as
subnormal numbers or zeros: they lose their digits or vanish, and the
system solved with them is singular or wrong (a float32 mass matrix of a
mesh near 1e-20, a float32 grid of side 1e25). Entries beyond its largest
are infinite. The mesh builders (:mod:`managed_solve.assembly`,
:mod:`managed_solve.pde`) refuse both, naming the argument to change.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .mesh import Mesh

__all__ = ["check_floors", "check_grid_range", "entry_floors"]


def entry_floors(mesh: Mesh) -> dict[str, float]:
    """Per unit coefficient, the least an element adds to the entries of ``L``, ``M`` and ``D``.

    To its vertices' diagonal of ``L`` a triangle adds at least its shape
    ``s`` (``sin(a) / (2 sin(b) sin(c))``, its smallest sine being at least
    ``2 s``), a tetrahedron at least ``s * h`` (a face's area over three times
    its height, at least ``vol / h**2``); to the consistent mass its measure
    over 12 (20), to the lumped one over 3 (4). Host arithmetic on the mesh's
    own facts, cached on it.
    """
    hit = mesh.cache.get("entry_floors")
    if hit is None:
        measure, shape = mesh.element_measures(), mesh.element_shapes()
        tri = mesh.kind == "triangle"
        with np.errstate(under="ignore"):
            stiff = shape if tri else np.cbrt(measure * shape * shape)
        low = float(measure.min())
        hit = mesh.cache["entry_floors"] = {"L": float(stiff.min()), "M": low / (12 if tri else 20),
                                               "D": low / (3 if tri else 4)}
    return hit


def check_floors(mesh: Mesh, dt: np.dtype, call: str, terms: list) -> None:
    """Refuse a term whose entries fall below ``dt``'s normal range, naming the mesh or the coefficient.

    ``terms``: ``(term, coefficient, its name)`` for each term asked for (a
    zero coefficient leaves it out), optionally with the arguments to show
    for the coefficient (``"dt=0.1, kappa=1e-40"`` for ``dt * kappa``; else
    ``name=coefficient``). Stored as subnormal numbers or zeros, such
    entries lose their digits or vanish, and the system solved with them is
    singular or wrong (a float32 mass of a mesh near 1e-20). Decided on the
    host from the mesh, before any kernel runs.
    """
    if dt.kind != "f":
        return  # the assembly refuses the dtype, naming it
    tiny, floors = float(np.finfo(dt).tiny), entry_floors(mesh)
    f32 = dt == np.float32
    for term, coef, name, *shown in terms:
        low, scale = abs(coef) * floors[term], floors[term] < tiny
        if coef == 0 or low >= tiny:
            continue
        if scale:  # the mesh itself: its term at a unit coefficient is already out of range
            label = {"L": "the stiffness matrix L", "M": "the mass matrix M",
                     "D": "the lumped mass D"}[term]
            fix = (f"the smallest element {'area' if mesh.kind == 'triangle' else 'volume'} is "
                   f"{float(mesh.element_measures().min()):.3g}: scale the mesh up, e.g. "
                   f"Mesh(mesh.vertices / {float(np.abs(mesh.vertices).max()):.3g}, mesh.faces)"
                   + (", or use dtype=np.float64" if f32 else ""))
        else:
            label, fix = f"{name} * {term}", f"use a larger {name}" + (", or dtype=np.float64" if f32 else "")
        given = "mesh=..." if scale else (shown[0] if shown else f"{name}={coef!r}")
        raise ValueError(f"{call}({given}, dtype={dt.name}): "
                         f"{label} has entries down to about {low:.3g}, below {dt.name}'s smallest "
                         f"normal number {tiny:.3g}, where they would lose their digits or vanish; "
                         f"{fix}")


def check_grid_range(faces: tuple, ih: list, dt: np.dtype, call: str, lengths: Any) -> None:
    """Refuse a grid matrix whose entries ``c / h**2`` leave ``dt``'s normal range, naming ``lengths``.

    ``faces``: each axis's face coefficients; ``ih``: ``1 / h**2`` per axis.
    The smallest entry is an off-diagonal one, the largest at most a
    diagonal's ``2 sum(c / h**2)``; subnormal entries lose their digits or
    vanish (a float32 grid of side 1e25), infinite ones make A non-finite.
    """
    if dt.kind != "f":
        return  # the assembly refuses the dtype, naming it
    info = np.finfo(dt)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        low = min(float(f.min()) * w for f, w in zip(faces, ih, strict=False))
        high = sum(2.0 * float(f.max()) * w for f, w in zip(faces, ih, strict=False))
    if low >= float(info.tiny) and high <= float(info.max):
        return
    small = low < float(info.tiny)
    found = (f"entries down to about {low:.3g}, below {dt.name}'s smallest normal number "
             f"{float(info.tiny):.3g}, where they would lose their digits or vanish" if small else
             f"entries up to about {high:.3g}, beyond {dt.name}'s largest {float(info.max):.3g}")
    fix = ("scale the box to a size near 1 (x in units of L: divide the coefficient by L**2, or "
           "multiply f by L**2)" + (", or use dtype=np.float64" if dt == np.float32 else ""))
    raise ValueError(f"{call}(lengths={lengths!r}, dtype={dt.name}): the grid matrix (coefficient "
                     f"/ h**2, h = L/(n+1)) has {found}; {fix}")
