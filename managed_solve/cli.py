"""Command line: ``managed-solve info | demo | bench``."""

from __future__ import annotations

import argparse
import importlib
import sys


def _version(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # a broken optional library must not break `info`
        return f"not available ({type(exc).__name__})"
    return getattr(mod, "__version__", "?")


def cmd_info(args: argparse.Namespace) -> int:
    from . import _backend
    from .devices import inventory_mode
    from .manager import DeviceManager

    dm = DeviceManager(simulate=args.simulate)
    n, why = _backend.cuda_probe()
    mode = inventory_mode(dm.devices)
    print(f"managed-solve {__import__('managed_solve').__version__}: {mode} mode"
          + (f" ({why})" if mode == "CPU-only" and why else ""))
    print(dm.report())
    print()
    for name in ("numpy", "scipy", "numba", "cupy", "torch"):
        print(f"{name:6s} {_version(name)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="managed-solve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="devices, mode and library versions")
    info.add_argument("--simulate", default=None, help="simulated GPUs, e.g. 4x2GiB")
    info.set_defaults(func=cmd_info)
    demo = sub.add_parser("demo", help="the main job: a PDE sweep on a surface, solved on every device")
    demo.add_argument("--mesh", default=None, help="a mesh file (obj, ply, stl, off, msh, vtk, vtu)")
    demo.add_argument("--systems", type=int, default=None, help="number of systems in the sweep")
    demo.add_argument("--simulate", default=None, help="simulated GPUs, e.g. 4x2GiB")
    demo.add_argument("--device", default=None, help="run on one device only, e.g. cuda:0 or cpu")
    demo.add_argument("--out", default=None, help="where to write the picture (PNG)")
    demo.add_argument("--small", action="store_true", help="a quick run (tests)")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError, MemoryError) as exc:
        # A user mistake is one clear line, never a traceback.
        print(f"managed-solve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
