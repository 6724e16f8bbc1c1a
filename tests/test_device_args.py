"""Device arguments: one reading of "cuda:1", "all", 2, Devices and torch.devices for every call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from managed_solve import Solver, _backend, solve, solve_many
from managed_solve.device_args import cuda_ordinal, resolve_device, resolve_devices
from managed_solve.devices import Device, discover
from managed_solve.manager import DeviceManager
from managed_solve.sharded import solve_sharded
from managed_solve.system import LinearSystem
from tests._problems import poisson2d


@pytest.fixture
def inventory():
    return discover(simulate="3x1GiB")


def names(devs):
    return [str(d) for d in devs]


def test_one_device_by_name_torch_device_or_device(inventory):
    sim1 = inventory[1]
    assert resolve_device("sim:1", inventory, call="solve") is sim1
    assert resolve_device(" SIM:1 ", inventory, call="solve") is sim1
    assert resolve_device("cpu", inventory, call="solve") is inventory[-1]
    assert resolve_device(torch.device("cpu"), inventory, call="solve") is inventory[-1]
    twin = Device("sim", 1, "another sim:1", 1 << 20)
    assert resolve_device(twin, inventory, call="solve") is sim1  # the inventory's own
    assert resolve_device(twin, inventory, call="solve", as_given=True) is twin


def test_one_device_errors_name_the_call_the_argument_and_the_fix(inventory):
    with pytest.raises(ValueError, match=r"^solve\(device='sim:7'\): sim:7 is not managed here "
                                         r"\(devices: sim:0, sim:1, sim:2, cpu\); name one of those.*simulate"):
        resolve_device("sim:7", inventory, call="solve")
    with pytest.raises(ValueError, match=r"solve\(device=\.\.\.\): 'cuda1' is not a device name"):
        resolve_device("cuda1", inventory, call="solve")
    with pytest.raises(TypeError, match=r"^solve\(device=3\): 3 \(int\), names no device"):
        resolve_device(3, inventory, call="solve")
    with pytest.raises(ValueError, match=r"^device='sim:7': sim:7 is not managed"):
        resolve_device("sim:7", inventory, call=None)
    # Outside devices allowed: a name found nowhere is a device this process cannot use.
    with pytest.raises(RuntimeError, match="sim:7 is not managed here"):
        resolve_device("sim:7", inventory, call="solve", any_cuda=True)
    stranger = Device("sim", 9, "elsewhere", 1 << 20)
    with pytest.raises(ValueError, match="sim:9 is not managed here"):
        resolve_device(stranger, inventory, call="solve")


def test_unmanaged_cuda_gpu_without_one_is_a_runtime_error(inventory):
    if _backend.cuda_usable():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match=r"solve\(device='cuda:0'\): no such CUDA GPU here .*device='cpu'"):
        resolve_device("cuda:0", inventory, call="solve", any_cuda=True)
    with pytest.raises(ValueError, match="cuda:0 is not managed here"):
        resolve_device("cuda:0", inventory, call="solve")


def test_several_devices(inventory):
    assert names(resolve_devices("all", inventory, call="c")) == ["sim:0", "sim:1", "sim:2"]
    assert names(resolve_devices(np.int64(2), inventory, call="c")) == ["sim:0", "sim:1"]
    assert names(resolve_devices("sim:2, cpu,", inventory, call="c")) == ["sim:2", "cpu"]
    assert names(resolve_devices(["sim:1", inventory[0], torch.device("cpu")], inventory, call="c")) \
        == ["sim:1", "sim:0", "cpu"]
    assert names(resolve_devices(inventory[2], inventory, call="c")) == ["sim:2"]
    assert names(resolve_devices(torch.device("cpu"), inventory, call="c")) == ["cpu"]
    assert names(resolve_devices(["sim:0", "sim:0"], inventory, call="c")) == ["sim:0", "sim:0"]


def test_several_devices_errors(inventory):
    with pytest.raises(ValueError, match=r"^c\(devices=\[\]\): the list is empty"):
        resolve_devices([], inventory, call="c")
    with pytest.raises(ValueError, match=r"^c\(devices=4\): expected between 1 and 3"):
        resolve_devices(4, inventory, call="c")
    with pytest.raises(TypeError, match=r"^c\(devices=1\.5\): expected 'all'"):
        resolve_devices(1.5, inventory, call="c")
    with pytest.raises(TypeError, match=r"^c\(devices=True\): expected 'all'"):
        resolve_devices(True, inventory, call="c")
    with pytest.raises(TypeError, match=r"^c\(devices=\.\.\.\): item 1, 2\.0 \(float\), names no device"):
        resolve_devices(["sim:0", 2.0], inventory, call="c")
    with pytest.raises(ValueError, match=r"^c\(devices='sim:5'\): sim:5 is not managed"):
        resolve_devices("sim:0,sim:5", inventory, call="c")
    with pytest.raises(RuntimeError, match=r"^c\(devices='all'\): no GPU .*MANAGED_SOLVE_SIMULATE"):
        resolve_devices("all", [inventory[-1]], call="c")


def test_cuda_ordinal_says_whether_arrays_go_to_a_gpu_and_which():
    assert cuda_ordinal("cuda:1") == 1 and cuda_ordinal("gpu") == 0 and cuda_ordinal("cuda") == 0
    assert cuda_ordinal(torch.device("cuda", 2)) == 2
    assert cuda_ordinal("cpu") is None and cuda_ordinal("sim:1") is None
    assert cuda_ordinal(Device("cuda", 3, "", 0)) == 3 and cuda_ordinal(Device("sim", 3, "", 0)) is None
    with pytest.raises(ValueError, match=r"^f\(device=\.\.\.\): 'cuda1' is not a device name"):
        cuda_ordinal("cuda1", what="f(device=...)")


def test_every_entry_point_reads_a_device_the_same_way():
    """An unknown name gets the same words from each call that takes a device."""
    dm = DeviceManager(simulate="2x1GiB")
    A, b = poisson2d(6), np.ones(36)
    same = r"sim:7 is not managed here \(devices: sim:0, sim:1, cpu\); name one of those"
    with pytest.raises(RuntimeError, match=r"solve\(device='sim:7'\): " + same):
        solve(A, b, device="sim:7", manager=dm)
    with pytest.raises(RuntimeError, match=r"^Solver\(device='sim:7'\): " + same):
        Solver(A, device="sim:7", manager=dm)
    with pytest.raises(ValueError, match=r"solve_many\(devices='sim:7'\): " + same):
        solve_many([LinearSystem(A, b)], devices=["sim:7"], manager=dm)
    with pytest.raises(ValueError, match=r"solve_sharded\(devices='sim:7'\): " + same):
        solve_sharded(A, b, devices=["sim:0", "sim:7"], manager=dm)
    with pytest.raises(ValueError, match=r"device='sim:7': " + same):
        dm.get_device("sim:7")
    # ... and a good one the same way too: a torch.device, a Device, or a name.
    assert solve(A, b, device=torch.device("cpu"), manager=dm, method="cg").device == "cpu"
    assert {r.device for r in solve_many([LinearSystem(A, b)] * 2, devices="sim:1", manager=dm)} == {"sim:1"}
    assert {r.device for r in solve_many([LinearSystem(A, b)] * 4, devices=1, manager=dm)} == {"sim:0"}
    assert {r.device for r in solve_many([LinearSystem(A, b)] * 4, devices="all", manager=dm)} <= {"sim:0", "sim:1"}
    assert solve_sharded(A, b, devices=dm.accelerators, manager=dm).converged


def test_a_name_that_maps_to_another_says_so_and_all_is_told_to_stand_alone():
    dm = DeviceManager(simulate="2x1GiB")
    with pytest.raises(ValueError, match=r"cuda:0 \('gpu' means cuda:0\) is not managed here"):
        resolve_devices("gpu", dm.inventory, call="solve_many", arg="devices")
    with pytest.raises(ValueError, match=r"^solve_many\(devices=\.\.\.\): 'all' is not a device "
                                         r"name \('all' stands alone"):
        resolve_devices("all,cpu", dm.inventory, call="solve_many", arg="devices")
