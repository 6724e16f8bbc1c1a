"""solve_many on Ray: equal to the local backend, order kept, nodes share work, dead actors lose nothing.

One local Ray instance serves the module (2 CPUs, logical GPUs); "nodes" are
simulated by actors with their own ``MANAGED_SOLVE_SIMULATE`` inventory. The
first test runs before that instance exists, to check that a call with
``address=None`` starts its own instance and shuts it down.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import LinearSystem, Status, solve_many
from managed_solve import cluster as cl
from managed_solve.cluster import NodeSpec, solve_many_ray
from managed_solve.manager import DeviceManager
from managed_solve.scheduling import SolveManyError
from tests._problems import poisson2d
from tests._problems import poisson2d_skew as convection  # non-symmetric, positive definite

ray = pytest.importorskip("ray")


def mix(count: int, seed: int = 0) -> list:
    """SPD and non-symmetric systems of distinct sizes, random right-hand sides."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        m = int(rng.integers(3, 14))
        A = convection(m) if k % 4 == 3 else poisson2d(m)
        out.append((A, rng.standard_normal(m * m)))
    return out


def reference(A, b) -> np.ndarray:
    return spla.spsolve(A.tocsc(), b)


def assert_solved(pairs, results, rtol=1e-8):
    assert len(results) == len(pairs)
    for (A, b), r in zip(pairs, results, strict=True):
        assert r.status is Status.CONVERGED, r.message
        assert isinstance(r.x, np.ndarray) and r.x.shape == b.shape
        assert np.linalg.norm(A @ r.x - b) <= 10 * rtol * np.linalg.norm(b)
        x_ref = reference(A, b)
        assert np.linalg.norm(r.x - x_ref) <= 1e-5 * np.linalg.norm(x_ref)


def sim_nodes(counts=(1, 2, 3)) -> list[NodeSpec]:
    # num_cpus=0: three simulated nodes share the 2 CPUs of the test instance.
    return [NodeSpec(f"node{k}", weight=c, num_cpus=0,
                     env={"MANAGED_SOLVE_SIMULATE": f"{c}x256MiB"}) for k, c in enumerate(counts)]


# --------------------------------------------------------------------------- no Ray instance yet
def test_without_ray_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ModuleNotFoundError, match=r'pip install "managed-solve\[ray\]"'):
        solve_many_ray([(poisson2d(3), np.ones(9))])


def test_backend_ray_through_solve_many_without_ray(monkeypatch):
    import inspect

    if "backend" not in inspect.signature(solve_many).parameters:
        pytest.skip("solve_many has no backend= yet (the lead wires it to solve_many_ray)")
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ModuleNotFoundError, match=r"managed-solve\[ray\]"):
        solve_many([(poisson2d(3), np.ones(9))], backend="ray")


def test_arguments_checked_before_ray_starts():
    pairs = [(poisson2d(3), np.ones(9))]
    with pytest.raises(TypeError, match="manager="):
        solve_many_ray(pairs, manager=DeviceManager(["cpu"]))
    with pytest.raises(TypeError, match="unexpected argument"):
        solve_many_ray(pairs, tolerance=1e-3)
    with pytest.raises(ValueError, match="return_on='device'"):
        solve_many_ray(pairs, return_on="device")
    with pytest.raises(ValueError, match="num_nodes_hint"):
        solve_many_ray(pairs, num_nodes_hint=0)
    with pytest.raises(ValueError, match="method="):
        solve_many_ray(pairs, method="lu")
    assert not ray.is_initialized()


def grad_pairs(count: int, seed: int = 0) -> list:
    """mix()'s systems as ((crow, col, values), b) torch leaves that require grad."""
    torch = pytest.importorskip("torch")
    out = []
    for A, b in mix(count, seed):
        A = A.tocsr()
        A.sort_indices()
        out.append(((torch.tensor(A.indptr), torch.tensor(A.indices),
                     torch.tensor(A.data, requires_grad=True)),
                    torch.tensor(b, requires_grad=True)))
    return out


def test_results_left_in_the_object_store_cannot_take_gradients():
    with pytest.raises(ValueError, match=r"systems\[0\]'s A or b requires grad.*return_on='host'"):
        solve_many_ray(grad_pairs(2), return_on="refs")
    assert not ray.is_initialized()  # refused before any instance starts


def test_only_invalid_systems_need_no_cluster():
    res = solve_many_ray([(poisson2d(3), np.ones(4)), "not a system"])
    assert [r.status for r in res] == [Status.INVALID_INPUT] * 2
    assert "shape (9,)" in res[0].message and "LinearSystem or an (A, b) pair" in res[1].message
    assert not ray.is_initialized()


def test_address_none_starts_a_local_instance_and_shuts_it_down():
    assert not ray.is_initialized()
    pairs = mix(6, seed=5)
    res = solve_many_ray(pairs)
    assert_solved(pairs, res)
    assert not ray.is_initialized()
    x = res[0].x
    x[0] += 1.0  # a private writable copy, valid after the instance is gone


# --------------------------------------------------------------------------- one instance for the rest
@pytest.fixture(scope="module")
def cluster():
    from managed_solve._backend import cuda_probe

    GPU_COUNT = cuda_probe()[0]

    # Logical GPUs on a machine without one: Ray only counts them (weights,
    # num_gpus requests); with real GPUs Ray's GPU ids must name real devices.
    ray.init(num_cpus=2, num_gpus=GPU_COUNT or 2, include_dashboard=False,
             log_to_driver=False, logging_level="WARNING")
    yield ray
    ray.shutdown()
    assert not ray.is_initialized()


def test_discovered_node_requests_its_gpus(cluster):
    (spec,) = cl.discover_nodes(cluster)
    total = cluster.cluster_resources()
    assert spec.num_gpus == total["GPU"] and spec.weight == total["GPU"]
    assert spec.node_id == cluster.get_runtime_context().get_node_id()


def test_equals_the_local_backend_on_a_mix(cluster):
    pairs = mix(24, seed=1)
    systems = list(pairs)
    systems[5] = LinearSystem(*pairs[5], rtol=1e-10, name="tight")
    systems[6] = LinearSystem(pairs[6][0].astype(np.float32), pairs[6][1].astype(np.float32), rtol=1e-4)
    systems[7] = LinearSystem(*pairs[7], method="cg", maxiter=2)  # stops at MAXITER
    local = solve_many(systems, return_on="host", manager=DeviceManager(["cpu"]))
    remote = solve_many_ray(systems, devices="cpu")  # the same device on the nodes, on any machine
    assert len(remote) == len(local)
    for i, (r, q) in enumerate(zip(remote, local, strict=True)):
        assert r.status is q.status, i
        assert r.x.dtype == q.x.dtype and r.x.shape == q.x.shape
        scale = np.linalg.norm(q.x)
        assert np.linalg.norm(r.x - q.x) <= (1e-3 if q.x.dtype == np.float32 else 1e-9) * scale, i
        assert r.iterations == q.iterations and r.method == q.method and r.name == q.name
        assert r.info["node"] and r.info["attempt"] == 1
    assert local[7].status is Status.MAXITER
    ok = [k for k in range(24) if k not in (6, 7)]
    assert_solved([pairs[k] for k in ok], [remote[k] for k in ok])


def test_simulated_nodes_share_the_work_in_input_order(cluster):
    pairs = mix(60, seed=2)
    events = []
    res = solve_many_ray(pairs, nodes=sim_nodes(), on_chunk=events.append)
    assert_solved(pairs, res)
    by_node = {r.info["node"] for r in res}
    assert by_node == {"node0", "node1", "node2"}
    for r in res:  # each node solved on its own simulated GPUs
        k = int(r.info["node"][-1])
        assert r.device in {f"sim:{j}" for j in range(k + 1)}
    # every valid system was delivered exactly once, by the node its result names
    seen = [i for e in events for i in e.indices]
    assert sorted(seen) == list(range(60))
    for e in events:
        assert all(res[i].info["node"] == e.node for i in e.indices)


def test_return_on_refs_leaves_x_in_the_object_store(cluster):
    pairs = mix(8, seed=3)
    # one x above Ray's 100 KiB inline limit: it lives in the node's object store and must
    # outlive the actor that made it (the actors are gone when the call returns)
    pairs.append((poisson2d(120), np.ones(120 * 120)))
    res = solve_many_ray(pairs, return_on="refs", nodes=sim_nodes((1, 1)))
    assert all(isinstance(r.x, ray.ObjectRef) for r in res)
    xs = ray.get([r.x for r in res])
    for (A, b), x in zip(pairs, xs, strict=True):
        np.testing.assert_allclose(x, reference(A, b), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("no_restart", [True, False], ids=["killed", "restarted"])
def test_an_actor_killed_mid_run_loses_and_duplicates_nothing(cluster, no_restart):
    pairs = mix(48, seed=4)
    events, killed = [], []

    def kill_first(e):
        events.append(e)
        if not killed:
            killed.append(e.node)
            ray.kill(e.actor, no_restart=no_restart)

    res = solve_many_ray(pairs, nodes=sim_nodes((1, 1)), on_chunk=kill_first)
    assert_solved(pairs, res)
    seen = [i for e in events for i in e.indices]
    assert sorted(seen) == list(range(48))  # each system delivered once
    if no_restart:
        # the killed actor's queued chunks went to the other node, as second attempts
        retried = [r for r in res if r.info["attempt"] > 1]
        assert retried and all(r.info["node"] != killed[0] for r in retried)
        # (a chunk the killed actor had already finished may still be reported after
        # the kill: only retries are kept off the dead node, and nothing is duplicated)
    else:  # Ray restarted the actor and re-ran its calls there
        assert any(e.node == killed[0] for e in events[1:])


def test_invalid_systems_come_back_invalid_and_are_never_shipped(cluster):
    pairs = mix(10, seed=6)
    bad_A = poisson2d(3).tolil()
    bad_A[0, 0] = np.nan
    inputs = list(pairs)
    inputs[1] = (poisson2d(3), np.ones(5))
    inputs[4] = (bad_A.tocsr(), np.ones(9))
    inputs[8] = (sp.random(4, 5, density=0.5, format="csr"), np.ones(4))
    events = []
    res = solve_many_ray(inputs, nodes=sim_nodes((1,)), on_chunk=events.append)
    bad = {1: "shape (9,)", 4: "NaN", 8: "square"}
    for i, r in enumerate(res):
        if i in bad:
            assert r.status is Status.INVALID_INPUT and bad[i] in r.message and r.x is None
        else:
            assert_solved([pairs[i]], [r])
    assert sorted(i for e in events for i in e.indices) == [i for i in range(10) if i not in bad]
    with pytest.raises(SolveManyError) as err:
        solve_many_ray(inputs, nodes=sim_nodes((1,)), on_error="raise")
    assert err.value.failed == [1, 4, 8]


def test_overrides_apply_on_the_driver(cluster, capsys):
    pairs = mix(4, seed=7)
    res = solve_many_ray(pairs, method="bicgstab", rtol=1e-6, nodes=sim_nodes((1,)), progress=True)
    assert "4/4" in capsys.readouterr().err
    for (A, b), r in zip(pairs, res, strict=True):
        assert r.method == "bicgstab" and r.converged
        assert np.linalg.norm(A @ r.x - b) <= 10 * 1e-6 * np.linalg.norm(b)


@pytest.mark.parametrize("where", [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_systems_on_a_gpu_travel_to_a_gpu_node(cluster, where):
    cp = pytest.importorskip("cupy")
    import cupyx.scipy.sparse as csp

    pairs = mix(6, seed=8)
    systems = [LinearSystem(csp.csr_matrix(A), cp.asarray(b)) for A, b in pairs]
    node = NodeSpec("gpu", weight=1, num_gpus=1, num_cpus=0)
    res = solve_many_ray(systems, nodes=[node])
    assert_solved(pairs, res)
    assert all(r.device.startswith("cuda:") for r in res)


# --------------------------------------------------------------------------- the split, without Ray
class _FakeActor(cl._Actor):
    def __init__(self, weight, rate=None):
        super().__init__(NodeSpec(f"w{weight}", weight=weight), handle=None)
        self.rate = rate


def test_chunks_follow_weights_then_measured_throughput():
    systems = {i: LinearSystem(poisson2d(4), np.ones(16)) for i in range(400)}
    a1, a3 = _FakeActor(1), _FakeActor(3)
    d = cl._Dispatcher(None, [a1, a3], systems, [None] * 400, return_on="host", max_attempts=3,
                       on_chunk=None, bar=None)
    big = d._new_chunk(a3)
    small = d._new_chunk(a1)
    # first chunks: half of what is left times the weight share (3/4, then 1/4)
    assert len(big.indices) == 150
    assert len(small.indices) == round(0.5 * 250 / 4)
    assert big.indices == list(range(150))  # input order, no gaps
    # a measured rate replaces the weight: a1 measured 9x faster per weight than a3's guess
    a1.rate = 9.0 * cl._cost(systems[0])
    a3.rate = 1.0 * cl._cost(systems[0])
    share = cl._shares([a1, a3])
    assert share[id(a1)] == pytest.approx(0.9)
    # a dead actor's share goes to the living
    a3.alive = False
    assert cl._shares([a1, a3]) == {id(a1): 1.0}


def test_a_node_that_cannot_start_is_left_out(cluster):
    pairs = mix(6, seed=9)
    greedy = NodeSpec("greedy", weight=99, num_gpus=99, num_cpus=0)  # no node has 99 GPUs
    # node0 starts a new Ray worker: seconds on a loaded machine, so a wide window
    # (the greedy node never starts, so the call always waits all of it).
    res = solve_many_ray(pairs, nodes=[greedy, *sim_nodes((1,))], start_timeout=45)
    assert_solved(pairs, res)
    assert {r.info["node"] for r in res} == {"node0"}
    with pytest.raises(RuntimeError, match="none of the 1 Ray actors started"):
        solve_many_ray(pairs, nodes=[greedy], start_timeout=1)


def test_kept_actors_are_reused_then_released(cluster):
    pairs = mix(4, seed=10)
    first, second = [], []
    assert_solved(pairs, solve_many_ray(pairs, nodes=sim_nodes((1,)), keep_actors=True,
                                        on_chunk=first.append))
    assert len(cl._POOL) == 1
    assert_solved(pairs, solve_many_ray(pairs, nodes=sim_nodes((1,)), keep_actors=True,
                                        on_chunk=second.append))
    assert {e.actor._actor_id for e in first} == {e.actor._actor_id for e in second}
    assert cl.release_actors() == 1 and not cl._POOL


def test_backend_ray_through_solve_many_equals_local(cluster):
    import inspect

    if "backend" not in inspect.signature(solve_many).parameters:
        pytest.skip("solve_many has no backend= yet (the lead wires it to solve_many_ray)")
    pairs = mix(6, seed=11)
    local = solve_many(pairs, return_on="host", manager=DeviceManager(["cpu"]))
    remote = solve_many(pairs, backend="ray", devices="cpu")  # the same device on the nodes
    for r, q in zip(remote, local, strict=True):
        assert r.status is q.status and isinstance(r.x, np.ndarray)
        np.testing.assert_allclose(r.x, q.x, rtol=1e-9, atol=1e-12)


def test_gradients_through_the_ray_backend_equal_the_local_ones(cluster, monkeypatch):
    pairs = grad_pairs(5, seed=3)
    local = grad_pairs(5, seed=3)
    calls = []
    real = cl.solve_many_ray
    monkeypatch.setattr(cl, "solve_many_ray",
                        lambda systems, **kw: calls.append(len(systems)) or real(systems, **kw))
    remote = solve_many(pairs, backend="ray", devices="cpu", rtol=1e-12)
    here = solve_many(local, manager=DeviceManager(["cpu"]), rtol=1e-12)
    xs = [r.to_torch() for r in remote]
    assert all(x.grad_fn is not None for x in xs)
    sum((x ** 2).sum() for x in xs).backward()
    sum((r.to_torch() ** 2).sum() for r in here).backward()
    assert calls == [5, 5]  # the forward, then every adjoint in one more call
    for (A, b), (A2, b2) in zip(pairs, local, strict=True):
        np.testing.assert_allclose(A[2].grad.numpy(), A2[2].grad.numpy(), rtol=1e-8, atol=1e-12)
        np.testing.assert_allclose(b.grad.numpy(), b2.grad.numpy(), rtol=1e-8, atol=1e-12)


def test_a_retried_chunk_prefers_an_actor_it_has_not_failed_on():
    systems = {i: LinearSystem(poisson2d(3), np.ones(9)) for i in range(4)}
    a1, a2, a3 = _FakeActor(1), _FakeActor(1), _FakeActor(1)
    d = cl._Dispatcher(None, [a1, a2, a3], systems, [None] * 4, return_on="host", max_attempts=5,
                       on_chunk=None, bar=None)
    c = cl._Chunk([0, 1], 2.0, attempt=1, failed_on={id(a1)})
    d.retry.append(c)
    assert d._retry_for(a1) is None and d._retry_for(a2) is c
    c.failed_on |= {id(a2)}
    d.retry.append(c)
    a3.alive = False  # failed on every live actor: any of them may try again
    assert d._retry_for(a1) is c
    # past max_attempts the systems come back as DEVICE_ERROR, once each
    c.attempt = 5
    d._again(c, a1, "boom")
    assert [r.status for r in d.results[:2]] == [Status.DEVICE_ERROR] * 2
    assert "boom" in d.results[0].message and d.results[2] is None


class _FakeRay:
    """Just enough of Ray for the dispatcher: one actor answers at once, the other never."""

    class exceptions:  # noqa: N801 - Ray's namespace
        class RayError(Exception):
            pass

        class RayActorError(RayError):
            pass

        class ObjectLostError(RayError):
            pass

    def __init__(self):
        self.values, self.ready = {}, set()
        self.lost = set()

    def put(self, value):
        ref = object()
        self.values[ref] = value
        self.ready.add(ref)
        return ref

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r in self.ready][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref, timeout=None):
        if isinstance(ref, list):
            return [self.get(r) for r in ref]
        if ref in self.lost:
            raise self.exceptions.ObjectLostError("lost")
        return self.values[ref]


class _FakeHandle:
    def __init__(self, ray, hangs=False, lose_first=False):
        self.ray, self.hangs, self.lose_first = ray, hangs, lose_first
        handle = self

        class _Method:
            def options(self, num_returns):
                return self

            def remote(self, payload_ref):
                return handle.run(payload_ref)

        self.solve_chunk = _Method()

    def run(self, payload_ref):
        payloads = self.ray.values[payload_ref]
        meta, xs = {"results": [], "seconds": 0.01}, []
        for p in payloads:
            s = cl._from_payload(p)
            x = np.linalg.solve(s.A.toarray(), s.b)
            meta["results"].append({"status": "CONVERGED", "iterations": 1, "residual_norm": 0.0,
                                    "b_norm": 1.0, "device": "cpu", "seconds": 0.0,
                                    "method": "direct", "message": "", "name": s.name,
                                    "info": {}})
            xs.append(x)
        refs = [object() for _ in range(1 + len(xs))]
        for r, v in zip(refs, [meta, *xs], strict=True):
            self.ray.values[r] = v
            if not self.hangs:
                self.ray.ready.add(r)
        if self.lose_first:
            self.lose_first = False
            self.ray.lost.add(refs[1])  # the first solution's object is lost
        return refs


def test_a_hung_actor_does_not_block_the_call_and_a_lost_object_retries_its_chunk(settings):
    settings(ray_chunk_timeout=0.3)
    ray = _FakeRay()
    systems = {i: LinearSystem(poisson2d(3), np.full(9, float(i + 1)), name=f"s{i}")
               for i in range(12)}
    hung = cl._Actor(NodeSpec("hung", weight=1), _FakeHandle(ray, hangs=True))
    good = cl._Actor(NodeSpec("good", weight=1), _FakeHandle(ray, lose_first=True))
    results = [None] * 12
    d = cl._Dispatcher(ray, [hung, good], systems, results, return_on="host", max_attempts=4,
                       on_chunk=None, bar=None)
    d.run()
    assert all(r is not None and r.status is Status.CONVERGED for r in results)
    assert [r.name for r in results] == [f"s{i}" for i in range(12)]
    assert not hung.alive
    for i, r in enumerate(results):
        np.testing.assert_allclose(poisson2d(3) @ r.x, np.full(9, float(i + 1)))
