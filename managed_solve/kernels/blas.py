"""SciPy's BLAS and LAPACK called from nopython Numba code, by address (CPU only).

The supernodal Cholesky kernels (:mod:`managed_solve.kernels.cholesky`) spend
their time in dense products and triangular solves on the supernodes, which
BLAS-3 does several times faster than loops. SciPy exports its BLAS and
LAPACK as Cython functions with Fortran calling conventions (every argument a
pointer); :func:`routines` gives their addresses for one dtype and
:func:`call` calls one from jitted code. The address travels as an argument,
not as a constant baked into the compiled code, so the kernels stay cacheable
(``cache=True``): an address differs from one process to the next.

Scalars are passed through small arrays the kernel owns (:func:`pointer`
of an element), characters as their ASCII codes in a ``uint8`` array.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .packing import address_pointer

__all__ = ["POTRF", "SYRK", "TRSM", "GEMM", "call", "pointer", "routines"]

#: Positions of the routines in the array :func:`routines` returns.
POTRF, TRSM, SYRK, GEMM = 0, 1, 2, 3


@functools.cache
def routines(dtype: np.dtype) -> np.ndarray:
    """Addresses (int64) of ``potrf``, ``trsm``, ``syrk`` and ``gemm`` for ``dtype`` (float32 or float64).

    Examples
    --------
    >>> import numpy as np
    >>> addresses = routines(np.dtype(np.float64))
    >>> addresses.shape, bool(np.all(addresses != 0))
    ((4,), True)
    """
    from numba.extending import get_cython_function_address

    prefix = {np.dtype(np.float64): "d", np.dtype(np.float32): "s"}.get(np.dtype(dtype))
    if prefix is None:
        raise TypeError(f"BLAS routines for float32 and float64 only, not {np.dtype(dtype)}")
    lapack, blas = "scipy.linalg.cython_lapack", "scipy.linalg.cython_blas"
    out = np.array([get_cython_function_address(lapack, prefix + "potrf"),
                    get_cython_function_address(blas, prefix + "trsm"),
                    get_cython_function_address(blas, prefix + "syrk"),
                    get_cython_function_address(blas, prefix + "gemm")], dtype=np.int64)
    out.flags.writeable = False
    return out


@intrinsic
def call(typingctx, address, pointers):
    """Call the function at ``address`` with the ``void*`` arguments of the tuple ``pointers``."""
    if not isinstance(pointers, types.UniTuple) or pointers.dtype != types.voidptr:
        return None
    count = pointers.count

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t] * count)
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(fn, [builder.extract_value(args[1], i) for i in range(count)])
        return context.get_dummy_value()

    return types.void(types.int64, pointers), codegen


@numba.njit(inline="always")
def pointer(a, offset):
    """``&a[offset]`` of a contiguous one-dimensional array, as a ``void*``."""
    return address_pointer(np.int64(a.ctypes.data) + np.int64(offset) * np.int64(a.itemsize))
