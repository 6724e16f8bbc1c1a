"""Root pytest configuration: run mode, markers, the usable-GPU check.

``NUMBA_ENABLE_CUDASIM`` must be set before numba is first imported, and
importing ``managed_solve`` imports numba, so the GPU check below uses CuPy
directly instead of the library's ``managed_solve._backend.cuda_usable``.
"""

from __future__ import annotations

import contextlib
import os


def _usable_gpu_count() -> int:
    """Number of CUDA GPUs CuPy can really use (0 without a driver).

    cupy installs and imports on machines without a driver; then
    ``getDeviceCount`` raises ``CUDARuntimeError`` and
    ``import cupyx.scipy.sparse.linalg`` raises ImportError. Never use
    ``numba.cuda.is_available()``: it is True under the simulator.
    """
    try:
        import cupy

        n = int(cupy.cuda.runtime.getDeviceCount())
        import cupyx.scipy.sparse.linalg  # noqa: F401
    except Exception:  # CUDARuntimeError, ImportError, a broken CUDA library
        return 0
    return n


GPU_COUNT = _usable_gpu_count()
if "NUMBA_ENABLE_CUDASIM" not in os.environ and GPU_COUNT == 0:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
CUDASIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"

import pytest  # noqa: E402

try:
    from hypothesis import settings

    # The first call of a Numba function JIT-compiles: no per-example deadline.
    # The default profile is derandomized and keeps no example database, so a
    # run (CI's included) draws the same examples on every machine and writes
    # nothing into the repository. `HYPOTHESIS_PROFILE=explore` searches anew
    # with a database under the user's cache directory, to hunt for new cases.
    settings.register_profile("managed_solve", deadline=None, max_examples=30,
                              derandomize=True, database=None, print_blob=True)
    try:
        from hypothesis.database import DirectoryBasedExampleDatabase

        _cache = os.path.join(os.path.expanduser("~"), ".cache", "managed_solve", "hypothesis")
        settings.register_profile("explore", deadline=None, max_examples=300,
                                  database=DirectoryBasedExampleDatabase(_cache))
    except ImportError:
        pass
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "managed_solve"))
except ImportError:  # hypothesis is an extra of `test`
    pass


def pytest_report_header(config):
    if GPU_COUNT:
        mode = f"GPU mode: {GPU_COUNT} usable CUDA GPU(s)"
    else:
        mode = "CPU-only mode: gpu/multi_gpu tests are skipped"
    return [mode + f"; Numba CUDA simulator {'on' if CUDASIM else 'off'}"]


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a usable CUDA GPU (none found)")
    skip_multi = pytest.mark.skip(reason="needs two or more usable CUDA GPUs")
    skip_sim = pytest.mark.skip(reason="needs NUMBA_ENABLE_CUDASIM=1 or a GPU")
    for item in items:
        if "multi_gpu" in item.keywords and GPU_COUNT < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and GPU_COUNT < 1:
            item.add_marker(skip_gpu)
        elif "cudasim" in item.keywords and not (CUDASIM or GPU_COUNT):
            item.add_marker(skip_sim)


@pytest.fixture(autouse=True)
def _cpu_tests_place_on_the_cpu(request):
    """Tests not marked ``gpu``/``multi_gpu`` describe the host path: they run it on any machine.

    ``solve(A, b)`` with host inputs and no ``device`` lets the process-wide
    DeviceManager choose, and on a machine with GPUs (or with
    ``MANAGED_SOLVE_SIMULATE`` set) it chooses one. For the duration of an
    unmarked test the default manager holds the CPU only (as on CI); the
    ``gpu`` tests cover the placement on GPUs. Tests with their own managers
    are unaffected.
    """
    if request.node.get_closest_marker("gpu") or request.node.get_closest_marker("multi_gpu"):
        yield
        return
    from managed_solve import manager as mgr_mod

    previous = mgr_mod._default
    mgr_mod.set_default_manager(mgr_mod.DeviceManager(["cpu"]))
    try:
        yield
    finally:
        mgr_mod.set_default_manager(previous)


@pytest.fixture
def settings():
    """``settings(name=value, ...)`` applies ``ms.config.override`` until the test ends."""
    from managed_solve import config

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(config.override(**changes))
