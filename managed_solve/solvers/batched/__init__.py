"""The batched Krylov engine: many CSR systems packed block-diagonally, each with its own scalars.

One Krylov core for ``solve`` (a batch of one), ``solve_many`` (many packed
systems), the sharded solver and :class:`BatchedEngine` (one matrix, many
right-hand sides). Each system ``s`` has its own scalars, its own stopping
rule ``||r_s|| <= max(rtol_s ||b_s||, atol_s)`` (SciPy's rule), its own
``maxiter`` and status; a finished system stops changing and stops costing
work.

- ``packed``: :class:`PackedBatch`, systems packed into one block-diagonal CSR.
- ``cg``, ``bicgstab``, ``gmres``: the methods' drivers.
- ``cpu``: the Numba paths (parallel over systems, or rows for one large system) and
  the host threads they and the other host kernels share.
- ``gpu``, ``cuda``, ``*.cu``/``*.cuh``: the fused CUDA kernels and their loop.
- ``workspace``: each solve's allocations and the memory model that counts them.
- ``engine``: :class:`BatchedEngine`, the engine shape over the above.
"""

from .bicgstab import bicgstab_batched as bicgstab_batched
from .cg import cg_batched as cg_batched
from .cpu import ROWS_LAYOUT_MIN as ROWS_LAYOUT_MIN
from .cuda import prefetch_kernels as prefetch_kernels
from .cuda import release_done as release_done
from .engine import BatchedEngine as BatchedEngine
from .engine import BatchedPrepared as BatchedPrepared
from .gmres import gmres_batched as gmres_batched
from .gpu import prepare as prepare
from .gpu import residual_norms as residual_norms
from .outcome import BatchOutcome as BatchOutcome
from .packed import PackedBatch as PackedBatch
from .packed import pack_host as pack_host
from .workspace import GMRES_RESTART as GMRES_RESTART
from .workspace import block_route as block_route
from .workspace import predict_bytes as predict_bytes
