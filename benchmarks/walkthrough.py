"""Walk one W2-like system through ``solve_many``: the functions, modules and crossings it passes.

A diagnostic, not a benchmark. It solves one 2D Poisson system (m = 64,
4,096 unknowns, W2's middle size, rtol 1e-8) with
``ms.solve_many([(A, b)], devices=[device])`` under a profile hook installed
on every thread (``sys.setprofile`` and ``threading.setprofile``: the call
runs on the caller's thread, a worker per device, a stager, a finisher and
helper pools), keeps the frames whose code lies in the ``managed_solve``
package, and prints

1. the (module, function) pairs in the order they were first entered, with
   the thread that entered them;
2. the distinct modules passed through;
3. the crossings between modules of the package: a call from a frame in
   module X to a function of module Y != X. Each is marked by the layer
   contract of ``pyproject.toml`` (the import-linter ``layers`` contracts,
   read from the file): ``down`` when Y's layer is below X's, ``level`` when
   both lie in the same layer (siblings such as ``solvers.batched.packed`` ->
   ``solvers.engine``, or ``solvers`` -> ``sharded``), ``up`` when Y's
   layer is above X's (a callback handed down and called from below). Two
   modules of a package with a layers contract of its own
   (``scheduling.runner`` -> ``scheduling.routes``) compare by that one.

Which number is "the crossings"
-------------------------------
Every crossing is counted three ways:

- **events**: every call between modules, repeats included;
- **call sites**: distinct (caller function -> callee function) pairs;
- **module edges**: distinct (caller module -> callee module) pairs.

The issue's figure ("73 crossings between files, 25 of them back into
scheduler.py", over 14 files) counted **events** along one system's path:
25 crossings back into one file out of 14 cannot be distinct edges. So
``crossings`` (the headline and the JSON key) is the events count, the
figure to hold against the issue's 73 and its target of about 15; module
edges are printed beside it, the measure of how many files talk to each
other. Each count is given twice: over all calls, and over the *steps*
only, leaving out accessors (properties, dunders other than ``__init__``)
and calls into the lowest layer (``config``, ``_backend``, ``devices``,
``result``, ``kernels``, ...: settings, array modules, device names),
which a reader steps over.

A third grain counts the step crossings between the *units of the layer
contract*: the package's top-level modules and sub-packages (``scheduling``,
``system``, ``solvers``, ``manager``, ...), the names its ``layers``
contract orders. A call from ``scheduling.runner`` to
``scheduling.routes`` stays inside one unit; one from ``scheduling.routes``
to ``solvers.batched.engine`` crosses from one unit to another. It is the
grain at which the layers are stated, and the one at which a reader changes
subject (from scheduling to a solver, to the system's policy, to the
manager's ledger).

Frames that are not real calls a reader follows are transparent: generator
expressions and comprehensions (their frames run inside the function that
made them), and code outside the package (NumPy, SciPy, Numba's dispatch,
``concurrent.futures``, ``threading``). A call from package module X through
outside code into package module Y (a ``sorted`` key, a pool's worker)
counts as X -> Y. The first function a thread runs is attributed to the
package function that submitted it (``ThreadPoolExecutor.submit``,
``threading.Thread(target=...)``), so handing work to a thread counts as a
call from the module that handed it over.

Device: ``cuda:0`` when CuPy sees a GPU; else ``sim:0``, a simulated GPU
(placed and staged like a GPU, with the worker, stager and finisher
threads, computing with the host kernels); ``--device cpu`` takes the CPU
route (which may be the host LU for such a system). The output says which.
One untraced call of the same size runs first (``--cold`` skips it), so the
walk shows the steady state, not first-call compilation and imports.

Usage::

    python benchmarks/walkthrough.py               # cuda:0 if there is a GPU, else sim:0
    python benchmarks/walkthrough.py --device cpu  # the CPU route
    python benchmarks/walkthrough.py --json        # the figures as JSON
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import numpy as np

import managed_solve as ms
from managed_solve import _backend
from managed_solve.manager import DeviceManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_w2_many import poisson2d  # noqa: E402  (W2's matrix, as the benchmark builds it)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PACKAGE = "managed_solve"
PACKAGE_DIR = str(Path(ms.__file__).resolve().parent) + os.sep
ROOT = Path(__file__).resolve().parent.parent
# Frames that run inside the function that made them: never a call a reader follows.
_TRANSPARENT = frozenset({"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"})


# --------------------------------------------------------------------------- layers
def read_layers(pyproject: Path) -> dict[str, list[list[str]]]:
    """The layers contracts of ``pyproject.toml`` by container, highest layer first, each a list of names.

    The package's own contract (container ``managed_solve``) and those that
    layer a package inside it (``managed_solve.scheduling``, ...).
    """
    with open(pyproject, "rb") as fh:
        cfg = tomllib.load(fh)
    out: dict[str, list[list[str]]] = {}
    for contract in cfg["tool"]["importlinter"]["contracts"]:
        if contract.get("type") == "layers":
            layers = [[part.strip() for part in layer.replace("|", ":").split(":") if part.strip()]
                      for layer in contract["layers"]]
            for container in contract.get("containers", [PACKAGE]):
                out[container] = layers
    if PACKAGE not in out:
        raise SystemExit(f"{pyproject}: no import-linter 'layers' contract of {PACKAGE}")
    return out


class Layers:
    """Module name -> layer rank (0 the highest); the package's ``__init__`` sits above all.

    Two modules of one package that has a layers contract of its own
    (``scheduling.many`` and ``scheduling.runner``) compare by that
    contract; otherwise by the package's.
    """

    def __init__(self, contracts: dict[str, list[list[str]]]):
        self.ranks = {container: {name: r for r, names in enumerate(layers) for name in names}
                      for container, layers in contracts.items()}
        self.rank = self.ranks[PACKAGE]

    def of(self, module: str) -> int:
        parts = module.split(".")
        if len(parts) < 2:  # managed_solve itself: the re-exports above every layer
            return -1
        rank = self.rank.get(parts[1])
        if rank is None:
            raise SystemExit(f"{module}: in no layer of the contract; update pyproject.toml")
        return rank

    def direction(self, caller: str, callee: str) -> str:
        a, b = caller.split("."), callee.split(".")
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        if k >= 2 and k < len(a) and k < len(b):  # siblings inside a package of the package
            ranks = self.ranks.get(".".join(a[:k]))
            if ranks is not None and a[k] in ranks and b[k] in ranks:
                ra, rb = ranks[a[k]], ranks[b[k]]
                return "down" if rb > ra else "up" if rb < ra else "level"
        ra, rb = self.of(caller), self.of(callee)
        return "down" if rb > ra else "up" if rb < ra else "level"

    def foundation(self, module: str) -> bool:
        """True for a module of the lowest layer (settings, arrays, devices, results, kernels)."""
        return self.of(module) == max(self.rank.values())


def accessor(module: str, qualname: str) -> bool:
    """True for a property or a dunder other than ``__init__``/``__call__``: data, not a step."""
    name = qualname.rsplit(".", 1)[-1]
    if name.startswith("__") and name.endswith("__"):
        return name not in ("__init__", "__call__")
    if "<locals>" in qualname or "." not in qualname:
        return False
    obj: Any = importlib.import_module(module)
    for part in qualname.split(".")[:-1]:
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return isinstance(inspect.getattr_static(obj, name, None), property)


# --------------------------------------------------------------------------- tracing
@dataclass
class Walk:
    """What the profile hook saw: first entries, crossings, threads."""

    first: list[tuple[str, str, str]] = field(default_factory=list)  # (module, function, thread)
    seen: set[tuple[str, str]] = field(default_factory=set)
    events: Counter = field(default_factory=Counter)  # (caller mod, caller fn, callee mod, callee fn)
    calls: int = 0  # calls into package functions, crossings or not
    threads: set[str] = field(default_factory=set)


class Tracer:
    """A profile hook that records package calls on every thread while ``recording``."""

    def __init__(self):
        self.walk = Walk()
        self.recording = False
        self.lock = threading.Lock()
        # Code objects handed to another thread -> the package frame that handed them over.
        self.handed: dict[CodeType, tuple[str, str]] = {}

    def install(self) -> None:
        threading.setprofile(self.hook)  # threads started from now on
        sys.setprofile(self.hook)  # this thread

    def remove(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)

    @staticmethod
    def where(frame: FrameType) -> tuple[str, str] | None:
        """(module, function) of a package frame, None for any other."""
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE_DIR) or code.co_name in _TRANSPARENT:
            return None
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(PACKAGE):
            return None
        return module, getattr(code, "co_qualname", code.co_name)

    def caller(self, frame: FrameType) -> tuple[str, str] | None:
        """The nearest package frame below ``frame`` on its thread, else who handed it over."""
        f = frame.f_back
        root = frame
        while f is not None:
            w = self.where(f)
            if w is not None:
                return w
            root = f
            f = f.f_back
        del root
        return self.handed.get(frame.f_code)

    def note_handover(self, frame: FrameType) -> None:
        """``ThreadPoolExecutor.submit(fn)`` / ``Thread(target=fn)`` called from package code."""
        code = frame.f_code
        if code.co_name == "submit" and "concurrent" in code.co_filename:
            fn = frame.f_locals.get("fn")
        elif code.co_name == "__init__" and code.co_filename.endswith("threading.py") \
                and "target" in frame.f_locals:
            fn = frame.f_locals.get("target")
        else:
            return
        while hasattr(fn, "func"):  # functools.partial
            fn = fn.func
        fn = getattr(fn, "__func__", fn)
        target = getattr(fn, "__code__", None)
        if target is None:
            return
        f = frame.f_back
        while f is not None:
            w = self.where(f)
            if w is not None:
                self.handed[target] = w
                return
            f = f.f_back

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.recording:
            return
        callee = self.where(frame)
        if callee is None:
            self.note_handover(frame)
            return
        caller = self.caller(frame)
        thread = threading.current_thread().name
        with self.lock:
            w = self.walk
            w.calls += 1
            w.threads.add(thread)
            if callee not in w.seen:
                w.seen.add(callee)
                w.first.append((*callee, thread))
            if caller is not None and caller[0] != callee[0]:
                w.events[(caller[0], caller[1], callee[0], callee[1])] += 1


# --------------------------------------------------------------------------- the walk
def pick_device(asked: str) -> tuple[str, DeviceManager | None, str]:
    """(device name, manager or None for the default, a sentence saying what runs where)."""
    if asked == "auto":
        asked = "cuda:0" if _backend.cuda_usable() else "sim:0"
    if asked.startswith("cuda"):
        n, why = _backend.cuda_probe()
        if n == 0:
            raise SystemExit(f"--device {asked}: no usable GPU ({why})")
        return asked, None, f"{asked}: a CUDA GPU ({_gpu_name(asked)})"
    if asked.startswith("sim"):
        mgr = DeviceManager(simulate="1x8GiB")
        why = _backend.cuda_probe()[1] or "asked for"
        return asked, mgr, (f"{asked}: a simulated GPU (no usable GPU here: {why}); placed, staged "
                            "and threaded like a GPU, computed with the host kernels")
    mgr = DeviceManager(["cpu"])
    return "cpu", mgr, "cpu: the CPU route (the auto policy may factorise such a system)"


def _gpu_name(name: str) -> str:
    cp = _backend.cupy()
    idx = int(name.split(":")[1]) if ":" in name else 0
    props = cp.cuda.runtime.getDeviceProperties(idx)
    raw = props["name"]
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def walk(device: str, manager: DeviceManager | None, m: int, cold: bool) -> tuple[Walk, Any]:
    tracer = Tracer()
    # Installed before the warm-up: the process-wide pools the call uses start
    # their threads on first use, and only threads started after
    # threading.setprofile carry the hook.
    tracer.install()
    try:
        if not cold:
            A0 = poisson2d(m)
            ms.solve_many([(A0, np.ones(A0.shape[0]))], devices=[device], manager=manager,
                          rtol=1e-8)
        A = poisson2d(m)
        b = np.ones(A.shape[0])
        tracer.recording = True
        try:
            res = ms.solve_many([(A, b)], devices=[device], manager=manager, rtol=1e-8)
        finally:
            tracer.recording = False
    finally:
        tracer.remove()
    return tracer.walk, res[0]


def figures(w: Walk, layers: Layers) -> dict:
    modules = sorted({mod for mod, _fn, _t in w.first})
    sites = []
    for (cm, cf, em, ef), k in w.events.items():  # in the order first made
        kind = "accessor" if accessor(em, ef) else "foundation" if layers.foundation(em) else "step"
        sites.append({"caller": f"{cm}.{cf}", "callee": f"{em}.{ef}", "calls": k,
                      "direction": layers.direction(cm, em), "kind": kind,
                      "from": cm, "to": em})

    def tally(rows: list[dict]) -> dict:
        """Call sites, module edges and call events of ``rows``, by direction."""
        edges: dict[tuple[str, str], str] = {(r["from"], r["to"]): r["direction"] for r in rows}
        out = {}
        for name, counted in (("sites", [(r["direction"], 1) for r in rows]),
                              ("edges", [(d, 1) for d in edges.values()]),
                              ("events", [(r["direction"], r["calls"]) for r in rows])):
            c: Counter = Counter()
            for d, k in counted:
                c[d] += k
            out[name] = {"total": sum(c.values()), "down": c["down"], "level": c["level"],
                         "up": c["up"]}
        return out

    steps = [r for r in sites if r["kind"] == "step"]
    between_units = [r for r in steps if unit(r["from"]) != unit(r["to"])]
    edges: dict[tuple[str, str], dict] = {}
    for r in sites:
        e = edges.setdefault((r["from"], r["to"]), {"caller": r["from"], "callee": r["to"],
                                                      "calls": 0, "direction": r["direction"],
                                                      "steps": 0})
        e["calls"] += r["calls"]
        e["steps"] += r["kind"] == "step"
    return {
        "functions": len(w.first),
        "modules": len(modules),
        "threads": len(w.threads),
        "package_calls": w.calls,
        "all": tally(sites),
        "steps": tally(steps),
        "unit_steps": tally(between_units),
        "unit_step_list": [f"{short(r['caller'])} -> {short(r['callee'])}" for r in between_units],
        "crossings": tally(sites)["events"],  # the figure: see the module docstring
        "module_list": modules,
        "thread_list": sorted(w.threads),
        "first_entered": [{"module": mod, "function": fn, "thread": t} for mod, fn, t in w.first],
        "call_sites": sites,
        "module_edges": sorted(edges.values(), key=lambda e: (e["caller"], e["callee"])),
    }


def unit(module: str) -> str:
    """The unit of the layer contract ``module`` belongs to: the package's top-level module or package."""
    return ".".join(module.split(".")[:2])


def short(module: str) -> str:
    return module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else module


def report(fig: dict, where: str, res: Any) -> None:
    print(f"device: {where}")
    print(f"result: {res.status.name}, {res.iterations} iterations, method {res.method}, "
          f"solved on {res.device}, batch_size={res.info.get('batch_size')}")
    print(f"\n{fig['functions']} functions in {fig['modules']} modules on {fig['threads']} threads "
          f"({', '.join(fig['thread_list'])}); {fig['package_calls']} calls into package functions\n")
    print("first entered (module, function, thread):")
    for k, e in enumerate(fig["first_entered"], 1):
        print(f"  {k:3d}  {short(e['module']):28s} {e['function']:44s} {e['thread']}")
    print("\nmodules:\n  " + "\n  ".join(short(m) for m in fig["module_list"]))
    print("\ncall sites between modules, in the order first made "
          "(direction, kind, caller -> callee, calls):")
    for c in fig["call_sites"]:
        print(f"  {c['direction']:5s} {c['kind']:10s} {short(c['caller'])} -> {short(c['callee'])}"
              f"  x{c['calls']}")
    print("\nmodule edges (direction, caller -> callee, calls, of which step call sites):")
    for e in fig["module_edges"]:
        print(f"  {e['direction']:5s} {short(e['caller'])} -> {short(e['callee'])}  "
              f"x{e['calls']}, {e['steps']} step sites")
    print("\n" + " " * 34 + "total  down level  up")
    for scope in ("all", "steps"):
        for key, label in (("edges", "module edges"), ("sites", "call sites"),
                           ("events", "call events")):
            t = fig[scope][key]
            print(f"  {scope:6s} {label:25s} {t['total']:5d} {t['down']:5d} {t['level']:5d} "
                  f"{t['up']:3d}")
    u = fig["unit_steps"]["events"]
    print(f"  steps  between units of the contract {u['total']:4d} {u['down']:5d} {u['level']:5d} "
          f"{u['up']:3d}")
    print("\nstep crossings between units of the layer contract (packages and top-level modules):")
    for k, line in enumerate(fig["unit_step_list"], 1):
        print(f"  {k:3d}  {line}")
    t, e = fig["crossings"], fig["all"]["edges"]
    print(f"\ncrossings (call events between modules, as the issue counted): {t['total']} "
          f"({t['down']} down, {t['level']} level, {t['up']} up); distinct module edges: "
          f"{e['total']} ({e['down']} down, {e['level']} level, {e['up']} up)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto",
                    help="auto (cuda:0 if CuPy sees a GPU, else sim:0), cuda:i, sim:0 or cpu")
    ap.add_argument("--m", type=int, default=64, help="grid side (n = m^2), W2's sizes are 32..96")
    ap.add_argument("--cold", action="store_true", help="no warm-up call before the traced one")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    layers = Layers(read_layers(ROOT / "pyproject.toml"))
    device, manager, where = pick_device(args.device)
    w, res = walk(device, manager, args.m, args.cold)
    fig = figures(w, layers)
    if args.json:
        print(json.dumps({"device": device, "where": where, "status": res.status.name,
                          "iterations": res.iterations, "method": res.method, **fig}, indent=1))
    else:
        report(fig, where, res)


if __name__ == "__main__":
    main()
