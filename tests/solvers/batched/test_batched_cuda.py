"""The batched core's CUDA sources and launch helpers (``solvers/batched/cuda.py``), on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from managed_solve.solvers.batched import cuda

PAIRS = [(v, i) for v in (np.float32, np.float64) for i in (np.int32, np.int64)]


def test_the_sources_load_from_the_files_beside_the_module():
    text = cuda.source()
    files = [Path(cuda.__file__).with_name(name) for name in cuda.SOURCE_FILES]
    assert text == "".join(f.read_text(encoding="utf-8") for f in files)  # in order
    assert text.startswith("// Device helpers")
    assert text.count("__global__") >= 17
    assert "#define MS_RUNNING (-1)" in text


@pytest.mark.parametrize("dtype, index_dtype", PAIRS)
def test_every_name_expression_names_a_kernel_of_the_source(dtype, index_dtype):
    text = cuda.source()
    T, I = cuda.type_names(dtype, index_dtype)  # noqa: E741
    names = cuda.instantiations(T, I)
    defined = set(re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\)\s*)?(ms_\w+)\(", text))
    for key, expr in names.items():
        assert "{" not in expr and "}" not in expr, (key, expr)  # every placeholder filled
        base = expr.split("<", 1)[0]
        assert base in defined, (key, expr)
        if "<" in expr:  # a template instantiated with this pair's types and flags
            args = [a.strip() for a in expr[expr.index("<") + 1: -1].split(",")]
            assert args[0] == T
            assert set(args[1:]) <= {I, "true", "false"}
    # Every kernel the loops launch has a name expression.
    assert {"init_status", "bicg_check", "zero_x", "gmres_scale"} <= set(names)
    assert len(names) == 58


def test_compile_options_define_the_row_layout_the_source_reads():
    assert cuda.compile_options() == ("-std=c++17", "-DMS_CONTIGUOUS=1")
    assert cuda.compile_options(contiguous_rows=False)[-1] == "-DMS_CONTIGUOUS=0"
    assert "MS_CONTIGUOUS" in cuda.source()


def test_retired_work_is_released_once_its_event_is_done():
    """What a GPU solve keeps alive for its queued masked iterations goes once they finished."""

    class Event:
        def __init__(self, done):
            self.done = done

    queue = cuda.RetiredQueue()
    slow, fast = Event(False), Event(True)
    queue.retire(slow, ["slow"])
    queue.retire(fast, ["fast"])  # done, though queued behind an unfinished one
    queue.release_done()
    assert queue.held() == [["slow"]]
    slow.done = True
    queue.release_done()
    assert not queue.held() and len(queue) == 0
    cuda.release_done()  # the process's queue: a no-op with nothing kept


def test_each_method_family_holds_the_kernels_its_loop_launches():
    """A family is the subset its method launches (plus the residual check); together they are all."""
    T, I = cuda.type_names(np.float64, np.int32)  # noqa: E741
    every = cuda.instantiations(T, I)
    fams = {f: cuda.instantiations(T, I, f) for f in cuda.FAMILIES}
    assert set().union(*fams.values()) == set(every)
    launched = {
        "cg": {"init000", "init111", "zero_x", "init_status", "cg_spmv01", "cg_update10",
               "cg_direction1", "residual0", "residual1"},
        "bicgstab": {"init100", "zero_x", "init_status", "bicg_check", "bicg_direction01",
                     "bicg_spmv_v11", "bicg_update_s00", "bicg_spmv_t10", "bicg_update_r01",
                     "residual1"},
        "gmres": {"gmres_spmv0", "gmres_spmv1", "gmres_dots1", "gmres_combine0", "gmres_scale",
                  "residual0"},
        "cg_blocks": {"cg_blocks000", "cg_blocks010", "cg_blocks100", "cg_blocks110"},
    }
    # CG's module holds the block kernels with their vectors in shared memory; those with
    # them in device memory (a system too large for it) are a module of their own.
    assert {k for k in fams["cg"] if k.startswith("cg_blocks")} == \
        {"cg_blocks001", "cg_blocks011", "cg_blocks101", "cg_blocks111"}
    assert set(fams["cg_blocks"]) == launched["cg_blocks"]
    for fam, names in fams.items():
        assert launched[fam] <= set(names), fam
        assert all(every[k] == v for k, v in names.items())
        assert len(names) < len(every) * 0.7, fam  # the point: a fraction of the templates
    assert not any(k.startswith("bicg") for k in fams["cg"])
    assert not any(k.startswith("cg_") for k in fams["bicgstab"])
    assert cuda.family_of("bicgstab") == "bicgstab" and cuda.family_of("minres") == "cg"
    with pytest.raises(ValueError, match="family"):
        cuda.instantiations(T, I, "lu")


def test_kernels_compile_each_module_once_across_threads_and_retry_a_failure():
    """A prefetch and a solve asking for one module share one compilation; a failure is not kept."""
    import threading
    import time

    calls = []
    fail = {"on": True}

    def fake_compile(device_id, dtype, index_dtype, *, contiguous_rows=True, family=None):
        calls.append(family)
        time.sleep(0.05)  # long enough for the other thread to ask meanwhile
        if family == "gmres" and fail["on"]:
            raise RuntimeError("nvrtc: boom")
        return {"family": family}

    cache = cuda.ModuleCache(fake_compile)
    t = cache.prefetch(7, np.float64, np.int32, ("cg", "bicgstab"))
    got = []
    asker = threading.Thread(target=lambda: got.append(cache.kernels(7, np.float64, np.int32, "cg")))
    asker.start()
    asker.join()
    t.join()
    assert got == [{"family": "cg"}]
    assert sorted(calls) == ["bicgstab", "cg"]  # once each
    assert cache.loaded(7, np.float64, np.int32, "bicgstab")
    assert cache.loaded_modules() == ["bicgstab double/int on cuda:7", "cg double/int on cuda:7"]
    assert cache.prefetch(7, np.float64, np.int32, ("cg", "bicgstab")) is None  # nothing left to do
    cache.prefetch(7, np.float64, np.int32, ("gmres",)).join()  # the error is dropped there ...
    assert not cache.loaded(7, np.float64, np.int32, "gmres")
    with pytest.raises(RuntimeError, match="boom"):  # ... and raised by the call that needs it
        cache.kernels(7, np.float64, np.int32, "gmres")
    fail["on"] = False
    assert cache.kernels(7, np.float64, np.int32, "gmres") == {"family": "gmres"}
    with pytest.raises(ValueError, match="family"):
        cache.kernels(7, np.float64, np.int32, "lu")
    with pytest.raises(ValueError, match="family"):  # the process's cache, before any compiling
        cuda.kernels(7, np.float64, np.int32, "lu")


@pytest.mark.gpu
def test_row_launch_gives_the_module_and_one_wave_of_blocks_at_most():
    k, grid = cuda.row_launch(0, np.float64, np.int32, "cg", 10_000)
    assert k is cuda.kernels(0, np.float64, np.int32, "cg")  # the cached module, not a new one
    assert grid == cuda.grid_rows(10_000, 0) == -(-10_000 // cuda.THREADS)
    _, big = cuda.row_launch(0, np.float64, np.int32, "gmres", 1 << 26)
    assert big == 8 * cuda.sm_count(0)
