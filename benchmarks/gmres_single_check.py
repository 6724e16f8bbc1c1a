"""One system, GMRES(30): the generic array GMRES against the batched core's (a batch of one).

Prints seconds, iterations and the true relative residual for each, on the CPU
and (when present) a GPU; upwind convection-diffusion, rtol 1e-8. Decides
whether ``solve(method="gmres")`` on a CSR matrix takes the batched core.

    python benchmarks/gmres_single_check.py [--sizes 256,1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.sparse as sp

from managed_solve import _backend
from managed_solve.solvers.gmres import gmres, gmres_fused


def upwind(m: int, peclet: float = 0.6) -> sp.csr_matrix:
    T = sp.diags([-1.0 - peclet, 2.0, -1.0 + peclet], [-1, 0, 1], shape=(m, m))
    return (sp.kron(sp.identity(m), T) + sp.kron(T, sp.identity(m))).tocsr()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,1024")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--devices", default="cpu,cuda")
    args = ap.parse_args()
    for where in args.devices.split(","):
        if where == "cuda" and not _backend.cuda_usable():
            continue
        for m in (int(v) for v in args.sizes.split(",")):
            A, b = upwind(m), np.ones(m * m)
            if where == "cuda":
                cp = _backend.cupy()
                import cupyx.scipy.sparse as csp

                A, b = csp.csr_matrix(A), cp.asarray(b)
            for name, fn in (("generic", gmres), ("batched-core", gmres_fused)):
                times = []
                for _ in range(args.repeat + 1):
                    t0 = time.perf_counter()
                    out = fn(A, b, rtol=1e-8, maxiter=20_000)
                    _backend.synchronize()
                    times.append(time.perf_counter() - t0)
                x = _backend.to_host(out.x)
                Ah, bh = _backend.to_host(A), _backend.to_host(b)
                rel = np.linalg.norm(bh - Ah @ x) / np.linalg.norm(bh)
                print(f"{where:5s} n={m * m:>9,d} {name:13s} {np.median(times[1:]) * 1e3:9.1f} ms "
                      f"its={out.iterations:6d} code={out.code} rel_res={rel:.2e}", flush=True)


if __name__ == "__main__":
    main()
