"""Smoothed-aggregation algebraic multigrid: set-up on the matrix's device, V-cycle preconditioner."""

from .preconditioner import AMGPreconditioner as AMGPreconditioner
from .preconditioner import amg as amg
from .preconditioner import hierarchy_bytes_estimate as hierarchy_bytes_estimate
