"""Row partitioning and halo maps (pure host code), and new values on the same layout."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from managed_solve.sharded import partition as part
from tests._problems import poisson2d


def reconstruct(p: part.Partition, A: sp.csr_matrix) -> list[sp.csr_matrix]:
    """Each shard's rows rebuilt in the permuted global numbering from its local block."""
    out = []
    for lay in p.shards:
        block = sp.vstack([lay.interior, lay.boundary]).tocoo()
        halo = np.append(lay.halo_global, -1)  # -1: a slot for owned entries' lookups
        glob = np.where(block.col < lay.nloc, block.col + lay.row_start,
                        halo[np.clip(block.col - lay.nloc, -1, None)])
        out.append(sp.csr_matrix((block.data, (block.row, glob)), shape=(lay.nloc, A.shape[1])))
    return out


def check_layout(p: part.Partition, A: sp.csr_matrix) -> None:
    n = A.shape[0]
    assert np.array_equal(np.sort(p.perm), np.arange(n))
    Ap = A[p.perm][:, p.perm].tocsr()
    for lay, rows in zip(p.shards, reconstruct(p, A), strict=True):
        ref = Ap[lay.row_start:lay.row_stop]
        assert (rows != ref).nnz == 0
        # Interior rows read owned columns only; boundary rows at least one halo column.
        if lay.interior.nnz:
            assert lay.interior.indices.max() < lay.nloc
        bnd_has_halo = np.diff((lay.boundary[:, lay.nloc:] != 0).tocsr().indptr) > 0
        assert bnd_has_halo.all()
        # Halo columns ascend and lie outside the block; recv slices cover them in order.
        h = lay.halo_global
        assert np.all(np.diff(h) > 0)
        assert not np.any((h >= lay.row_start) & (h < lay.row_stop))
        covered = []
        for src, a, b in lay.recv:
            assert np.all((h[a:b] >= p.offsets[src]) & (h[a:b] < p.offsets[src + 1]))
            covered.extend(range(a, b))
            sent = dict((t, idx) for t, idx in p.shards[src].send)[lay.index]
            assert np.array_equal(sent + p.offsets[src], h[a:b])
        assert covered == list(range(lay.nhalo))


@pytest.mark.parametrize("nparts", [1, 2, 3, 5])
@pytest.mark.parametrize("reorder", ["rcm", None])
def test_grid_layout_and_balance(nparts, reorder):
    A = poisson2d(24)
    p = part.build_partition(A, nparts, reorder=reorder)
    check_layout(p, A)
    nnz = p.nnz_per_shard()
    assert nnz.sum() == A.nnz
    # Balanced within one row (at most 5 entries) plus one row of the +1 weight.
    target = A.nnz / nparts
    assert np.all(np.abs(nnz - target) <= 2 * 5 + 2), nnz


def test_weights_give_proportional_shares():
    A = poisson2d(30)
    p = part.build_partition(A, 3, reorder=None, weights=[1, 2, 3])
    nnz = p.nnz_per_shard()
    share = nnz / nnz.sum()
    assert np.allclose(share, [1 / 6, 2 / 6, 3 / 6], atol=0.01)
    check_layout(p, A)


def test_explicit_offsets_are_kept():
    A = poisson2d(10)
    p = part.build_partition(A, 3, reorder=None, offsets=[0, 7, 60, 100])
    assert p.offsets.tolist() == [0, 7, 60, 100]
    check_layout(p, A)


def test_rcm_shrinks_halo_of_a_scrambled_grid():
    A = poisson2d(30)
    rng = np.random.default_rng(3)
    q = rng.permutation(A.shape[0])
    B = A[q][:, q].tocsr()
    scrambled = part.build_partition(B, 2, reorder=None).halo_sizes().sum()
    rcm = part.build_partition(B, 2, reorder="rcm").halo_sizes().sum()
    # The natural grid split exchanges one grid line each way (2 x 30); RCM
    # recovers a banded order, a random one cuts nearly every edge.
    assert rcm <= 4 * 30 < scrambled


@settings(max_examples=25)
@given(n=st.integers(2, 60), nparts=st.integers(1, 4), density=st.floats(0.02, 0.3),
       seed=st.integers(0, 10_000), reorder=st.sampled_from(["rcm", None]))
def test_random_matrices_layout(n, nparts, density, seed, reorder):
    nparts = min(nparts, n)
    A = (sp.random(n, n, density=density, random_state=seed, format="csr")
         + sp.eye(n, format="csr")).tocsr()
    p = part.build_partition(A, nparts, reorder=reorder)
    assert np.all(np.diff(p.offsets) >= 1)
    check_layout(p, A)


def test_more_parts_than_rows_with_entries():
    # Three of four rows hold only their diagonal: the nnz balance alone put
    # the last cut past the end (offsets [0, 1, 3, 4, 5] for n = 4).
    A = (sp.random(4, 4, density=0.25, random_state=2252, format="csr")
         + sp.eye(4, format="csr")).tocsr()
    p = part.build_partition(A, 4, reorder=None)
    assert p.offsets.tolist() == [0, 1, 2, 3, 4]
    check_layout(p, A)


@settings(max_examples=200)
@given(row_nnz=st.lists(st.integers(0, 50), min_size=1, max_size=40), data=st.data())
def test_balanced_row_blocks_always_cover_every_row_once(row_nnz, data):
    n = len(row_nnz)
    nparts = data.draw(st.integers(1, n))
    weights = data.draw(st.one_of(st.none(), st.lists(st.floats(0.01, 100.0), min_size=nparts,
                                                      max_size=nparts)))
    offs = part.balanced_row_blocks(row_nnz, nparts, weights)
    assert offs.shape == (nparts + 1,) and offs[0] == 0 and offs[-1] == n
    assert np.all(np.diff(offs) >= 1)


def test_balanced_row_blocks_examples():
    assert part.balanced_row_blocks([1, 1, 1, 1, 4], 2).tolist() == [0, 3, 5]
    # Heavy first row: it sits alone, the rest share the other block.
    assert part.balanced_row_blocks([50, 1, 1, 1], 2).tolist() == [0, 1, 4]
    # More parts than heavy spots: every block still gets a row.
    assert part.balanced_row_blocks([100, 0, 0], 3).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("kwargs, match", [
    ({"nparts": 0}, "nparts"),
    ({"nparts": 11}, "nparts"),
    ({"nparts": 2, "weights": [1, -1]}, "weights"),
    ({"nparts": 2, "weights": [1, 2, 3]}, "weights"),
])
def test_balanced_row_blocks_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        part.balanced_row_blocks(np.ones(10), **kwargs)


def test_build_partition_errors():
    A = poisson2d(4)
    with pytest.raises(ValueError, match="square"):
        part.build_partition(sp.random(3, 4, density=0.5, format="csr"), 2)
    with pytest.raises(ValueError, match="offsets"):
        part.build_partition(A, 2, offsets=[0, 0, 16])
    with pytest.raises(ValueError, match="reorder"):
        part.build_partition(A, 2, reorder="amd")


@pytest.mark.parametrize("nparts", [2, 3])
def test_metis_partition_layout_and_small_halo(nparts):
    pytest.importorskip("pymetis")  # the `metis` extra; installed by `make test`
    A = poisson2d(30)
    q = np.random.default_rng(5).permutation(A.shape[0])
    B = A[q][:, q].tocsr()
    p = part.build_partition(B, nparts, reorder="metis")
    check_layout(p, B)
    assert p.nnz_per_shard().sum() == B.nnz
    metis = p.halo_sizes().sum()
    scrambled = part.build_partition(B, nparts, reorder=None).halo_sizes().sum()
    # METIS cuts few edges of a grid: halos of a few grid lines, not most rows.
    assert metis <= 6 * 30 * (nparts - 1) < scrambled


def test_metis_sharded_solve_matches_spsolve():
    pytest.importorskip("pymetis")
    import scipy.sparse.linalg as spla

    from managed_solve import DeviceManager
    from managed_solve.sharded import solve_sharded

    A = poisson2d(20)
    b = np.random.default_rng(1).standard_normal(A.shape[0])
    res = solve_sharded(A, b, devices=["sim:0", "sim:1"], reorder="metis", rtol=1e-10,
                        manager=DeviceManager(simulate="2x1GiB"))
    assert res.converged and res.info["reorder"] == "metis"
    np.testing.assert_allclose(res.to_numpy(), spla.spsolve(A.tocsc(), b), rtol=1e-7, atol=1e-9)


def test_with_values_moves_values_and_keeps_the_layout():
    A = poisson2d(12)
    p = part.build_partition(A, 3, reorder="rcm")
    B = A.copy()
    B.data = np.arange(1.0, B.nnz + 1)
    q = p.with_values(B)
    check_layout(q, B)
    assert q.perm is p.perm and q.offsets is p.offsets
    assert [s.send for s in q.shards] == [s.send for s in p.shards]
    assert [s.recv for s in q.shards] == [s.recv for s in p.shards]
    # Column indices in another order inside each row: the same pattern, the same layout.
    order = np.lexsort((-B.indices, np.repeat(np.arange(144), np.diff(B.indptr))))
    unsorted = sp.csr_matrix((B.data[order], B.indices[order], B.indptr), shape=B.shape)
    assert not unsorted.has_sorted_indices
    check_layout(p.with_values(unsorted), B)
    with pytest.raises(ValueError, match="pattern differs"):
        p.with_values((A + sp.eye(144, k=40)).tocsr())
    with pytest.raises(ValueError, match="expected shape"):
        p.with_values(poisson2d(5))
