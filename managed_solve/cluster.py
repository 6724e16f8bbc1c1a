"""The Ray backend of ``solve_many``: the same call over the nodes of a Ray cluster.

One actor per node (:class:`_NodeSolver`) holds that node's GPUs and runs the
local scheduler with its own :class:`~managed_solve.manager.DeviceManager`
there. The driver validates every system once, ships host arrays (CSR
components, never device arrays) through the object store in chunks, and
hands chunks out by pulling: each actor keeps two chunks in flight (one
computing, the next already shipped), and the size of the next chunk follows
the actor's share of the cluster (its GPUs, or CPUs on a GPU-less node, until
its measured throughput replaces that guess) times half of what is left, so
chunks shrink towards the end and a fast node simply asks more often
(guided self-scheduling with weights).

A chunk whose actor dies goes back to the front of the queue and runs on
another actor (or on the same one once Ray restarted it); results are keyed
by input position and the first one delivered wins, so nothing is lost or
duplicated.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _backend, autograd, config
from .result import SolveResult, Status
from .scheduling import SolveManyError, adjoint
from .scheduling import solve_many as solve_many_local
from .scheduling.validate import check_arguments, invalid_result, validate_all
from .system import LinearSystem

log = logging.getLogger("managed_solve")

RETURN_ON = ("host", "refs")

# Chunks kept in flight per actor: one computing, one already shipped, so the
# node never waits for the driver between chunks.
IN_FLIGHT = 2

# A first guess of how many host cores one GPU is worth for solve_many work,
# used only to weigh GPU-less nodes in a cluster that has GPU nodes too, until
# measured throughput replaces it. On W2 a GPU runs tens of times faster than
# one host core; with imperfect scaling of sparse LU over many cores, a node of
# this many cores counts as about one GPU. A coarse guess suffices: the first
# chunk's measured rate replaces it.
CORES_PER_GPU = 32

# Seconds to wait for a failed actor to answer a ping (Ray restarting it)
# before its work goes elsewhere for good.
RESTART_WAIT_S = 60.0

# Local keyword arguments forwarded to the scheduler on each node.
_NODE_KWARGS = ("disperse", "devices")
_DRIVER_KWARGS = ("method", "M", "rtol", "progress", "on_error")


@dataclass(frozen=True)
class NodeSpec:
    """One Ray actor to start: where, with what resources, and its share of work.

    Parameters
    ----------
    name : str
        Shown in each result's ``info["node"]``.
    weight : float
        Initial share of the work (GPUs, or CPUs on a GPU-less node); measured
        throughput replaces it after the actor's first chunk.
    num_gpus, num_cpus : float
        Ray resources the actor requests (``num_gpus`` = the node's GPUs, so
        Ray sets ``CUDA_VISIBLE_DEVICES`` for the actor and nothing else of
        ours competes for them).
    node_id : str, optional
        Ray node ID the actor is pinned to (hard node affinity); None lets Ray
        place it.
    env : dict, optional
        Environment variables of the actor process (``runtime_env``), e.g.
        ``{"MANAGED_SOLVE_SIMULATE": "2x1GiB"}`` to simulate a node's GPUs.

    Examples
    --------
    >>> NodeSpec("gpu-node-1", weight=8, num_gpus=8).weight
    8
    """

    name: str
    weight: float = 1.0
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    node_id: str | None = None
    env: dict = field(default_factory=dict)


@dataclass
class ChunkEvent:
    """What ``on_chunk`` receives on the driver after each chunk came back.

    ``actor`` is the Ray actor handle that solved it (tests kill it from here),
    ``indices`` the input positions, ``seconds`` the time the node spent in its
    local scheduler, ``attempt`` 1 for a first try.
    """

    node: str
    actor: Any
    indices: list[int]
    seconds: float
    attempt: int


# --------------------------------------------------------------------------- the node side
class _NodeSolver:
    """The actor on one node: the local scheduler and a DeviceManager of that node's devices."""

    def __init__(self, name: str, node_kwargs: dict):
        from .manager import DeviceManager

        self.name = name
        self.node_kwargs = dict(node_kwargs)
        self.manager = DeviceManager()  # discovers this node's GPUs (or MANAGED_SOLVE_SIMULATE)

    def ping(self) -> dict:
        return {"node": self.name, "host": socket.gethostname(), "pid": os.getpid(),
                "devices": [str(d) for d in self.manager.devices]}

    def solve_chunk(self, payloads: list[dict]) -> tuple:
        t0 = time.perf_counter()
        systems = [_from_payload(p) for p in payloads]
        res = solve_many_local(systems, method="auto", M=None, rtol=None, progress=False,
                         return_on="host", on_error="return", manager=self.manager,
                         **self.node_kwargs)
        seconds = time.perf_counter() - t0
        meta = [{"status": r.status.name, "iterations": int(r.iterations),
                 "residual_norm": float(r.residual_norm), "b_norm": float(r.b_norm),
                 "device": r.device, "seconds": float(r.seconds), "method": r.method,
                 "message": r.message, "name": r.name, "info": {**r.info, "node": self.name}}
                for r in res]
        # One return value per x: each becomes its own object, owned by the
        # driver, kept in this node's object store until fetched.
        return ({"seconds": seconds, "results": meta, "pid": os.getpid()},
                *[r.x for r in res])


def _payload(s: LinearSystem) -> dict:
    """Host arrays and options of a validated system: what travels to a node."""
    if s.device != "cpu":
        s = s.to("cpu")  # sync: one device -> host copy per system, on the driver
    # The null space as validated: its orthonormal basis, already checked against A.
    N = None if s.nullspace is None else np.ascontiguousarray(s.nullspace)
    p = {"b": np.ascontiguousarray(s.b), "x0": s.x0, "rtol": s.rtol, "atol": s.atol,
         "maxiter": s.maxiter, "method": s.method, "M": s.M, "name": s.name,
         "dtype": str(s.dtype), "kind": s.kind, "nullspace": N}
    if s.kind == "csr":
        p.update(shape=s.A.shape, indptr=s.A.indptr, indices=s.A.indices, data=s.A.data,
                 sorted=bool(s.A.has_sorted_indices))
    else:  # dense arrays travel as arrays; operators through Ray's cloudpickle
        p["A"] = s.A
    return p


def _from_payload(p: dict) -> LinearSystem:
    """The node-side LinearSystem; arrays are read-only views into the object store."""
    if p["kind"] == "csr":
        import scipy.sparse as sp

        A = sp.csr_matrix((p["data"], p["indices"], p["indptr"]), shape=p["shape"], copy=False)
        # Validated on the driver already: canonical, so nothing writes into the views.
        A.has_sorted_indices = p["sorted"]
    else:
        A = p["A"]
    s = LinearSystem(A, p["b"], x0=p["x0"], rtol=p["rtol"], atol=p["atol"],
                     maxiter=p["maxiter"], method=p["method"], M=p["M"], name=p["name"],
                     dtype=p["dtype"], check_finite=False)
    # The basis the driver checked against A, as it is (not orthonormalised or checked again).
    return s if p["nullspace"] is None else s.replaced(nullspace=p["nullspace"])


# --------------------------------------------------------------------------- the driver side
def discover_nodes(ray: Any, *, max_nodes: int | None = None) -> list[NodeSpec]:
    """One :class:`NodeSpec` per alive Ray node, most GPUs first.

    A node's weight is its GPU count; a GPU-less node counts its CPUs (divided
    by ``CORES_PER_GPU`` when the cluster also has GPU nodes).
    """
    alive = [n for n in ray.nodes() if n.get("Alive")]
    any_gpu = any(n["Resources"].get("GPU", 0) > 0 for n in alive)
    specs = []
    for n in alive:
        res = n["Resources"]
        gpus = float(res.get("GPU", 0))
        cpus = float(res.get("CPU", 0))
        if gpus == 0 and cpus == 0:
            continue  # a node without compute resources (e.g. a head with num_cpus=0)
        weight = gpus if gpus > 0 else (max(cpus / CORES_PER_GPU, 0.1) if any_gpu else cpus)
        specs.append(NodeSpec(name=n.get("NodeManagerHostname") or n["NodeID"][:8], weight=weight,
                              num_gpus=gpus, num_cpus=min(1.0, cpus), node_id=n["NodeID"]))
    specs.sort(key=lambda s: -s.weight)
    return specs[:max_nodes] if max_nodes else specs


def _connect(ray: Any, address: str | None, return_on: str) -> bool:
    """Connect to (or start) Ray; True when this call started the instance."""
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
        if return_on == "refs":
            log.warning("solve_many(backend='ray', return_on='refs'): the local Ray instance "
                        "started for this call stays up so the references stay valid; call "
                        "ray.shutdown() when done with them")
            return False
        return True
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    return False


class _Actor:
    """Driver-side state of one node's actor."""

    def __init__(self, spec: NodeSpec, handle: Any):
        self.spec, self.handle = spec, handle
        self.alive = True
        self.in_flight = 0
        self.rate: float | None = None  # measured cost units per second
        self.done_cost = 0.0


@dataclass
class _Chunk:
    indices: list[int]
    cost: float
    ref: Any = None  # ObjectRef of the payload list (put once, reused by retries)
    attempt: int = 0
    failed_on: set = field(default_factory=set)
    sent_at: float = 0.0  # time.monotonic() of the latest submission


def _cost(s: LinearSystem) -> float:
    """Work units of one system for splitting: nnz + n, about one SpMV plus vector work."""
    return float(s.nnz + s.n)


def _shares(actors: Sequence[_Actor]) -> dict[int, float]:
    """Each live actor's fraction of the cluster's throughput (measured where known)."""
    live = [a for a in actors if a.alive]
    measured = [a for a in live if a.rate]
    per_weight = (sum(a.rate / a.spec.weight for a in measured) / len(measured)) if measured else 1.0
    rate = {id(a): (a.rate if a.rate else a.spec.weight * per_weight) for a in live}
    total = sum(rate.values()) or 1.0
    return {k: v / total for k, v in rate.items()}


def solve_many_ray(systems: Iterable[Any], *, address: str | None = None, return_on: str = "host",
                   num_nodes_hint: int | None = None, nodes: Sequence[NodeSpec] | None = None,
                   max_restarts: int = 1, max_task_retries: int = 1, max_attempts: int = 3,
                   start_timeout: float = 120.0, keep_actors: bool = False,
                   on_chunk: Callable[[ChunkEvent], None] | None = None,
                   **local_kwargs: Any) -> list[SolveResult]:
    """Solve many independent systems over the nodes of a Ray cluster.

    The Ray backend of :func:`managed_solve.solve_many` (``backend="ray"``):
    one actor per node runs the local scheduler there; work is split across
    nodes in proportion to their GPUs and refined by measured throughput.

    Parameters
    ----------
    systems : iterable of LinearSystem or (A, b) pairs
        As for ``solve_many``. Systems on a GPU are copied to the host once, on
        the driver; invalid ones come back as ``INVALID_INPUT`` and are never shipped.
    address : str, optional
        ``None``: use the Ray instance this process is connected to, else start
        a local one and shut it down afterwards. ``"auto"`` (on a cluster node)
        or ``"ray://head:10001"`` (from outside) connects to a running cluster.
        Ignored when this process is already connected to Ray.
    return_on : {"host", "refs"}
        ``"host"``: each ``x`` is a NumPy array. ``"refs"``: each ``x`` is a
        ``ray.ObjectRef`` left in the object store of the node that solved it
        (``ray.get(result.x)`` fetches it).
    num_nodes_hint : int, optional
        Use at most this many nodes (those with most GPUs first); default all.
    nodes : list of NodeSpec, optional
        The actors to start, instead of one per alive node (simulated nodes in
        tests, or a hand-picked subset).
    max_restarts, max_task_retries : int
        Ray restarts of a dead actor and Ray's own retries of its calls.
    start_timeout : float
        Seconds to wait for the actors to start; one that cannot be placed by
        then (its node lacks the resources asked for) is left out, and the
        call fails only when none started.
    keep_actors : bool
        Leave the actors running after the call, for the next call in this
        process with the same nodes and node arguments to reuse (no start-up,
        warm caches; ``benchmarks/bench_ray.py`` times both). They keep their
        GPUs reserved in Ray until :func:`release_actors` or ``ray.shutdown()``.
    max_attempts : int
        Tries of one chunk (on different actors where possible) before its
        systems come back as ``DEVICE_ERROR`` results.
    on_chunk : callable, optional
        Called on the driver with a :class:`ChunkEvent` after each chunk.
    **local_kwargs
        ``method``, ``M``, ``rtol``, ``on_error``, ``progress`` act on the
        driver as in ``solve_many``; ``disperse`` and ``devices`` go to each
        node's local scheduler (``devices`` names that node's devices).

    Returns
    -------
    list of SolveResult
        In input order; ``info["node"]`` names the node that solved each one.
        Where A's values or b require grad, ``to_torch()`` is attached to
        autograd (``return_on="host"`` only); backward solves the adjoints
        with one more call over the cluster, with the same options.

    Raises
    ------
    ModuleNotFoundError
        Ray is not installed (``pip install "managed-solve[ray]"``).
    TypeError, ValueError
        For unknown or invalid arguments (names the argument and the fix).

    See Also
    --------
    managed_solve.solve_many : the same call on one machine.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> A = sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(50, 50), format="csr")
    >>> res = solve_many_ray([(A, np.ones(50))])  # doctest: +SKIP
    >>> bool(np.allclose(A @ res[0].x, 1.0))  # doctest: +SKIP
    True
    """
    call = "solve_many(backend='ray')"
    unknown = set(local_kwargs) - set(_NODE_KWARGS) - set(_DRIVER_KWARGS)
    if "manager" in unknown:
        raise TypeError(f"{call}: manager= cannot travel to other nodes; each node's actor makes "
                        "its own DeviceManager. Drop manager=, or use backend='local'.")
    if unknown:
        raise TypeError(f"{call}: unexpected argument(s) {sorted(unknown)}; accepted: "
                        f"{', '.join(_NODE_KWARGS + _DRIVER_KWARGS)}")
    if return_on not in RETURN_ON:
        raise ValueError(f"{call}(return_on={return_on!r}): expected 'host' (NumPy arrays) or "
                         "'refs' (ray.ObjectRef left on the node that solved it)")
    if num_nodes_hint is not None and (int(num_nodes_hint) != num_nodes_hint or num_nodes_hint < 1):
        raise ValueError(f"{call}(num_nodes_hint={num_nodes_hint!r}): expected a positive integer or None")
    if max_attempts < 1:
        raise ValueError(f"{call}(max_attempts={max_attempts!r}): expected at least 1")
    method = local_kwargs.get("method", "auto")
    M = local_kwargs.get("M")
    rtol = local_kwargs.get("rtol")
    progress = local_kwargs.get("progress", False)
    on_error = local_kwargs.get("on_error", "return")
    check_arguments(method, M, rtol, "host", on_error, progress)
    node_kwargs = {k: local_kwargs[k] for k in _NODE_KWARGS if k in local_kwargs}

    ray = _backend.require("ray", call)

    # 1. Validate on the driver; bad systems never travel.
    items = list(systems)
    results, valid = validate_all(items, method=method, M=M, rtol=rtol)
    grads = autograd.recording() and any(s.grad is not None for s in valid.values())
    if grads and return_on == "refs":
        first = next(i for i, s in valid.items() if s.grad is not None)
        raise ValueError(f"{call}(return_on='refs'): systems[{first}]'s A or b requires grad, and "
                         "a solution left in the object store cannot join the autograd graph; "
                         "use return_on='host', or detach the inputs (torch.no_grad()).")
    for i, s in list(valid.items()):
        for what, obj in (("A", s.A if s.kind == "operator" else None),
                          ("M", s.M if not isinstance(s.M, str) else None)):
            if obj is None:
                continue
            try:
                ray.cloudpickle.dumps(obj)
            except Exception as exc:
                del valid[i]
                results[i] = invalid_result(TypeError(
                    f"{call}: systems[{i}].{what} is an operator that cannot be pickled for "
                    f"another node ({type(exc).__name__}: {exc}); pass a sparse matrix or use "
                    "backend='local'"), i, s)
                break

    bar = None
    if progress:
        tqdm = _backend.require("tqdm", "solve_many(progress=True)")
        bar = tqdm.tqdm(total=len(items), unit="system", desc="solve_many[ray]", smoothing=0.1)
        bar.update(len(items) - len(valid))

    started = False
    actors: list[_Actor] = []
    try:
        if valid:
            started = _connect(ray, address, return_on)
            specs = list(nodes) if nodes is not None else discover_nodes(ray, max_nodes=num_nodes_hint)
            if nodes is not None and num_nodes_hint:
                specs = specs[:num_nodes_hint]
            if not specs:
                raise RuntimeError(f"{call}: the Ray cluster has no alive node with CPUs or GPUs "
                                   f"({len(ray.nodes())} nodes known); start one with `ray start`")
            opts = (max_restarts, max_task_retries)
            actors = [_Actor(sp_, _acquire(ray, sp_, node_kwargs, opts)) for sp_ in specs]
            _await_start(ray, actors, start_timeout, call)
            _Dispatcher(ray, actors, valid, results, return_on=return_on,
                        max_attempts=max_attempts, on_chunk=on_chunk, bar=bar).run()
    finally:
        for a in actors:
            key = _pool_key(ray, a.spec, node_kwargs, (max_restarts, max_task_retries))
            if keep_actors and a.alive and not started:
                _POOL[key] = a.handle
                continue
            _POOL.pop(key, None)
            try:
                ray.kill(a.handle, no_restart=True)
            except Exception:  # already dead: nothing to release
                pass
        if bar is not None:
            bar.close()
        if started:
            ray.shutdown()

    missing = [i for i, r in enumerate(results) if r is None]
    if missing:  # every path delivers; this guards the promise "nothing lost"
        raise RuntimeError(f"{call}: internal error, no result for systems {missing[:10]}")
    out: list[SolveResult] = results  # type: ignore[assignment]
    if grads:
        # Attached as by the local backend; backward solves the adjoints with
        # one more call over the cluster (nothing of the forward stays on the
        # nodes), with the same nodes and options.
        again = dict(address=address, num_nodes_hint=num_nodes_hint, nodes=nodes,
                     max_restarts=max_restarts, max_task_retries=max_task_retries,
                     max_attempts=max_attempts, start_timeout=start_timeout,
                     keep_actors=keep_actors, **node_kwargs)
        adjoint.attach(out, [valid.get(i) for i in range(len(items))], None,
                       lambda adjoints: solve_many_ray(adjoints, **again))
    if on_error == "raise":
        failed = [i for i, r in enumerate(out) if not r.converged]
        if failed:
            lines = [f"systems[{i}] ({out[i].name or 'unnamed'}): {out[i].status.name}: "
                     f"{out[i].message or out[i].status.message}" for i in failed[:20]]
            raise SolveManyError(
                f"{call}: {len(failed)} of {len(out)} systems did not converge:\n"
                + "\n".join(lines) + "\nPass on_error='return' to get them back with their "
                "status instead.", out, failed)
    return out


# Actors kept by keep_actors=True, by (Ray job, node spec, node arguments, restart options).
_POOL: dict[tuple, Any] = {}


def _pool_key(ray: Any, spec: NodeSpec, node_kwargs: dict, opts: tuple) -> tuple:
    job = ray.get_runtime_context().get_job_id()  # changes after ray.shutdown() + init
    return (job, spec.name, spec.weight, spec.num_gpus, spec.num_cpus, spec.node_id,
            tuple(sorted(spec.env.items())), repr(sorted(node_kwargs.items())), opts)


def _acquire(ray: Any, spec: NodeSpec, node_kwargs: dict, opts: tuple) -> Any:
    """A kept actor for this node when it still answers, else a new one."""
    handle = _POOL.pop(_pool_key(ray, spec, node_kwargs, opts), None)
    if handle is not None:
        try:
            ray.get(handle.ping.remote(), timeout=10)
            return handle
        except Exception:  # died since the last call: start a fresh one
            pass
    return _start_actor(ray, spec, node_kwargs, *opts)


def release_actors() -> int:
    """Stop the actors kept by ``keep_actors=True``; returns how many there were.

    Examples
    --------
    >>> release_actors()
    0
    """
    n = len(_POOL)
    if n:
        ray = _backend.require("ray", "release_actors()")
        for handle in _POOL.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone with its cluster
                pass
    _POOL.clear()
    return n


def _start_actor(ray: Any, spec: NodeSpec, node_kwargs: dict, max_restarts: int,
                 max_task_retries: int) -> Any:
    opts: dict[str, Any] = {"num_gpus": spec.num_gpus, "num_cpus": spec.num_cpus,
                            "max_restarts": max_restarts, "max_task_retries": max_task_retries}
    if spec.node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(spec.node_id, soft=False)
    if spec.env:
        opts["runtime_env"] = {"env_vars": {k: str(v) for k, v in spec.env.items()}}
    return ray.remote(_NodeSolver).options(**opts).remote(spec.name, node_kwargs)


def _await_start(ray: Any, actors: list[_Actor], timeout: float, call: str) -> None:
    """Wait until each actor answers a ping; leave out those that cannot start."""
    pings = {a.handle.ping.remote(): a for a in actors}
    ready, late = ray.wait(list(pings), num_returns=len(pings), timeout=timeout)
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayError as exc:
            pings[ref].alive = False
            log.warning("%s: the actor for node %s failed to start: %s", call, pings[ref].spec.name, exc)
    for ref in late:
        a = pings[ref]
        a.alive = False
        log.warning("%s: the actor for node %s did not start within %.0f s (it asks for %g GPUs "
                    "and %g CPUs); going on without it", call, a.spec.name, timeout,
                    a.spec.num_gpus, a.spec.num_cpus)
    if not any(a.alive for a in actors):
        raise RuntimeError(
            f"{call}: none of the {len(actors)} Ray actors started within {timeout:.0f} s; check "
            "`ray status` for free GPUs/CPUs on the nodes, or pass nodes=[NodeSpec(...)] asking "
            "for fewer resources")


class _Dispatcher:
    """Hands chunks to actors as they ask, retries the chunks of dead actors, gathers results."""

    def __init__(self, ray: Any, actors: list[_Actor], valid: dict[int, LinearSystem],
                 results: list[SolveResult | None], *, return_on: str, max_attempts: int,
                 on_chunk: Callable | None, bar: Any):
        self.ray, self.actors, self.valid, self.results = ray, actors, valid, results
        self.return_on, self.max_attempts, self.on_chunk, self.bar = return_on, max_attempts, on_chunk, bar
        self.pending = collections.deque(sorted(valid))  # input order: neighbours often share A
        self.cost = {i: _cost(s) for i, s in valid.items()}
        self.remaining = sum(self.cost.values())
        # Smallest chunk: about 8 per actor at the tail, so batches stay large enough.
        self.min_cost = self.remaining / (8 * len(actors))
        self.retry: collections.deque[_Chunk] = collections.deque()
        self.flight: dict[Any, tuple[_Chunk, _Actor, list]] = {}
        self.payload_cache: dict[int, dict] = {}
        self.chunk_timeout = float(config.current().ray_chunk_timeout)

    def run(self) -> None:
        while self.pending or self.retry or self.flight:
            self._feed()
            if not self.flight:
                self._fail_rest("every Ray actor died")
                return
            # A bounded wait: an actor that hangs (a stuck driver, a deadlocked
            # node) must not block the call; its chunks go to the others.
            ready, _ = self.ray.wait(list(self.flight), num_returns=1,
                                     timeout=min(5.0, self.chunk_timeout))
            for ref in ready:
                self._collect(ref)
            if not ready:
                self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        """Chunks in flight past the timeout: their actor counts as hung, they go elsewhere."""
        for ref, (c, a, _x) in list(self.flight.items()):
            if now - c.sent_at <= self.chunk_timeout:
                continue
            del self.flight[ref]
            a.in_flight -= 1
            a.alive = False
            log.warning("solve_many(backend='ray'): actor on %s gave no answer for %d systems "
                        "within %.0f s; counted as hung, its chunk is retried", a.spec.name,
                        len(c.indices), self.chunk_timeout)
            self._again(c, a, f"no answer within {self.chunk_timeout:.0f} s (hung actor)")

    # ---------------------------------------------------------------- hand out
    def _feed(self) -> None:
        for a in self._by_share():
            while a.alive and a.in_flight < IN_FLIGHT and (self.retry or self.pending):
                chunk = self._retry_for(a) or self._new_chunk(a)
                if chunk is None:
                    break
                self._submit(chunk, a)

    def _by_share(self) -> list[_Actor]:
        share = _shares(self.actors)
        return sorted((a for a in self.actors if a.alive), key=lambda a: -share[id(a)])

    def _retry_for(self, a: _Actor) -> _Chunk | None:
        # A chunk goes back to an actor it failed on only when it failed on every live one.
        live = {id(x) for x in self.actors if x.alive}
        for k, c in enumerate(self.retry):
            if id(a) not in c.failed_on or live <= c.failed_on:
                del self.retry[k]
                return c
        return None

    def _new_chunk(self, a: _Actor) -> _Chunk | None:
        if not self.pending:
            return None
        target = max(self.min_cost, 0.5 * self.remaining * _shares(self.actors)[id(a)])
        idx, cost = [], 0.0
        while self.pending and (not idx or cost + self.cost[self.pending[0]] <= target
                                or self.remaining - cost < self.min_cost):
            # (the last clause: a remainder below the smallest chunk joins this one)
            i = self.pending.popleft()
            idx.append(i)
            cost += self.cost[i]
        self.remaining -= cost
        return _Chunk(idx, cost)

    def _submit(self, c: _Chunk, a: _Actor) -> None:
        if c.ref is None:
            c.ref = self.ray.put([_payload(self.valid[i]) for i in c.indices])
        c.attempt += 1
        c.sent_at = time.monotonic()
        refs = a.handle.solve_chunk.options(num_returns=1 + len(c.indices)).remote(c.ref)
        self.flight[refs[0]] = (c, a, refs[1:])
        a.in_flight += 1

    # ---------------------------------------------------------------- take back
    def _collect(self, ref: Any) -> None:
        c, a, x_refs = self.flight.pop(ref)
        a.in_flight -= 1
        try:
            meta = self.ray.get(ref)
            # The solutions too: one lost object retries the chunk, not the call.
            xs = x_refs if self.return_on == "refs" else self.ray.get(x_refs)
        except self.ray.exceptions.RayActorError as exc:
            self._lost(c, a, exc)
            return
        except self.ray.exceptions.RayError as exc:  # the node's code raised: try elsewhere
            log.warning("solve_many(backend='ray'): node %s failed a chunk of %d systems: %s",
                        a.spec.name, len(c.indices), exc)
            self._again(c, a, f"{type(exc).__name__}: {exc}")
            return
        new = 0
        for i, m, x in zip(c.indices, meta["results"], xs, strict=True):
            if self.results[i] is not None:
                continue  # delivered by an earlier attempt: the first one wins
            if self.return_on == "host" and x is not None:
                # A private, writable copy: object-store views are read-only and die
                # with the Ray instance this call may shut down.
                x = np.array(x, copy=True)
            self.results[i] = SolveResult(
                x, Status[m["status"]], iterations=m["iterations"],
                residual_norm=m["residual_norm"], b_norm=m["b_norm"], device=m["device"],
                seconds=m["seconds"], method=m["method"], message=m["message"], name=m["name"],
                info={**m["info"], "attempt": c.attempt})
            new += 1
        seconds = float(meta["seconds"])
        if seconds > 0:
            r = c.cost / seconds
            a.rate = r if a.rate is None else 0.5 * a.rate + 0.5 * r
        if self.bar is not None:
            self.bar.update(new)
        if self.on_chunk is not None:
            self.on_chunk(ChunkEvent(a.spec.name, a.handle, list(c.indices), seconds, c.attempt))

    def _lost(self, c: _Chunk, a: _Actor, exc: BaseException) -> None:
        """The actor died while holding c: find out whether it comes back, requeue c."""
        log.warning("solve_many(backend='ray'): actor on %s died (%s); its chunk of %d systems "
                    "is retried", a.spec.name, type(exc).__name__, len(c.indices))
        if a.alive:
            # A ping fails at once for an actor dead for good and waits while Ray
            # restarts one (max_restarts); either way no other chunk is dropped.
            try:
                self.ray.get(a.handle.ping.remote(), timeout=RESTART_WAIT_S)
            except Exception:
                a.alive = False
        self._again(c, a, f"{type(exc).__name__}: {exc}")

    def _again(self, c: _Chunk, a: _Actor, why: str) -> None:
        c.failed_on.add(id(a))
        if c.attempt >= self.max_attempts:
            for i in c.indices:
                self._deliver_error(i, f"failed {c.attempt} times on Ray actors; last: {why}")
            return
        self.retry.appendleft(c)

    def _fail_rest(self, why: str) -> None:
        for c in self.retry:
            for i in c.indices:
                self._deliver_error(i, why)
        self.retry.clear()
        while self.pending:
            self._deliver_error(self.pending.popleft(), why)

    def _deliver_error(self, i: int, why: str) -> None:
        if self.results[i] is None:
            self.results[i] = SolveResult(
                None, Status.DEVICE_ERROR, name=self.valid[i].name or f"systems[{i}]",
                message=f"solve_many(backend='ray'): {why}. Check the nodes (`ray status`) and "
                "run again, or use backend='local'.")
            if self.bar is not None:
                self.bar.update(1)

