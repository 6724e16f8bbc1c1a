"""ManagedTensor: per-operation placement, pins, moves, autograd across devices.

Placement runs on simulated GPUs here (``sim:k`` tensors live on the CPU and
carry their placement); the same tests run on real devices on a GPU machine.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from managed_solve.manager import DeviceManager  # noqa: E402
from managed_solve.tensor import ManagedTensor, managed, placement_of  # noqa: E402

PAIRS = [
    pytest.param(("sim", "sim:0", "sim:1"), id="sim"),
    pytest.param(("real", "cuda:0", "cpu"), marks=pytest.mark.gpu, id="cuda-cpu"),
    pytest.param(("real", "cuda:0", "cuda:1"), marks=pytest.mark.multi_gpu, id="cuda-cuda"),
]


@pytest.fixture(params=PAIRS)
def env(request):
    """(manager, device A, device B, make) where make(array, device) is a ManagedTensor there."""
    mode, a, b = request.param
    dm = DeviceManager(simulate="2x1GiB") if mode == "sim" else DeviceManager()

    def make(x, dev, requires_grad=False):
        t = managed(torch.as_tensor(x, dtype=torch.float64), manager=dm).to(dev)
        return t.requires_grad_() if requires_grad else t

    return dm, a, b, make


def _np(t):
    return t.detach().as_subclass(torch.Tensor).cpu().numpy()


def test_results_are_managed_and_plain_tensors_mix_in():
    a = torch.arange(4.0).as_subclass(ManagedTensor)
    out = a * 2 + torch.ones(4)
    assert type(out) is ManagedTensor
    np.testing.assert_array_equal(_np(out), [1.0, 3.0, 5.0, 7.0])
    assert placement_of(torch.ones(2)) == "cpu"
    with pytest.raises(TypeError, match=r"managed\(tensor=...\): expected a torch.Tensor, got list"):
        managed([1.0])


def test_mixed_device_arithmetic_runs_where_most_bytes_are(env):
    dm, A, B, make = env
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(8), rng.standard_normal((50, 8))
    a, b = make(x, A), make(y, B)
    out = a + b  # b holds most bytes: a moves to B
    assert out.placement == B
    np.testing.assert_allclose(_np(out), x + y)
    assert (b[:2] * a).placement == B  # the 2-row slice still outweighs a
    out2 = a * b[:1]  # equal bytes: the first operand's device, deterministically
    assert out2.placement == A and (b[:1] * a).placement == B
    np.testing.assert_allclose(_np(out2), y[:1] * x)
    assert a.placement == A and b.placement == B  # operands never move in place


def test_plain_tensor_operand_is_moved_like_any_other(env):
    dm, A, B, make = env
    w = make(np.ones((10, 10)), A)
    x = torch.arange(10.0, dtype=torch.float64)  # a plain CPU tensor
    out = w @ x
    assert out.placement == A
    np.testing.assert_allclose(_np(out), np.full(10, 45.0))


def test_stack_and_cat_gather_operands_from_two_devices(env):
    dm, A, B, make = env
    rows = [np.full(3, i, dtype=float) for i in range(5)]
    ts = [make(r, A if i < 2 else B) for i, r in enumerate(rows)]  # 3 of 5 on B
    s = torch.stack(ts)
    assert s.placement == B and type(s) is ManagedTensor
    np.testing.assert_array_equal(_np(s), np.stack(rows))
    c = torch.cat([ts[0], ts[1], ts[2]])
    assert c.placement == A
    np.testing.assert_array_equal(_np(c), np.concatenate(rows[:3]))


def test_inplace_ops_write_the_original_on_its_device(env):
    dm, A, B, make = env
    a = make(np.zeros(4), A)
    big = make(np.arange(400.0), B)  # would win by bytes, but a is written
    ptr = a.data_ptr()
    a.add_(big[:4])
    a += big[4:8]
    a[1:3] = big[100:102]
    assert a.placement == A and a.data_ptr() == ptr
    np.testing.assert_array_equal(_np(a), [4.0, 100.0, 101.0, 10.0])
    out = make(np.zeros(4), A)
    torch.add(big[:4], big[4:8], out=out)
    assert out.placement == A
    np.testing.assert_array_equal(_np(out), [4.0, 6.0, 8.0, 10.0])


def test_indexing_with_an_index_tensor_on_another_device(env):
    dm, A, B, make = env
    data = make(np.arange(100.0), A)
    idx = torch.tensor([3, 1, 4, 1, 5])  # plain CPU long tensor
    if B != "cpu":
        idx = managed(idx, manager=dm).to(B)
    got = data[idx]
    assert got.placement == A
    np.testing.assert_array_equal(_np(got), [3.0, 1.0, 4.0, 1.0, 5.0])
    vals, where = torch.max(data.reshape(10, 10), dim=1)  # a namedtuple result
    assert type(vals) is ManagedTensor and vals.placement == A
    np.testing.assert_array_equal(_np(where), np.full(10, 9))


def test_pinned_operand_wins_over_bytes(env):
    dm, A, B, make = env
    small = make(np.ones(2), A).pin()
    big = make(np.ones((100, 2)), B)
    assert small.pinned is not None and str(small.pinned) == A
    out = big * small
    assert out.placement == A
    small.unpin()
    assert small.pinned is None
    assert (big * small).placement == B


def test_two_operands_pinned_to_different_devices_is_an_error_naming_both(env):
    dm, A, B, make = env
    a = make(np.ones(3), A).pin()
    b = make(np.ones(3), B).pin()
    with pytest.raises(RuntimeError, match=rf"pinned to different devices.*{A}.*{B}"):
        a + b
    c = make(np.zeros(3), B)
    with pytest.raises(RuntimeError, match=rf"in-place.*pinned to {A}"):
        c.add_(a)


def test_pin_to_another_device_returns_a_pinned_copy(env):
    dm, A, B, make = env
    a = make(np.arange(3.0), A)
    p = a.pin(B)
    assert p is not a and p.placement == B and str(p.pinned) == B and a.pinned is None
    np.testing.assert_array_equal(_np(p), [0.0, 1.0, 2.0])
    assert dm.plan([p])[0].device == B  # the manager's plan respects the pin


def test_sim_moves_fall_back_where_the_manager_finds_room():
    dm = DeviceManager(simulate="2x1MiB", reserved=0.0)
    a = managed(torch.ones(5000, dtype=torch.float64), manager=dm).to("sim:0")  # 40 kB
    b = managed(torch.ones(50000, dtype=torch.float64), manager=dm).to("sim:1")  # 400 kB
    sim1 = dm.get_device("sim:1")
    assert (a + b[:5000]).placement == "sim:0"
    assert (b + a.repeat(10)).placement == "sim:1"  # repeat result is on sim:0, b wins by bytes
    sim1.sim_used_bytes = sim1.total_bytes - 1000  # sim:1 full: a's 40 kB cannot move there
    assert (b + a.repeat(10)).placement == "sim:0"


def test_sparse_operand_is_sized_by_stored_bytes():
    dm = DeviceManager(simulate="2x1GiB")
    i = torch.tensor([[0, 5, 900], [1, 7, 3]])
    S = torch.sparse_coo_tensor(i, torch.ones(3, dtype=torch.float64), (2000, 2000))
    S = managed(S, manager=dm).to("sim:0")  # 32 MB dense shape, 72 stored bytes
    d = managed(torch.ones(2000, 4, dtype=torch.float64), manager=dm).to("sim:1")  # 64 kB
    out = torch.sparse.mm(S, d)
    assert out.placement == "sim:1"
    np.testing.assert_array_equal(_np(out)[[0, 5, 900]], np.ones((3, 4)))


def test_to_cuda_cpu_obey_and_keep_values(env):
    dm, A, B, make = env
    a = make(np.arange(3.0), A)
    assert a.to(B).placement == B and a.cuda(A).placement == A
    c = a.cpu()
    assert c.placement == "cpu" and c.device.type == "cpu"
    np.testing.assert_array_equal(_np(c), [0.0, 1.0, 2.0])
    assert a.to(torch.float32).placement == A  # a dtype change keeps the placement
    assert a.managed_device == dm.get_device(A)
    moved = a.to(dm.get_device(B))  # a Device object names the same place as its string
    assert moved.placement == B and moved.device == torch.device("cpu" if B.startswith("sim") else B)


def test_cuda_disperse_spreads_over_simulated_gpus():
    dm = DeviceManager(simulate="2x1GiB")
    ts = [managed(torch.zeros(1 << 17), manager=dm).cuda(disperse=True) for _ in range(4)]
    assert [t.placement for t in ts] == ["sim:0", "sim:1", "sim:0", "sim:1"]
    assert dm.reserved_bytes("sim:0") >= 2 * (1 << 19)  # held while the tensors live
    del ts
    import gc

    gc.collect()
    assert dm.reserved_bytes("sim:0") == 0 and dm.reserved_bytes("sim:1") == 0
    pinned = managed(torch.zeros(4), manager=dm).pin("sim:1")
    assert pinned.cuda().placement == "sim:1"


def test_cuda_without_gpu_stays_on_cpu_with_one_log_line(caplog):
    dm = DeviceManager(devices=["cpu"])
    t = managed(torch.arange(3.0), manager=dm)
    with caplog.at_level(logging.INFO, logger="managed_solve"):
        out = t.cuda(disperse=True)
    assert out.placement == "cpu" and out.device.type == "cpu"
    lines = [r for r in caplog.records if "no GPU" in r.getMessage()]
    assert len(lines) == 1 and "ManagedTensor.cuda()" in lines[0].getMessage()


def test_autograd_across_devices_matches_single_device_reference(env):
    dm, A, B, make = env
    rng = np.random.default_rng(1)
    xw, yw = rng.standard_normal((6, 4)), rng.standard_normal((4, 3))
    x, w = make(xw, A, requires_grad=True), make(yw, B, requires_grad=True)
    loss = torch.tanh(x @ w).pow(2).sum() + (x.sum(dim=1, keepdim=True) * w.sum()).mean()
    loss.backward()
    rx = torch.tensor(xw, requires_grad=True)
    rw = torch.tensor(yw, requires_grad=True)
    ref = torch.tanh(rx @ rw).pow(2).sum() + (rx.sum(dim=1, keepdim=True) * rw.sum()).mean()
    ref.backward()
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-12)
    np.testing.assert_allclose(_np(x.grad), rx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(_np(w.grad), rw.grad.numpy(), rtol=1e-12)
    assert x.grad.placement == A and w.grad.placement == B  # gradients on each leaf's device


def test_ops_from_threads_place_consistently():
    from concurrent.futures import ThreadPoolExecutor

    dm = DeviceManager(simulate="2x1GiB")
    big = managed(torch.ones(1000, dtype=torch.float64), manager=dm).to("sim:1")

    def work(i):
        small = managed(torch.full((10,), float(i), dtype=torch.float64), manager=dm).to("sim:0")
        out = big[:10] + small
        return out.placement, float(out.sum())

    with ThreadPoolExecutor(4) as pool:
        res = list(pool.map(work, range(16)))
    assert res == [("sim:1", 10.0 * (1 + i)) for i in range(16)]


def _load_example(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_different_device_tensors_matches_plain_tensors(capsys):
    err = _load_example("different_device_tensors").main(["--small", "--simulate", "2x1GiB"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("max_abs_error=") and float(out[-1].split("=")[1]) == err
    assert err <= 1e-12
    assert "result computed on sim:1" in out[-3] and "a.grad on sim:0" in out[-2]


def test_cuda_without_gpu_warns_once_with_the_fix():
    from managed_solve.devices import DeviceWarning, forget_warnings

    forget_warnings()
    dm = DeviceManager(devices=["cpu"])
    t = managed(torch.arange(3.0), manager=dm)
    with pytest.warns(DeviceWarning, match=r"ManagedTensor.cuda\(\): no GPU is managed here.*Fix: "):
        assert t.cuda().placement == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert t.cuda().placement == "cpu"  # once per process
    forget_warnings()


def test_meta_operands_are_left_to_torch():
    dm = DeviceManager(simulate="1x1GiB")
    a = managed(torch.empty(4, device="meta"), manager=dm)
    out = a + managed(torch.empty(4, device="meta"), manager=dm)
    assert out.device.type == "meta"


@pytest.mark.parametrize("name, problem", [("sim:5", "sim:5 is not managed here"),
                                           ("simx", "'simx' is not a device name"),
                                           ("sim", "'sim' is not a device name")])
def test_simulated_devices_the_manager_lacks_are_refused_as_it_refuses_them(name, problem):
    """A simulated GPU exists only in its manager: torch cannot check the name, the manager does."""
    dm = DeviceManager(simulate="2x1GiB")
    a = managed(torch.ones(4, dtype=torch.float64), manager=dm).to("sim:0")
    with pytest.raises(ValueError, match=rf"ManagedTensor\.to\(device=.*{problem}"):
        a.to(name)
    with pytest.raises(ValueError, match=rf"ManagedTensor\.pin\(device=.*{problem}"):
        a.pin(name)
    with pytest.raises(ValueError, match=problem):
        dm.get_device(name)  # the same lookup
    assert a.placement == "sim:0" and a.pinned is None


def test_simulated_device_names_are_read_as_the_manager_reads_them():
    dm = DeviceManager(simulate="2x1GiB")
    a = managed(torch.ones(4, dtype=torch.float64), manager=dm)
    moved = a.to(" SIM:1")
    assert moved.placement == "sim:1" and moved.managed_device is dm.get_device("sim:1")
    assert str(a.pin("Sim:1").pinned) == "sim:1"


def test_managed_refuses_a_manager_argument_that_is_no_manager():
    with pytest.raises(TypeError, match=r"managed\(manager='cpu'\): expected a DeviceManager or None"):
        managed(torch.ones(2), manager="cpu")


def test_a_tensor_given_as_the_device_means_where_it_is_placed(env):
    # pin(device=other) read other.device, which is the CPU for a tensor on a
    # simulated GPU: the pin went to "cpu", not to other's sim:1. to(other) and
    # cuda(other) lost the simulated placement the same way.
    dm, A, B, make = env
    a = make(np.arange(3.0), A)
    other = make(np.zeros(2), B).to(torch.float32)
    for p in (a.pin(other), a.pin(device=other)):
        assert p.placement == B and str(p.pinned) == B and p.dtype == torch.float64
        assert dm.plan([p])[0].device == B
    assert a.pin(make(np.zeros(1), A)) is a and a.placement == A  # already there: pinned in place
    a.unpin()
    moved = a.to(other)  # torch's rule: other's device (here its placement) and dtype
    assert moved.placement == B and moved.dtype == torch.float32
    assert a.to(device=other).placement == B and a.to(device=other).dtype == torch.float64
    assert a.cuda(other).placement == B and a.cuda(device=other).dtype == torch.float64
    np.testing.assert_array_equal(_np(moved), [0.0, 1.0, 2.0])
    plain = torch.zeros(1)  # a plain tensor: its device is its placement
    assert a.pin(plain).placement == "cpu" and a.to(device=plain).placement == "cpu"


@pytest.mark.parametrize("make", [
    pytest.param(lambda a: a * 2, id="arithmetic"),
    pytest.param(lambda a: a.reshape(2, 2).T, id="view"),
    pytest.param(lambda a: a.double(), id="double"),
    pytest.param(lambda a: a.clone(), id="clone"),
    pytest.param(lambda a: a.to("sim:0", torch.float64), id="to-same-device-dtype"),
    pytest.param(lambda a: a.to(torch.float64), id="to-dtype"),
    pytest.param(lambda a: torch.max(a.reshape(2, 2), dim=0).values, id="named-tuple"),
])
def test_results_keep_the_manager_of_their_tensor(make):
    # Results lost managed(t, manager=dm)'s manager: their own .to("sim:2")
    # asked the default manager, which has no such device, and raised.
    dm = DeviceManager(simulate="3x1GiB")
    a = managed(torch.arange(4.0), manager=dm).to("sim:0")  # float32: double() is a copy
    r = make(a)
    assert r.placement == "sim:0" and r.managed_device is dm.get_device("sim:0")
    moved = r.to("sim:2")
    assert moved.placement == "sim:2" and moved.managed_device is dm.get_device("sim:2")
    assert str(r.pin("sim:2").pinned) == "sim:2"
    np.testing.assert_array_equal(_np(moved), _np(r))


def test_gradients_flow_across_moves_of_a_tensor_with_its_own_manager():
    dm = DeviceManager(simulate="3x1GiB")
    x = managed(torch.arange(3.0, dtype=torch.float64), manager=dm).requires_grad_()
    ((x.to("sim:0") * 2).to("sim:2") ** 2).sum().backward()
    np.testing.assert_array_equal(_np(x.grad), 8.0 * np.arange(3.0))


def test_managed_keeps_a_leaf_a_leaf_on_the_same_memory():
    # managed() of a leaf that requires grad returned a non-leaf alias: its
    # .grad stayed None after backward and optimizers refused it.
    dm = DeviceManager(simulate="2x1GiB")
    t = torch.ones(3, dtype=torch.float64, requires_grad=True)
    w = managed(t, manager=dm)
    assert w.is_leaf and w.requires_grad and w.grad_fn is None
    (w * torch.arange(3.0, dtype=torch.float64)).sum().backward()
    np.testing.assert_array_equal(_np(w.grad), [0.0, 1.0, 2.0])
    torch.optim.SGD([w], lr=0.5).step()
    np.testing.assert_array_equal(t.detach().numpy(), [1.0, 0.5, 0.0])  # the same memory
    p = managed(torch.nn.Parameter(torch.zeros(2)), manager=dm)
    assert isinstance(p, torch.nn.Parameter) and type(p) is ManagedTensor and p.is_leaf
    x = torch.ones(2, requires_grad=True)
    y = managed(x * 3)  # not a leaf: the graph to x is kept
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0])


def _used(dm):
    return [dm.get_device(f"sim:{i}").sim_used_bytes for i in range(2)]


def test_a_simulated_gpu_counts_each_tensor_placed_there_until_it_is_freed():
    import copy
    import gc

    dm = DeviceManager(simulate="2x1MiB", reserved=0.0)
    a = managed(torch.ones(1000, dtype=torch.float64), manager=dm).to("sim:0")
    assert _used(dm) == [8000, 0]
    assert a.to("sim:0") is a and _used(dm) == [8000, 0]  # already there: counted once
    half = a.to("sim:0", torch.float32)  # a copy on sim:0 takes its own room
    cast = a.to(torch.float16)
    assert _used(dm) == [8000 + 4000 + 2000, 0]
    assert dm.available_bytes(dm.get_device("sim:0")) == (1 << 20) - 14000
    twin = copy.deepcopy(a)
    assert twin.placement == "sim:0" and _used(dm) == [22000, 0]
    del half, cast, twin
    gc.collect()
    assert _used(dm) == [8000, 0]
    del a
    gc.collect()
    assert _used(dm) == [0, 0]
