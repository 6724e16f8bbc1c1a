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
    defined = set(re.findall(r"__global__ void (ms_\w+)\(", text))
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
    assert len(names) == 50


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
