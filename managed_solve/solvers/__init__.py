"""Single-system Krylov and direct solvers, preconditioners (re-exports only).

The batched fused core (one implementation for one system or many):
:class:`PackedBatch`, :func:`cg_batched`, :func:`bicgstab_batched`.
"""

from ._cudss import release_factorisations as release_factorisations
from .batched import BatchOutcome as BatchOutcome
from .batched import PackedBatch as PackedBatch
from .batched import bicgstab_batched as bicgstab_batched
from .batched import cg_batched as cg_batched
from .bicgstab import bicgstab as bicgstab
from .cg import cg as cg
from .direct import direct as direct
from .gmres import gmres as gmres
from .minres import minres as minres
from .preconditioners import jacobi as jacobi
from .preconditioners import make_preconditioner as make_preconditioner
from .preconditioners import neumann as neumann
