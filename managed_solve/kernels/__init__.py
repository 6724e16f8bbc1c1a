"""Numba kernels, installed as ``managed_solve.kernels``: every CUDA kernel has a CPU twin.

One kernel family per module, imported where used (importing ``numba.cuda``
is not free, so nothing is imported here):

- ``pattern``: the symbolic phase (CSR pattern of vertex adjacency and the
  element-to-slot map), CPU and CUDA;
- ``cotan``: cotangent Laplacian and mass matrices on triangle meshes;
- ``tet``: P1 stiffness and mass on tetrahedra;
- ``stencil``: 5-point and 7-point finite-difference Laplacians with a
  variable coefficient;
- ``krylov``: CPU twins of the fused batched CG and BiCGStab kernels (the CUDA
  side is CUDA C in ``managed_solve/solvers/batched/*.cu``);
- ``packing``: the in-place index fix-up of block-diagonal batch packing
  (``managed_solve.solvers.batched.pack_host``; CPU only, the host builds batches);
- ``symmetry``: a one-pass symmetry test of a host CSR matrix (CPU only);
- ``cholesky_symbolic`` and ``cholesky``: the symbolic analysis and the
  numeric factorisation and solves of a supernodal sparse Cholesky, with
  ``blas`` calling SciPy's BLAS/LAPACK from jitted code (CPU only);
- ``checks``: the finite-entry check and the symmetry test over many host
  arrays in one GIL-free call, by address (CPU only);
- ``compressed``: the check of a host compressed pattern (row pointers, and
  indices within their bound) before any kernel indexes with it (CPU only);
- ``_compat``: the NumPy 2.5 / numba-cuda ``np.row_stack`` shim, imported
  before ``numba.cuda`` everywhere.

A kernel takes arrays and writes into arrays its caller allocated; the
per-element math is one ``@numba.njit`` function called by both twins.
"""
