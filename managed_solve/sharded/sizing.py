"""How many devices one system needs, and how many bytes each shard takes.

Pure arithmetic over byte counts (no devices, no matrices): the scheduler
asks :func:`choose_shard_count` whether a system too large for any one
accelerator fits on several, and the tests check :func:`predict_shard_bytes`
against the arrays a :class:`~managed_solve.sharded.ShardedSystem` really
allocates.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["choose_shard_count", "needs_sharding", "predict_shard_bytes"]


def needs_sharding(nbytes: int, available: Sequence[int]) -> bool:
    """True when a system of ``nbytes`` fits on no single device but could on several.

    Parameters
    ----------
    nbytes : int
        Predicted device bytes of the whole solve (matrix, vectors, workspace).
    available : sequence of int
        Bytes each accelerator can take now (``DeviceManager.available_bytes``).

    Examples
    --------
    >>> needs_sharding(3 << 30, [2 << 30, 2 << 30])
    True
    >>> needs_sharding(1 << 30, [2 << 30, 2 << 30])
    False
    """
    return len(available) >= 2 and choose_shard_count(nbytes, available) > 1


def choose_shard_count(nbytes: int, available: Sequence[int], *,
                       halo_margin: float = 0.05) -> int:
    """Fewest devices (largest first) whose free bytes hold ``nbytes``; 0 when none do.

    ``halo_margin`` adds a share of each shard for halo buffers, send buffers
    and per-shard workspace (a few percent for banded PDE matrices).

    Examples
    --------
    >>> choose_shard_count(5 << 30, [4 << 30, 4 << 30, 4 << 30])
    2
    >>> choose_shard_count(50 << 30, [4 << 30])
    0
    """
    avail = sorted((int(a) for a in available), reverse=True)
    for k in range(1, len(avail) + 1):
        # Shards are balanced by weight = free bytes, so every one of the k
        # devices fills to the same fraction of its free bytes.
        if nbytes * (1.0 + (halo_margin if k > 1 else 0.0)) <= sum(avail[:k]):
            return k
    return 0


# Vectors of n/P entries each shard keeps during a solve (b and x included).
_SHARD_VECTORS = {"cg": 6, "bicgstab": 10}


def predict_shard_bytes(n: int, nnz: int, nshards: int, *, itemsize: int = 8,
                        method: str = "cg", jacobi: bool = False,
                        halo_fraction: float = 0.02) -> int:
    """Device bytes one shard of a balanced sharded solve needs (the largest shard).

    CSR block (int32 indices) plus the solver's vectors, with ``halo_fraction``
    of extra entries for halo columns and send buffers (banded PDE matrices
    after RCM: a few percent).

    Examples
    --------
    >>> predict_shard_bytes(1000, 5000, 2) < predict_shard_bytes(1000, 5000, 1)
    True
    """
    if method not in _SHARD_VECTORS:
        raise ValueError(f"predict_shard_bytes(method={method!r}): expected 'cg' or 'bicgstab'.")
    if nshards < 1:
        raise ValueError(f"predict_shard_bytes(nshards={nshards}): expected at least 1.")
    rows = -(-int(n) // int(nshards))
    entries = -(-int(nnz) // int(nshards))
    vectors = _SHARD_VECTORS[method] + (2 if jacobi else 0)
    csr = entries * (itemsize + 4) + (rows + 1) * 4
    return int((csr + vectors * rows * itemsize) * (1.0 + halo_fraction))
