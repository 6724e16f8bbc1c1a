"""One-shot check of the batched Krylov core on a GPU machine: a table of CG times.

Run after the gpu tests (see the brief): per-iteration time of our batched CG
against ``cupyx.scipy.sparse.linalg.cg`` on 2D Poisson (b = ones) at N = 65k,
4.2M and 16.8M, float64 and float32, with the fraction of copy bandwidth
(152 B/row model for float64, benchmarks/README.md) and the host synchronisations;
plus a W2-like batch (400 small Poisson systems). Results also go to
``$OUT/gpu_krylov_check.json`` when ``OUT`` is set.

Usage: ``python benchmarks/gpu_krylov_check.py``
"""

from __future__ import annotations

import json
import os
import time
import traceback

import numpy as np
import scipy.sparse as sp

TINY = 1e-30


def poisson2d(m, dtype=np.float64):
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return (sp.kron(sp.eye(m), t) + sp.kron(t, sp.eye(m))).tocsr().astype(dtype)


def model_bytes(n, nnz, itemsize, index_itemsize=4):
    return nnz * (itemsize + index_itemsize) + 4 * n + 11 * n * itemsize


def main():
    import cupy as cp
    import cupyx.scipy.sparse as csp
    import cupyx.scipy.sparse.linalg as cspla

    from managed_solve import LinearSystem
    from managed_solve.solvers.batched import PackedBatch, bicgstab_batched, cg_batched

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

    def sync():
        dev.synchronize()

    def timed(fn, reps=3):
        fn()
        sync()
        best = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            sync()
            best.append(time.perf_counter() - t0)
        return float(np.median(best)), out

    def copy_bandwidth():
        a = cp.ones(1 << 27)
        b2 = cp.empty_like(a)
        seconds, _ = timed(lambda: cp.copyto(b2, a), reps=5)
        return 2 * a.nbytes / seconds

    bandwidth = copy_bandwidth()
    print(f"device: {name}; copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    rows = []
    header = (f"{'N':>9} {'dtype':>7} {'ours us/it':>11} {'cupyx us/it':>12} {'ratio':>6} "
              f"{'bw ours':>8} {'bw cupyx':>9} {'syncs':>6} {'its ours/cupyx to rtol':>24}")
    print(header)
    for m in (128, 256, 2048, 4096):
        for dtype in (np.float64, np.float32):
            try:
                A = csp.csr_matrix(poisson2d(m, dtype))
                n = A.shape[0]
                b = cp.ones(n, dtype=dtype)
                rtol = 1e-6 if dtype == np.float64 else 1e-4
                # Correctness: converged solve, true residual, iteration count vs cupyx.
                its_ours = its_ref = -1
                res = res_ref = float("nan")
                if m <= 2048:
                    chk = cg_batched(PackedBatch.from_csr(A, b, rtol=rtol, maxiter=20 * m))
                    res = float(cp.linalg.norm(b - A @ chk.x) / cp.linalg.norm(b))
                    count = [0]
                    x_ref = cspla.cg(A, b, rtol=rtol, maxiter=20 * m,
                                     callback=lambda _x, c=count: c.__setitem__(0, c[0] + 1))[0]
                    res_ref = float(cp.linalg.norm(b - A @ x_ref) / cp.linalg.norm(b))
                    its_ours, its_ref = int(chk.iterations[0]), count[0]
                    # float32 CG's true residual stalls near eps * cond(A) for both
                    # solvers; ours must be as good as cupyx's.
                    assert chk.status[0] == 0 and res <= 2 * max(rtol, res_ref), (chk.status, res, res_ref)
                K = 200 if m <= 256 else 50
                batch = PackedBatch.from_csr(A, b, rtol=TINY, maxiter=K)
                t_ours, out = timed(lambda batch=batch: cg_batched(batch))
                assert out.iterations[0] == K
                x_k = cspla.cg(A, b, rtol=TINY, maxiter=K)[0]
                k_diff = float(cp.linalg.norm(out.x - x_k) / cp.linalg.norm(x_k))
                t_ref, _ = timed(lambda A=A, b=b, K=K: cspla.cg(A, b, rtol=TINY, maxiter=K))
                t_fixed, out_fixed = timed(lambda batch=batch, K=K: cg_batched(batch, check_every=K))
                t_bicg, out_bicg = timed(lambda batch=batch: bicgstab_batched(batch))
                mb = model_bytes(n, int(A.nnz), np.dtype(dtype).itemsize)
                row = dict(n=n, dtype=np.dtype(dtype).name, ours_us=t_ours / K * 1e6,
                           cupyx_us=t_ref / K * 1e6, ratio=t_ours / t_ref,
                           bw_ours=mb / (t_ours / K) / bandwidth,
                           bw_cupyx=mb / (t_ref / K) / bandwidth, host_syncs=out.host_syncs,
                           its_ours=its_ours, its_cupyx=its_ref, true_res_ours=res,
                           true_res_cupyx=res_ref, ours_fixed_us=t_fixed / K * 1e6,
                           fixed_syncs=out_fixed.host_syncs, bicgstab_us=t_bicg / K * 1e6,
                           bicgstab_syncs=out_bicg.host_syncs, k_iterate_diff=k_diff)
                rows.append(row)
                print(f"{n:>9} {row['dtype']:>7} {row['ours_us']:>11.1f} {row['cupyx_us']:>12.1f} "
                      f"{row['ratio']:>6.2f} {row['bw_ours']:>8.2f} {row['bw_cupyx']:>9.2f} "
                      f"{out.host_syncs:>6} {its_ours:>11}/{its_ref:<12}", flush=True)
                print(f"{'':>9} {'':>7} true residual ours {res:.2e} cupyx {res_ref:.2e}; "
                      f"check_every=K: {row['ours_fixed_us']:.1f} us/it, {out_fixed.host_syncs} sync; "
                      f"BiCGStab {row['bicgstab_us']:.1f} us/it; "
                      f"x after K its vs cupyx: {k_diff:.1e}", flush=True)
                del A, b, batch, out
                cp.get_default_memory_pool().free_all_blocks()
            except Exception:
                traceback.print_exc()
                rows.append(dict(n=m * m, dtype=np.dtype(dtype).name, error=traceback.format_exc()))

    # W2-like: 400 Poisson systems, n from 32..96, rtol 1e-8, each to its own tolerance.
    extra = {}
    try:
        sizes = np.random.default_rng(0).integers(32, 97, size=400)
        systems = [LinearSystem(poisson2d(int(k)), np.ones(int(k) ** 2), rtol=1e-8) for k in sizes]
        for method, solve in (("cg", cg_batched), ("bicgstab", bicgstab_batched)):
            t_pack, batch = timed(lambda: PackedBatch.pack(systems, device="cuda:0"), reps=1)
            t_solve, out = timed(lambda batch=batch, solve=solve: solve(batch))
            xs = batch.unpack(out.x)
            worst = max(float(np.linalg.norm(s.b - s.A @ x.get()) / np.linalg.norm(s.b))
                        for s, x in zip(systems, xs, strict=True))
            extra[f"w2_{method}"] = dict(seconds=t_solve, pack_seconds=t_pack,
                                         converged=int((out.status == 0).sum()),
                                         max_iterations=int(out.iterations.max()),
                                         worst_relative_residual=worst, host_syncs=out.host_syncs)
        Abd = csp.csr_matrix(sp.block_diag([s.A for s in systems], format="csr"))
        bbd = cp.ones(Abd.shape[0])
        t_bd, _ = timed(lambda: cspla.cg(Abd, bbd, rtol=1e-8, maxiter=10_000))
        extra["w2_blockdiag_cupyx_seconds"] = t_bd
        print("W2-like batch:", json.dumps(extra, indent=1))
    except Exception:
        traceback.print_exc()
        extra["w2_error"] = traceback.format_exc()

    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "gpu_krylov_check.json"), "w") as f:
            json.dump(dict(device=name, copy_bandwidth=bandwidth, rows=rows, **extra), f, indent=1)


if __name__ == "__main__":
    main()
