"""Row partitioning and halo maps for one sparse system sharded over several devices.

Pure host code (NumPy/SciPy), no devices: :mod:`managed_solve.sharded.layout`
turns a :class:`Partition` into arrays on GPUs (or simulated GPUs). The layout follows
the classic distributed-CSR split (PETSc's MPIAIJ, Trilinos' Tpetra maps):

* an optional bandwidth-reducing reordering (reverse Cuthill-McKee) first, so
  that contiguous row blocks touch few columns of other blocks;
* contiguous row blocks balanced by stored entries (nnz), optionally in
  proportion to per-shard weights (uneven devices);
* inside each block, *interior* rows (all columns owned by the block) come
  first and *boundary* rows (at least one column owned elsewhere) last, so
  the interior product can run while the halo is in flight and the boundary
  product writes one contiguous tail of the output;
* local columns: the block's own rows first (``0 .. nloc-1``), then the halo
  columns it reads from other blocks (``nloc .. nloc+nhalo-1``), grouped by
  owner and ascending, so what one neighbour sends lands in one contiguous
  slice of the halo.

All of it composes into one permutation ``perm`` (new index -> original
index): shard ``s`` owns ``perm[offsets[s]:offsets[s+1]]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

__all__ = [
    "Partition",
    "ShardLayout",
    "balanced_row_blocks",
    "build_partition",
    "rcm_permutation",
]


@dataclass
class ShardLayout:
    """What one shard holds, in its local numbering (host arrays).

    Attributes
    ----------
    index : int
        Shard number.
    row_start, row_stop : int
        Its rows in the partition's (permuted) global numbering.
    n_interior : int
        Local rows ``0 .. n_interior-1`` read only owned columns.
    interior, boundary : scipy.sparse.csr_matrix
        Rows ``[:n_interior]`` and ``[n_interior:]`` of the local block, both with
        ``nloc + nhalo`` columns (owned columns, then halo columns).
    halo_global : ndarray of int64
        Global (permuted) index of each halo column, ascending.
    recv : list of (source shard, start, stop)
        Halo columns ``nloc+start .. nloc+stop-1`` come from that shard.
    send : list of (destination shard, ndarray of local indices)
        Entries of this shard's vector that destination needs, in the order it
        stores them in its halo.
    """

    index: int
    row_start: int
    row_stop: int
    n_interior: int
    interior: sp.csr_matrix
    boundary: sp.csr_matrix
    halo_global: np.ndarray
    recv: list[tuple[int, int, int]] = field(default_factory=list)
    send: list[tuple[int, np.ndarray]] = field(default_factory=list)

    @property
    def nloc(self) -> int:
        return self.row_stop - self.row_start

    @property
    def nhalo(self) -> int:
        return int(self.halo_global.size)

    @property
    def nnz(self) -> int:
        return int(self.interior.nnz + self.boundary.nnz)


@dataclass
class Partition:
    """Row blocks, the composed permutation and every shard's local block and halo maps."""

    n: int
    perm: np.ndarray  # new -> original
    offsets: np.ndarray  # (nshards + 1,) row offsets in the new numbering
    shards: list[ShardLayout]
    reorder: str | None

    @property
    def nshards(self) -> int:
        return len(self.shards)

    @property
    def inverse_perm(self) -> np.ndarray:
        """original -> new."""
        inv = np.empty_like(self.perm)
        inv[self.perm] = np.arange(self.perm.size, dtype=self.perm.dtype)
        return inv

    def nnz_per_shard(self) -> np.ndarray:
        return np.array([s.nnz for s in self.shards], dtype=np.int64)

    def halo_sizes(self) -> np.ndarray:
        return np.array([s.nhalo for s in self.shards], dtype=np.int64)

    def with_values(self, A: sp.spmatrix) -> Partition:
        """The same partition holding ``A``'s values; ``A`` must have the pattern it was built from.

        Only the values move: the permutation, row blocks and halo maps stay,
        so a matrix whose entries changed but not where they are (a new time
        step, a new coefficient) is redistributed without partitioning again.

        Raises
        ------
        ValueError
            ``A`` has another shape or sparsity pattern.

        Examples
        --------
        >>> import scipy.sparse as sp
        >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(6, 6)).tocsr()
        >>> p = build_partition(A, 2, reorder=None).with_values(3 * A)
        >>> p.shards[0].interior.diagonal().tolist()
        [6.0, 6.0]
        """
        A = sp.csr_matrix(A)
        if A.shape != (self.n, self.n):
            raise ValueError(
                f"Partition.with_values(A=...): expected shape {(self.n, self.n)}, got {A.shape}; "
                "a matrix of another size needs its own partition (build_partition).")
        inv = self.inverse_perm
        shards = []
        for old in self.shards:
            new = _shard_layout(A, self.perm, inv, self.offsets, old.index, old.n_interior)
            same = (np.array_equal(new.halo_global, old.halo_global)
                    and all(np.array_equal(getattr(getattr(new, part), a), getattr(getattr(old, part), a))
                            for part in ("interior", "boundary") for a in ("indptr", "indices")))
            if not same:
                raise ValueError(
                    "Partition.with_values(A=...): A's sparsity pattern differs from the one "
                    f"this partition was built from (rows {old.row_start}..{old.row_stop - 1} of "
                    "the partition order); partition the new matrix with build_partition, or "
                    "keep explicit zeros so the pattern stays the same.")
            new.send = old.send
            shards.append(new)
        return Partition(self.n, self.perm, self.offsets, shards, self.reorder)


def rcm_permutation(A: sp.spmatrix) -> np.ndarray:
    """Reverse Cuthill-McKee ordering of ``A``'s pattern (symmetrised), new -> original.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> A = sp.diags([1.0, 2.0, 1.0], [-1, 0, 1], shape=(5, 5)).tocsr()
    >>> sorted(rcm_permutation(A).tolist())
    [0, 1, 2, 3, 4]
    """
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    A = sp.csr_matrix(A)
    pattern = A if _pattern_symmetric(A) else (abs(A) + abs(A.T)).tocsr()
    return np.asarray(reverse_cuthill_mckee(pattern, symmetric_mode=True), dtype=np.int64)


def _pattern_symmetric(A: sp.csr_matrix) -> bool:
    P = A.copy()
    P.data = np.ones_like(P.data, dtype=np.int8)
    return (P != P.T).nnz == 0


def balanced_row_blocks(row_nnz: np.ndarray, nparts: int,
                        weights: Sequence[float] | None = None) -> np.ndarray:
    """Contiguous row blocks whose stored entries follow ``weights`` (equal by default).

    Parameters
    ----------
    row_nnz : array of int, shape (n,)
        Stored entries of each row, in the order rows will be split.
    nparts : int
        Number of blocks.
    weights : sequence of float, optional
        Relative share of entries per block (``[1, 2]``: the second block gets
        about twice the entries of the first).

    Returns
    -------
    ndarray of int64, shape (nparts + 1,)
        Row offsets; every block has at least one row.

    Examples
    --------
    >>> balanced_row_blocks([1, 1, 1, 1, 4], 2).tolist()
    [0, 3, 5]
    >>> balanced_row_blocks([1] * 9, 3, weights=[1, 1, 1]).tolist()
    [0, 3, 6, 9]
    """
    row_nnz = np.asarray(row_nnz, dtype=np.int64)
    n = row_nnz.size
    if nparts < 1 or nparts > n:
        raise ValueError(
            f"balanced_row_blocks(nparts={nparts}): expected 1 <= nparts <= rows ({n}); "
            "use fewer shards for a matrix this small."
        )
    w = np.ones(nparts) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (nparts,) or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(
            f"balanced_row_blocks(weights={weights!r}): expected {nparts} positive numbers, "
            "one per shard, e.g. [1.0] * nshards."
        )
    # Weight rows by nnz + 1: an empty row still costs its vector entries, and
    # the +1 keeps the cumulative strictly increasing so no block is empty
    # by ties.
    cum = np.cumsum(row_nnz + 1)
    targets = cum[-1] * np.cumsum(w)[:-1] / w.sum()
    cuts = np.searchsorted(cum, targets, side="left") + 1
    # Round each cut to whichever neighbour boundary is closer to its target.
    prev = np.where(cuts - 2 >= 0, cum[np.maximum(cuts - 2, 0)], 0)
    closer_left = np.abs(prev - targets) < np.abs(cum[np.minimum(cuts - 1, n - 1)] - targets)
    cuts = np.where(closer_left, cuts - 1, cuts)
    offsets = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    # Every block gets at least one row (tiny matrices, extreme weights, more
    # parts than rows with entries): cut i lies in [i, n - nparts + i], then a
    # forward pass makes the cuts strictly increasing without passing n.
    inner = np.arange(1, nparts)
    offsets[1:nparts] = np.clip(offsets[1:nparts], inner, n - nparts + inner)
    for i in range(1, nparts):
        offsets[i] = max(offsets[i], offsets[i - 1] + 1)
    return offsets


def build_partition(A: sp.spmatrix, nparts: int, *, reorder: str | None = "rcm",
                    weights: Sequence[float] | None = None,
                    offsets: Sequence[int] | None = None) -> Partition:
    """Split a square sparse matrix into ``nparts`` row blocks with halo maps.

    Parameters
    ----------
    A : scipy sparse matrix, shape (n, n)
    nparts : int
    reorder : {"rcm", "metis", None}
        Bandwidth-reducing reordering before the split. ``"metis"`` needs
        ``pymetis`` and orders rows by METIS part.
    weights : sequence of float, optional
        Relative nnz share per shard (see :func:`balanced_row_blocks`).
    offsets : sequence of int, optional
        Explicit row offsets (after reordering) instead of the nnz balance;
        ``offsets[0] == 0`` and ``offsets[-1] == n``.

    Returns
    -------
    Partition

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(6, 6)).tocsr()
    >>> p = build_partition(A, 2, reorder=None)
    >>> p.offsets.tolist(), [s.nhalo for s in p.shards]
    ([0, 3, 6], [1, 1])
    """
    A = sp.csr_matrix(A)
    n = A.shape[0]
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"build_partition(A=...): A must be square, got shape {A.shape}.")
    if reorder == "rcm":
        base = rcm_permutation(A)
    elif reorder == "metis":
        base = _metis_permutation(A, nparts)
    elif reorder is None or reorder == "none":
        base = np.arange(n, dtype=np.int64)
        reorder = None
    else:
        raise ValueError(f"build_partition(reorder={reorder!r}): expected 'rcm', 'metis' or None.")

    row_nnz = np.diff(A.indptr)[base]
    if offsets is None:
        offs = balanced_row_blocks(row_nnz, nparts, weights)
    else:
        offs = np.asarray(offsets, dtype=np.int64)
        if (offs.shape != (nparts + 1,) or offs[0] != 0 or offs[-1] != n
                or np.any(np.diff(offs) < 1)):
            raise ValueError(
                f"build_partition(offsets={list(offsets)!r}): expected {nparts + 1} increasing "
                f"row offsets from 0 to {n} with every block non-empty."
            )

    # Which block each original row lands in, and whether a row reads a
    # column of another block (then it is a boundary row).
    inv_base = np.empty(n, dtype=np.int64)
    inv_base[base] = np.arange(n, dtype=np.int64)
    block_dtype = np.int16 if nparts < 2**15 else np.int32
    block_of_orig = (np.searchsorted(offs, inv_base, side="right") - 1).astype(block_dtype)
    row_len = np.diff(A.indptr)
    foreign = block_of_orig[A.indices] != np.repeat(block_of_orig, row_len)
    # A row is a boundary row when any of its entries is foreign (reduceat
    # reads one entry for an empty row, hence the mask).
    if A.nnz:
        starts = np.minimum(A.indptr[:-1], A.nnz - 1)
        is_boundary = np.logical_or.reduceat(foreign, starts) & (row_len > 0)
    else:
        is_boundary = np.zeros(n, dtype=bool)
    del foreign

    # Interior rows first inside each block (stable, so RCM order is kept).
    pieces = []
    for s in range(nparts):
        rows = base[offs[s]:offs[s + 1]]
        bnd = is_boundary[rows]
        pieces.append(np.concatenate([rows[~bnd], rows[bnd]]))
    perm = np.concatenate(pieces)
    inv = np.empty(n, dtype=np.int64)
    inv[perm] = np.arange(n, dtype=np.int64)

    shards = []
    for s in range(nparts):
        lo, hi = int(offs[s]), int(offs[s + 1])
        n_int = int(np.count_nonzero(~is_boundary[perm[lo:hi]]))
        shards.append(_shard_layout(A, perm, inv, offs, s, n_int))
    for s, lay in enumerate(shards):
        for t, a, b in lay.recv:
            shards[t].send.append((s, lay.halo_global[a:b] - offs[t]))
    return Partition(n, perm, offs, shards, reorder)


def _shard_layout(A: sp.csr_matrix, perm: np.ndarray, inv: np.ndarray, offs: np.ndarray,
                  s: int, n_int: int) -> ShardLayout:
    """Shard ``s``'s local block, split into interior and boundary rows, and its receive map."""
    lo, hi = int(offs[s]), int(offs[s + 1])
    nloc = hi - lo
    sub = A[perm[lo:hi]]  # scipy's C++ row gather
    cols = inv[sub.indices]
    owned = (cols >= lo) & (cols < hi)
    ext = cols[~owned]
    halo = np.unique(ext)
    local = cols - lo
    local[~owned] = nloc + np.searchsorted(halo, ext)
    idx_dtype = np.int32 if max(nloc + halo.size, sub.nnz) < 2**31 else np.int64
    ptr = sub.indptr.astype(idx_dtype)
    block = sp.csr_matrix((sub.data, local.astype(idx_dtype), ptr),
                          shape=(nloc, nloc + halo.size))
    block.sort_indices()
    # Row slices as views of the block's arrays (no copy of the entries).
    cut = int(ptr[n_int])
    interior = sp.csr_matrix((block.data[:cut], block.indices[:cut], ptr[: n_int + 1]),
                             shape=(n_int, block.shape[1]))
    boundary = sp.csr_matrix((block.data[cut:], block.indices[cut:], ptr[n_int:] - cut),
                             shape=(nloc - n_int, block.shape[1]))
    recv = []
    owner = np.searchsorted(offs, halo, side="right") - 1
    for t in np.unique(owner):
        idx = np.flatnonzero(owner == t)
        recv.append((int(t), int(idx[0]), int(idx[-1]) + 1))
    return ShardLayout(s, lo, hi, n_int, interior, boundary, halo, recv)


def _metis_permutation(A: sp.csr_matrix, nparts: int) -> np.ndarray:
    try:
        import pymetis
    except ImportError as exc:
        raise ModuleNotFoundError(
            "build_partition(reorder='metis') needs pymetis (pip install pymetis); "
            "reorder='rcm' needs nothing extra."
        ) from exc
    P = (abs(A) + abs(A.T)).tocsr()
    P.setdiag(0)
    P.eliminate_zeros()
    if hasattr(pymetis, "CSRAdjacency"):  # pymetis >= 2025 (xadj/adjncy are deprecated there)
        _, parts = pymetis.part_graph(nparts, pymetis.CSRAdjacency(P.indptr, P.indices))
    else:
        _, parts = pymetis.part_graph(nparts, xadj=P.indptr, adjncy=P.indices)
    return np.argsort(np.asarray(parts), kind="stable").astype(np.int64)
