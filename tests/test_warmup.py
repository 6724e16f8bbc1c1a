"""``ms.warmup`` and ``managed-solve warmup``: the default paths' kernels compiled ahead of need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import managed_solve as ms
from managed_solve.cli import main
from tests._problems import poisson2d

ROOT = Path(__file__).resolve().parents[1]

# A fresh process on an empty Numba cache: no kernel compiled before warmup,
# each batched kernel of the methods warmed compiled after it, and the report
# names them as compiled (not loaded).
_FRESH = """
import json, sys
import managed_solve as ms
from managed_solve.kernels import checks, krylov, packing
kernels = {"cg_some": krylov.cg_some, "gmres_some": krylov.gmres_some,
           "bicgstab_some": krylov.bicgstab_some, "gather_blocks": packing.gather_blocks,
           "symmetry": checks.csr_symmetry_gershgorin_many, "finite": checks.all_finite_many}
before = {k: len(d.signatures) for k, d in kernels.items()}
steps = ms.warmup("cpu", methods=["cg", "gmres"])
after = {k: len(d.signatures) for k, d in kernels.items()}
print(json.dumps({"before": before, "after": after, "steps": steps}))
"""


@pytest.mark.slow
def test_warmup_compiles_the_batched_kernels_of_the_methods_asked_for(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert all(v == 0 for v in out["before"].values()), out["before"]
    after = out["after"]
    assert after["cg_some"] >= 1 and after["gmres_some"] >= 1
    assert after["gather_blocks"] >= 1 and after["symmetry"] >= 1 and after["finite"] >= 1
    assert after["bicgstab_some"] == 0  # not asked for: not compiled
    steps = out["steps"]
    assert [s["step"] for s in steps] == ["cg (float64)", "gmres (float64)"]
    assert "krylov.cg_some" in steps[0]["compiled"] and not steps[0]["loaded_from_cache"]
    assert "krylov.gmres_some" in steps[1]["compiled"]
    assert list((tmp_path / "numba").rglob("*.nbi")), "nothing written to Numba's cache"


def test_warmup_then_solve_many_compiles_nothing_more():
    """What warmup prepared is what the default path of a W2-like call runs."""
    from managed_solve._warmup import compiled_since, jit_snapshot

    ms.warmup("cpu", methods=["cg"])
    before = jit_snapshot()
    dm = ms.DeviceManager(["cpu"])
    res = ms.solve_many([(poisson2d(m), np.ones(m * m)) for m in (33, 47, 61)], manager=dm)
    assert all(r.converged and r.method == "cg" for r in res)
    assert compiled_since(before) == {"compiled": [], "loaded_from_cache": []}


def test_warmup_rejects_unknown_methods_and_dtypes():
    with pytest.raises(ValueError, match="bicgstab"):
        ms.warmup("cpu", methods=["lu"])
    with pytest.raises(ValueError, match="float32"):
        ms.warmup("cpu", methods=["cg"], dtypes=["int32"])


def test_cli_warmup_reports_what_and_how_long(capsys):
    assert main(["warmup", "--device", "cpu", "--methods", "cg"]) == 0
    out = capsys.readouterr().out
    assert "cpu" in out and "cg (float64)" in out and " s " in out
    assert "done in" in out and "Numba's cache" in out


def test_cli_warmup_json_and_bad_method(capsys):
    assert main(["warmup", "--device", "cpu", "--methods", "cg", "--json"]) == 0
    cap = capsys.readouterr()
    summary = json.loads(cap.out)
    assert summary["steps"][0]["device"] == "cpu" and summary["seconds"] >= 0
    assert "done in" in cap.err
    assert main(["warmup", "--device", "cpu", "--methods", "lu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "lu" in err and "Traceback" not in err


def test_the_docs_and_the_help_name_warmup():
    from managed_solve.cli import build_parser

    assert "warmup" in build_parser().format_help()
    assert "managed-solve warmup" in (ROOT / "README.md").read_text()
    page = (ROOT / "docs" / "getting-started.md").read_text()
    section = page[page.index("## What the first run compiles"):]
    assert "managed-solve warmup" in section and "ms.warmup()" in section
    assert "managed_solve._warmup.warmup" in (ROOT / "docs" / "api.md").read_text()


@pytest.mark.gpu
def test_warmup_on_a_gpu_loads_the_batched_cuda_modules():
    from managed_solve.solvers.batched import cuda

    steps = ms.warmup("cuda:0", methods=["cg", "gmres"])
    modules = [s for s in steps if s.get("cuda_module")]
    assert [s["step"] for s in modules] == ["CUDA module cg (float64)", "CUDA module gmres (float64)",
                                            "CUDA module cg, larger blocks (float64)"]
    assert all(s["cuda_module"] in ("compiled", "loaded from cache") for s in modules)
    assert all(cuda.loaded(0, np.float64, np.int32, f) for f in ("cg", "gmres", "cg_blocks"))
    assert [s["step"] for s in steps if not s.get("cuda_module")] == \
        ["compaction rows", "cg (float64)", "gmres (float64)"]


@pytest.mark.gpu
def test_warmup_on_a_gpu_then_a_w2_like_call_compiles_nothing_more():
    """The GPU path of a call of many systems of several sizes (their compaction list
    included) runs only what warmup prepared."""
    from managed_solve._warmup import compiled_since, jit_snapshot

    ms.warmup("cuda:0", methods=["cg"])
    before = jit_snapshot()
    pairs = [(poisson2d(m), np.ones(m * m)) for m in range(16, 96, 4)]
    res = ms.solve_many(pairs, devices=["cuda:0"], return_on="host")
    assert all(r.converged for r in res)
    assert compiled_since(before)["compiled"] == []


def test_cache_and_library_paths_follow_their_environment_variables(monkeypatch, tmp_path):
    """Read when asked, through ``config.environment``: a variable set after import counts."""
    from managed_solve import _warmup, config
    from managed_solve.solvers import _cudss

    monkeypatch.setenv(config.ENV_CUPY_CACHE_DIR, str(tmp_path))
    assert _warmup.cupy_cache_dir() == str(tmp_path)
    monkeypatch.delenv(config.ENV_CUPY_CACHE_DIR)
    assert _warmup.cupy_cache_dir() == os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    lib = tmp_path / "libcudss_mtlayer_gomp.so.0"
    lib.write_bytes(b"")
    monkeypatch.setenv(config.ENV_CUDSS_THREADING_LIB, str(lib))
    assert _cudss.find_threading_lib() == str(lib)
    monkeypatch.setenv(config.ENV_CUDSS_THREADING_LIB, str(tmp_path / "absent.so"))
    assert _cudss.find_threading_lib() is None  # a named file that is not there is not used
    with pytest.raises(ValueError, match="CUDSS_THREADING_LIB"):
        config.environment("PATH")


def test_warming_no_device_or_absent_gpus_is_an_error_not_success(monkeypatch):
    """warmup(device='cuda') on a machine without a usable GPU compiled nothing and returned []
    (the CLI exited 0); so did an empty device list."""
    from managed_solve import _backend

    monkeypatch.setattr(_backend, "cuda_probe", lambda: (0, "no driver"))
    with pytest.raises(ValueError, match=r"warmup\(device='cuda'\): no usable CUDA GPU here \(no driver\)"):
        ms.warmup("cuda")
    for nothing in ("", " , ", []):
        with pytest.raises(ValueError, match="names no device"):
            ms.warmup(nothing)
    with pytest.raises(ValueError, match=r"warmup\(methods=\[\]\): names nothing"):
        ms.warmup("cpu", methods=[])
    for dtypes in ([], ["foo"], ["int32"]):  # "foo" reached NumPy's bare "not understood"
        with pytest.raises(ValueError, match=r"warmup\(dtypes=.*expected float64 and/or float32"):
            ms.warmup("cpu", dtypes=dtypes)


def test_warmup_compiles_the_row_layout_without_changing_a_setting_other_threads_read():
    """On a host where one large system sweeps its rows on several threads, warmup compiles
    that layout's kernels; it used to do so under a settings override that every thread of the
    process read while it lasted (a concurrent call then swept even tiny systems' rows that way)."""
    import threading

    from managed_solve import config
    from managed_solve._warmup import compiled_since, jit_snapshot
    from managed_solve.kernels import krylov

    seen, done = set(), threading.Event()

    def reader():  # another thread of the process, reading the setting all along
        while not done.is_set():
            seen.add(config.current().host_row_parallel_min_rows)

    with config.override(host_threads=2, host_row_parallel_min_cores=2):
        watcher = threading.Thread(target=reader)
        watcher.start()
        try:
            ms.warmup("cpu", methods=["cg", "bicgstab"])
        finally:
            done.set()
            watcher.join()
        assert seen == {config.current().host_row_parallel_min_rows}
        assert krylov.cg_rows.signatures and krylov.bicgstab_rows.signatures
        # A system large enough for the row layout then compiles nothing more.
        m = 520  # n = 270,400 rows: above host_row_parallel_min_rows
        A, b = poisson2d(m), np.ones(m * m)
        before = jit_snapshot()
        for method in ("cg", "bicgstab"):
            res = ms.solve_many([(A, b)], devices=["cpu"], method=method, rtol=1e-2,
                                return_on="host")
            assert res[0].converged
            assert np.linalg.norm(b - A @ res[0].x) <= 1e-2 * np.linalg.norm(b)
        assert compiled_since(before)["compiled"] == []
