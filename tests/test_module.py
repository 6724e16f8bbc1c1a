"""ManagedModule: wrapping, whole-module placement, pinning, meta planning, autograd across devices."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from managed_solve.manager import DeviceManager  # noqa: E402
from managed_solve.module import ManagedModule  # noqa: E402
from managed_solve.tensor import ManagedTensor, managed  # noqa: E402

PAIRS = [
    pytest.param(("sim", "sim:0", "sim:1"), id="sim"),
    pytest.param(("real", "cuda:0", "cpu"), marks=pytest.mark.gpu, id="cuda-cpu"),
    pytest.param(("real", "cuda:0", "cuda:1"), marks=pytest.mark.multi_gpu, id="cuda-cuda"),
]


@pytest.fixture(params=PAIRS)
def env(request):
    mode, a, b = request.param
    dm = DeviceManager(simulate="2x1GiB") if mode == "sim" else DeviceManager()
    return dm, a, b


def _net(seed=0, n_in=8, hidden=16, n_out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out)).double()


def _np(t):
    return t.detach().as_subclass(torch.Tensor).cpu().numpy()


def _grads(m):
    return [_np(p.grad) for p in m.parameters()]


def _assert_grads_equal(m, ref):
    for g, r in zip(_grads(m), _grads(ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-11, atol=1e-13)


def test_from_module_wraps_in_place_keeping_state_dict_and_forward():
    plain = _net()
    ref = copy.deepcopy(plain)
    bn = nn.BatchNorm1d(3).double()
    plain.append(bn)
    ref.append(copy.deepcopy(bn))
    m = ManagedModule.from_module(plain)
    assert m is plain and isinstance(m, nn.Sequential) and isinstance(m, ManagedModule)
    assert all(type(p) is ManagedTensor and isinstance(p, nn.Parameter) for p in m.parameters())
    assert all(type(b) is ManagedTensor for b in m.buffers())
    sd, rsd = m.state_dict(), ref.state_dict()
    assert list(sd) == list(rsd)
    for k in sd:
        np.testing.assert_array_equal(_np(sd[k]), _np(rsd[k]))
    x = torch.randn(5, 8, dtype=torch.float64)
    np.testing.assert_allclose(_np(m(x)), _np(ref(x)), rtol=1e-14)
    m.load_state_dict(rsd)  # loading works with managed parameters
    assert all(type(v) is torch.Tensor for v in sd.values())  # checkpoints need no managed_solve
    import io

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    np.testing.assert_array_equal(_np(loaded["0.weight"]), _np(rsd["0.weight"]))
    with pytest.raises(TypeError, match=r"from_module\(module=...\): expected a torch.nn.Module"):
        ManagedModule.from_module(torch.ones(2))


def test_deepcopy_shares_the_manager_and_copies_placement():
    dm = DeviceManager(simulate="2x1GiB")
    m = ManagedModule.from_module(_net(), manager=dm).to("sim:1")
    m[0].weight.pin()
    c = copy.deepcopy(m)
    assert c.manager is dm and type(c) is type(m)
    assert all(p.placement == "sim:1" and isinstance(p, nn.Parameter) for p in c.parameters())
    assert c[0].weight is not m[0].weight and str(c[0].weight.pinned) == "sim:1"
    x = torch.randn(2, 8, dtype=torch.float64)
    np.testing.assert_array_equal(_np(c(x)), _np(m(x)))
    with torch.no_grad():
        c[0].weight.add_(1.0)
    assert not torch.equal(c[0].weight, m[0].weight)  # no shared memory


def test_optimizer_steps_equal_a_plain_module():
    m, ref = ManagedModule.from_module(_net()), _net()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    x, y = torch.randn(20, 8, dtype=torch.float64), torch.randn(20, 3, dtype=torch.float64)
    for _ in range(5):
        for mod, o in ((m, opt), (ref, ropt)):
            o.zero_grad()
            nn.functional.mse_loss(mod(x), y).backward()
            o.step()
    for p, r in zip(m.parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(_np(p), _np(r), rtol=1e-12)


def test_subclass_converts_parameters_before_optimizers_see_them():
    class Net(ManagedModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.register_buffer("scale", torch.ones(2))

        def forward(self, x):
            return self.lin(x) * self.scale

    net = Net()
    params = list(net.parameters())
    assert all(type(p) is ManagedTensor for p in params)
    assert type(net.scale) is ManagedTensor
    assert type(net(torch.ones(3, 4))) is ManagedTensor
    assert [p is q for p, q in zip(params, net.parameters(), strict=True)] == [True, True]


def test_cuda_places_the_whole_module_sized_with_gradients():
    dm = DeviceManager(simulate="2x2MiB", reserved=0.0)
    m = ManagedModule.from_module(nn.Linear(256, 256).double(), manager=dm)
    params = sum(p.numel() * 8 for p in m.parameters())  # 526 kB; with gradients 1.05 MB
    sim0 = dm.get_device("sim:0")
    sim0.sim_used_bytes = sim0.total_bytes - int(1.5 * params)  # params fit there, grads too do not
    m.cuda()
    assert m.placement == "sim:1"
    assert {p.placement for p in m.parameters()} == {"sim:1"}
    assert dm.reserved_bytes("sim:1") >= 2 * params  # held while placed
    m.cuda("sim:0")  # an explicit device is obeyed
    assert {p.placement for p in m.parameters()} == {"sim:0"}
    assert dm.reserved_bytes("sim:1") == 0
    m.cpu()
    assert m.placement == "cpu" and all(p.device.type == "cpu" for p in m.parameters())


def test_cuda_without_gpu_keeps_the_module_on_the_cpu():
    dm = DeviceManager(devices=["cpu"])
    m = ManagedModule.from_module(_net(), manager=dm).cuda()
    assert m.placement == "cpu"


def test_to_accepts_dtype_and_managed_devices():
    dm = DeviceManager(simulate="2x1GiB")
    m = ManagedModule.from_module(nn.Linear(3, 3), manager=dm)
    m.to("sim:1", torch.float64)
    assert m.placement == "sim:1" and m.weight.dtype == torch.float64
    m.to(torch.float32)
    assert m.placement == "sim:1" and m.weight.dtype == torch.float32
    m.to(dm.get_device("sim:0"))
    assert m.placement == "sim:0"


def test_meta_module_is_planned_without_allocating():
    dm = DeviceManager(simulate="2x1GiB")
    with torch.device("meta"):
        big = nn.Linear(4096, 4096)  # 64 MiB of float32 weights, none allocated
    m = ManagedModule.from_module(big, manager=dm)
    assert all(p.is_meta for p in m.parameters())
    (place,) = dm.plan([m])
    expected = 2 * (4096 * 4096 + 4096) * 4  # parameters + gradients
    assert expected <= place.nbytes <= expected * 1.01
    m.pin("sim:1")
    assert all(p.is_meta for p in m.parameters())
    assert [str(p.device) for p in dm.plan([1 << 20, m])] == ["sim:0", "sim:1"]  # pin respected


def test_pin_pins_every_parameter_and_buffer(env):
    dm, A, B = env
    m = ManagedModule.from_module(nn.BatchNorm1d(4).double(), manager=dm).pin(A)
    assert str(m.pinned) == A
    assert all(str(t.pinned) == A and t.placement == A for t in [*m.parameters(), *m.buffers()])
    x = managed(torch.randn(64, 4, dtype=torch.float64), manager=dm).to(B)  # outweighs the module
    assert m(x).placement == A
    m.unpin()
    assert m.pinned is None and all(t.pinned is None for t in m.parameters())


# ---------------------------------------------------------------- autograd across devices
def _input(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, dtype=torch.float64, generator=g)


def test_cpu_input_through_a_module_on_another_device(env):
    dm, A, _B = env
    m, ref = ManagedModule.from_module(_net(), manager=dm).to(A), _net()
    x, rx = _input(3).requires_grad_(), _input(3).requires_grad_()  # plain CPU inputs
    out = m(x)
    assert out.placement == A  # the module's bytes outweigh the small batch
    out.pow(2).sum().backward()
    ref(rx).pow(2).sum().backward()
    _assert_grads_equal(m, ref)
    np.testing.assert_allclose(x.grad.numpy(), rx.grad.numpy(), rtol=1e-11)
    assert x.grad.device.type == "cpu"


def test_two_modules_on_different_devices(env):
    dm, A, B = env
    m1 = ManagedModule.from_module(_net(0, 8, 32, 8), manager=dm).to(A)
    m2 = ManagedModule.from_module(_net(1, 8, 32, 3), manager=dm).to(B)
    r1, r2 = _net(0, 8, 32, 8), _net(1, 8, 32, 3)
    h = m1(_input(4))
    assert h.placement == A
    out = m2(h)
    assert out.placement == B
    out.sum().backward()
    r2(r1(_input(4))).sum().backward()
    _assert_grads_equal(m1, r1)
    _assert_grads_equal(m2, r2)
    assert {p.grad.placement for p in m1.parameters()} == {A}
    assert {p.grad.placement for p in m2.parameters()} == {B}


def _recurrent_loss(m, x_a, x_b):
    # The same module used three times in one graph: on A's batch, then twice on B's.
    return m(x_a).pow(2).sum() + m(torch.tanh(m(x_b))).pow(2).mean()


@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "pinned"])
def test_module_reused_on_two_devices_in_one_graph(env, pinned):
    dm, A, B = env
    m, ref = ManagedModule.from_module(_net(0, 8, 16, 8), manager=dm).to(A), _net(0, 8, 16, 8)
    if pinned:
        m.pin()
    x_a = managed(_input(2, 4), manager=dm).to(A)
    x_b = managed(_input(200, 5), manager=dm).to(B)  # outweighs the parameters
    out_b = m(x_b)
    # Unpinned: the layer runs where the big batch is (parameters copied there,
    # differentiably); pinned: the batch comes to the module.
    assert out_b.placement == (A if pinned else B)
    loss = _recurrent_loss(m, x_a, x_b)
    loss.backward()
    rloss = _recurrent_loss(ref, _input(2, 4), _input(200, 5))
    rloss.backward()
    np.testing.assert_allclose(loss.item(), rloss.item(), rtol=1e-12)
    _assert_grads_equal(m, ref)
    assert {p.grad.placement for p in m.parameters()} == {A}  # gradients accumulate at home
    assert {p.placement for p in m.parameters()} == {A}  # parameters never moved


def test_example_multiple_models_spreads_and_equals_one_device_runs(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "multiple_models.py"
    spec = importlib.util.spec_from_file_location("example_multiple_models", path)
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    diff = mod.main(["--small", "--models", "16", "--workers", "4", "--simulate", "2x1GiB"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"max_param_diff={diff:.3e}"
    assert diff <= 1e-12  # same arithmetic on the CPU behind both simulated GPUs
    placement = dict(kv.split("=") for kv in next(
        line for line in out if line.startswith("placement:")).split()[1:])
    assert set(placement) == {"sim:0", "sim:1"} and sum(map(int, placement.values())) == 16
    steps = eval(next(line for line in out if line.startswith("steps per model:")).split(":", 1)[1])
    assert len(set(steps)) >= 4  # the models really converge at different speeds


def test_plan_takes_one_module_and_returns_its_placement():
    """``device_manager.plan(module)``, as the issue writes it, without a list."""
    dm = DeviceManager(simulate="2x1GiB")
    with torch.device("meta"):
        big = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096))
    room = [dm.available_bytes(d) for d in dm.accelerators]
    place = dm.plan(big)  # a Sequential is iterable, yet one item here
    assert place.item is big and str(place.device) == "sim:0"
    assert place.nbytes == dm.plan([big])[0].nbytes >= 2 * 4 * 2 * 4096 * 4097
    assert all(p.device.type == "meta" for p in big.parameters())  # nothing allocated
    assert [dm.available_bytes(d) for d in dm.accelerators] == room  # nothing reserved
    places = dm.plan(iter([big, 1 << 20]))  # iterators still give a list
    assert [str(p.device) for p in places] == ["sim:0", "sim:1"]


def test_simulated_devices_the_manager_lacks_are_refused_and_the_module_stays():
    dm = DeviceManager(simulate="2x1GiB")
    m = ManagedModule.from_module(nn.Linear(4, 2), manager=dm).to("sim:1")
    for name, problem in [("sim:7", "sim:7 is not managed here"), ("simx", "'simx' is not a device name")]:
        with pytest.raises(ValueError, match=rf"ManagedModule\.to\(device=.*{problem}"):
            m.to(name)
        with pytest.raises(ValueError, match=rf"ManagedModule\.pin\(device=.*{problem}"):
            m.pin(name)
    assert m.placement == "sim:1" and m.pinned is None
    assert all(t.placement == "sim:1" for t in m.parameters())


def test_from_module_refuses_a_manager_argument_that_is_no_manager_before_changing_it():
    net = nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"from_module\(manager='cpu'\): expected a DeviceManager"):
        ManagedModule.from_module(net, manager="cpu")
    assert type(net) is nn.Linear


def _used(dm):
    return [dm.get_device(f"sim:{i}").sim_used_bytes for i in range(2)]


def _nbytes(m):
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


def test_a_module_counts_on_the_simulated_gpu_it_is_on_and_nowhere_else():
    # nn.Module.to keeps the parameter objects, and each move counted them
    # again on the new device without giving back the old one: after a few
    # moves both GPUs looked nearly full and later work spilled to the CPU.
    import gc

    dm = DeviceManager(simulate="2x1MiB", reserved=0.0)
    m = ManagedModule.from_module(nn.BatchNorm1d(64), manager=dm)  # parameters and buffers
    n = _nbytes(m)
    for dev, expected in [("sim:0", [n, 0]), ("sim:1", [0, n]), ("sim:0", [n, 0]), ("sim:0", [n, 0]),
                          ("sim:1", [0, n]), ("cpu", [0, 0]), ("sim:1", [0, n])]:
        m.to(dev)
        assert _used(dm) == expected, dev
    m.double()  # the ledger follows the bytes
    assert _nbytes(m) == 2 * n - 8 and _used(dm) == [0, 2 * n - 8]  # num_batches_tracked stays int64
    m.to(managed(torch.ones(1), manager=dm).to("sim:0"))  # a tensor's placement and dtype
    assert m.placement == "sim:0" and m.weight.dtype == torch.float32 and _used(dm) == [n, 0]
    c = copy.deepcopy(m)
    assert _used(dm) == [2 * n, 0]
    m.cpu()
    assert _used(dm) == [n, 0]
    del c
    gc.collect()
    assert _used(dm) == [0, 0]
    assert dm.available_bytes(dm.get_device("sim:0")) == 1 << 20


def test_a_pinned_module_moved_and_unpinned_leaves_nothing_counted():
    dm = DeviceManager(simulate="2x1MiB", reserved=0.0)
    m = ManagedModule.from_module(nn.Linear(8, 8), manager=dm).pin("sim:1")
    assert _used(dm) == [0, _nbytes(m)]
    m.unpin()
    m.cuda("sim:0")
    assert _used(dm) == [_nbytes(m), 0]
    m.cpu()
    assert _used(dm) == [0, 0]


@pytest.mark.parametrize("read", ["attribute", "forward", "parameters"])
def test_tensors_registered_after_placement_join_the_module(read):
    # register_buffer and register_parameter after wrapping left plain CPU
    # tensors in a module placed on sim:1 (only assignment was seen).
    dm = DeviceManager(simulate="2x1MiB", reserved=0.0)
    m = ManagedModule.from_module(nn.Linear(2, 2).double(), manager=dm).to("sim:1").pin()
    m.register_buffer("scale", torch.full((2,), 2.0, dtype=torch.float64))
    m.register_parameter("shift", nn.Parameter(torch.ones(2, dtype=torch.float64)))
    m.add_module("head", nn.Linear(2, 1).double())
    if read == "forward":
        m(torch.ones(1, 2, dtype=torch.float64))
    elif read == "parameters":
        assert len(list(m.parameters())) == 5
    added = [m.scale, m.shift, m.head.weight, m.head.bias]
    assert all(type(t) is ManagedTensor and t.placement == "sim:1" for t in added)
    assert all(str(t.pinned) == "sim:1" and t.managed_device is dm.get_device("sim:1") for t in added)
    assert isinstance(m.shift, nn.Parameter) and m.shift.is_leaf
    assert {id(p) for p in m.parameters()} >= {id(m.shift), id(m.head.weight)}
    assert _used(dm) == [0, _nbytes(m)]
    assert set(m.state_dict()) == {"weight", "bias", "scale", "shift", "head.weight", "head.bias"}


def test_tied_weights_stay_one_parameter():
    lin = nn.Linear(3, 3, bias=False)
    net = nn.Sequential(lin, nn.Tanh(), nn.Linear(3, 3, bias=False))
    net[2].weight = lin.weight
    m = ManagedModule.from_module(net)
    assert m[0].weight is m[2].weight and len(list(m.parameters())) == 1


def test_a_buffer_registered_after_placement_is_used_on_the_module_device(env):
    dm, A, _B = env
    m = ManagedModule.from_module(nn.Linear(3, 3).double(), manager=dm).to(A)
    m.register_buffer("scale", torch.arange(3.0, dtype=torch.float64))
    m.register_parameter("shift", nn.Parameter(torch.ones(3, dtype=torch.float64)))
    assert m.scale.placement == A and m.shift.placement == A
    x = torch.ones(2, 3, dtype=torch.float64)
    out = m(x) * m.scale + m.shift
    assert out.placement == A
    ref = nn.Linear(3, 3).double()
    ref.load_state_dict({k: v for k, v in m.state_dict().items() if k in ("weight", "bias")})
    np.testing.assert_allclose(_np(out), _np(ref(x)) * np.arange(3.0) + 1.0, rtol=1e-14)
