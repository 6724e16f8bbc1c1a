"""One large linear system sharded by rows over several GPUs (or simulated GPUs) (re-exports only).

:func:`solve_sharded` partitions the rows of ``A`` into contiguous blocks
(:mod:`~managed_solve.sharded.partition`: optional reverse Cuthill-McKee or
METIS, blocks balanced by nnz, interior rows before boundary rows), places one
block per device (:mod:`~managed_solve.sharded.layout`), and runs distributed
CG (Chronopoulos-Gear: one all-reduce per iteration) or BiCGStab
(:mod:`~managed_solve.sharded.krylov`), exchanging halos and partial sums
through :mod:`~managed_solve.sharded.comm`. :class:`ShardedEngine` is the
same solver in the engine shape (prepare once, solve many right-hand sides,
update values, solve with the transpose); :mod:`~managed_solve.sharded.sizing`
decides how many devices a system needs.
"""

from .cache import CacheInfo as CacheInfo
from .cache import cache_info as cache_info
from .cache import clear_cache as clear_cache
from .cache import sharded_system as sharded_system
from .engine import ShardedEngine as ShardedEngine
from .engine import ShardedPrepared as ShardedPrepared
from .engine import solve_sharded as solve_sharded
from .inputs import resolve_devices as resolve_devices
from .layout import DistributedVector as DistributedVector
from .layout import ShardedOutcome as ShardedOutcome
from .layout import ShardedSystem as ShardedSystem
from .partition import Partition as Partition
from .partition import ShardLayout as ShardLayout
from .partition import balanced_row_blocks as balanced_row_blocks
from .partition import build_partition as build_partition
from .partition import rcm_permutation as rcm_permutation
from .sizing import choose_shard_count as choose_shard_count
from .sizing import needs_sharding as needs_sharding
from .sizing import predict_shard_bytes as predict_shard_bytes

__all__ = [
    "CacheInfo",
    "DistributedVector",
    "Partition",
    "ShardLayout",
    "ShardedEngine",
    "ShardedOutcome",
    "ShardedPrepared",
    "ShardedSystem",
    "balanced_row_blocks",
    "build_partition",
    "cache_info",
    "choose_shard_count",
    "clear_cache",
    "needs_sharding",
    "predict_shard_bytes",
    "rcm_permutation",
    "resolve_devices",
    "sharded_system",
    "solve_sharded",
]
