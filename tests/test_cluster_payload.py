"""What a system becomes on its way to a Ray node, without Ray: the payload and the node's solve.

``tests/test_cluster.py`` needs Ray; the payload a chunk carries, and the
node side that solves it (:class:`managed_solve.cluster._NodeSolver` with its
own DeviceManager), are plain Python and are checked here.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import LinearSystem, Status
from managed_solve import cluster as cl
from tests._problems import laplacian1d, poisson2d


def pinv_solution(A, b):
    return np.linalg.pinv(A.toarray(), rcond=1e-10) @ b


def travelled(s: LinearSystem) -> LinearSystem:
    """``s`` as a node receives it: its payload pickled (as Ray's object store does) and read."""
    return cl._from_payload(pickle.loads(pickle.dumps(cl._payload(s))))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_null_space_travels_with_its_system(dtype):
    """The payload left nullspace= out: the node solved a singular system without it."""
    L = laplacian1d(15, neumann=True)
    A = sp.block_diag([L, 2.0 * L], format="csr").astype(dtype)
    N = np.zeros((30, 2))
    N[:15, 0] = N[15:, 1] = 1.0
    b = (A @ np.random.default_rng(3).standard_normal(30)).astype(dtype)
    for given in ("constant", N):
        s = LinearSystem(A, b, nullspace=given, name="neumann")
        t = travelled(s)
        assert t.nullspace is not None and t.nullspace.dtype == s.nullspace.dtype
        np.testing.assert_array_equal(t.nullspace, s.nullspace)
        assert (t.n, t.dtype, t.name, t.method, t.rtol) == (s.n, s.dtype, s.name, s.method, s.rtol)
    assert travelled(LinearSystem(poisson2d(3), np.ones(9))).nullspace is None


def test_a_node_solves_a_singular_system_with_its_null_space():
    """On the node, the local scheduler projects as solve() does: the pseudo-inverse's answer,
    LEAST_SQUARES for a b with a part along the constants."""
    A = laplacian1d(40, neumann=True)
    rng = np.random.default_rng(7)
    b = A @ rng.standard_normal(40)
    systems = [LinearSystem(A, b, nullspace="constant", method=m, name=f"s{k}", rtol=1e-10)
               for k, m in enumerate(("cg", "minres", "direct"))]
    systems.append(LinearSystem(A, b + 0.5, nullspace="constant", method="cg", name="off",
                                rtol=1e-10))
    node = cl._NodeSolver("node0", {})
    meta, *xs = node.solve_chunk([cl._payload(s) for s in systems])
    statuses = [Status[m["status"]] for m in meta["results"]]
    assert statuses == [Status.CONVERGED] * 3 + [Status.LEAST_SQUARES], meta["results"]
    for s, x in zip(systems, xs, strict=True):
        np.testing.assert_allclose(x, pinv_solution(A, s.b), rtol=1e-7, atol=1e-9)
