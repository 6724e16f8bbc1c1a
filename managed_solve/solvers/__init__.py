"""Single-system Krylov and direct solvers, preconditioners (re-exports only).

The batched fused core lives in :mod:`managed_solve.solvers.batch` and
:mod:`managed_solve.solvers.batched`, imported where used.
"""

from .bicgstab import bicgstab as bicgstab
from .cg import cg as cg
from .direct import direct as direct
from .gmres import gmres as gmres
from .minres import minres as minres
from .preconditioners import chebyshev as chebyshev
from .preconditioners import jacobi as jacobi
from .preconditioners import make_preconditioner as make_preconditioner
from .preconditioners import neumann as neumann
