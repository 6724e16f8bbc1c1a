"""Command line: ``managed-solve info``, ``managed-solve demo`` and ``managed-solve warmup``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

DESCRIPTION = """\
Sparse linear systems from PDEs, solved on every GPU of a machine (and on the
CPU when there is none).

commands:
  info   the devices found, the mode (GPU, CPU-only or simulated) and the
         versions of the libraries in use
  demo   a sweep of PDE systems on a surface solved with solve_many, timed
         against a plain loop of SciPy's (or on a GPU, cupyx's) cg
  warmup compile (or load from the disk caches) the kernels the default
         solve paths use, e.g. when a container or cluster worker starts

environment:
  MANAGED_SOLVE_DEVICES   devices to use, e.g. cuda:1,cpu
  MANAGED_SOLVE_SIMULATE  simulated GPUs instead of real ones, e.g. 4x2GiB
"""


def _version(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # a broken optional library must not break `info`
        return f"not available ({type(exc).__name__})"
    return getattr(mod, "__version__", "?")


def _package_version() -> str:
    from . import __version__

    return __version__


def cmd_info(args: argparse.Namespace) -> int:
    from . import _backend
    from .devices import inventory_mode
    from .manager import DeviceManager

    dm = DeviceManager(simulate=args.simulate)
    n, why = _backend.cuda_probe()
    mode = inventory_mode(dm.devices)
    print(f"managed-solve {_package_version()}: {mode} mode"
          + (f" ({why})" if mode == "CPU-only" and why else ""))
    print(dm.report())
    print()
    for name in ("numpy", "scipy", "numba", "cupy", "torch"):
        print(f"{name:6s} {_version(name)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args)


def _items(text: str, option: str, accepted: str) -> list[str]:
    """The comma-separated items of an option; a ValueError (a usage error) when there are none.

    An empty list would run and succeed having done nothing, which a script
    could not tell from the work it asked for.
    """
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"{option} {text!r}: names nothing; give one or more of {accepted}, "
                         "comma-separated")
    return items


def cmd_warmup(args: argparse.Namespace) -> int:
    import json
    import time

    from . import _warmup

    methods = _items(args.methods, "--methods", ", ".join(_warmup.METHODS))
    dtypes = _items(args.dtypes, "--dtypes", "float64, float32")
    bad = [d for d in dtypes if d not in ("float64", "float32")]
    if bad:
        raise ValueError(f"--dtypes {args.dtypes}: unknown {', '.join(bad)}; expected float64 "
                         "and/or float32, comma-separated")
    if args.device is not None:
        _items(args.device, "--device", "cpu, cuda:N, cuda")
    stream = sys.stderr if args.json else sys.stdout
    print(f"managed-solve {_package_version()} warmup: compiling (or loading from the disk "
          "caches) the default paths' kernels", file=stream, flush=True)
    t0 = time.perf_counter()
    steps = _warmup.warmup(args.device, methods, dtypes=dtypes,
                           progress=lambda s: print("  " + _warmup.describe(s), file=stream,
                                                    flush=True))
    total = time.perf_counter() - t0
    compiled = sorted({k for s in steps for k in s["compiled"]})
    modules = [s["step"] for s in steps if s.get("cuda_module") == "compiled"]
    print(f"done in {total:.1f} s: compiled {len(compiled)} Numba kernels"
          + (f" and {len(modules)} CUDA modules" if modules else "")
          + f". Numba's cache: {_warmup.numba_cache_dir() or 'none'}"
          + (f"; CuPy's: {_warmup.cupy_cache_dir()}" if any(s.get("cuda_module") for s in steps)
             else "") + ". Later processes load them from there.", file=stream, flush=True)
    if args.json:
        print(json.dumps({"seconds": total, "steps": steps,
                          "numba_cache": _warmup.numba_cache_dir()}, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="managed-solve", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"managed-solve {_package_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{info,demo,warmup}")
    info = sub.add_parser("info", help="devices, mode and library versions",
                          description="Print the devices found, the mode and library versions.")
    info.add_argument("--simulate", default=None, metavar="SPEC",
                      help="simulated GPUs instead of real ones, e.g. 4x2GiB")
    info.set_defaults(func=cmd_info)
    demo = sub.add_parser(
        "demo", help="a PDE sweep on a surface, solved on every device and timed",
        description="A sweep of heat steps and screened Poisson problems on a surface, solved "
                    "with solve_many on every device and timed against a plain loop of cg "
                    "calls on the same systems (median of --repeat runs each).")
    demo.add_argument("--mesh", default=None, metavar="FILE",
                      help="a mesh file (obj, ply, stl, off, msh, vtk, vtu; needs meshio for most)")
    demo.add_argument("--systems", type=int, default=None, metavar="N",
                      help="number of systems in the sweep (default 60, 12 with --small)")
    demo.add_argument("--simulate", default=None, metavar="SPEC",
                      help="simulated GPUs instead of real ones, e.g. 4x2GiB")
    demo.add_argument("--device", default=None, help="run on one device only, e.g. cuda:0 or cpu")
    demo.add_argument("--repeat", type=int, default=3, metavar="K",
                      help="timed runs of each side; the median is reported (default 3)")
    demo.add_argument("--out", default=None, metavar="PNG",
                      help="where to write the picture (default ./managed_solve_demo.png)")
    demo.add_argument("--json", action="store_true",
                      help="print a JSON summary on stdout (the text goes to stderr)")
    demo.add_argument("--small", action="store_true", help="a quick run on smaller meshes")
    demo.set_defaults(func=cmd_demo)
    warm = sub.add_parser(
        "warmup", help="compile the kernels the default solve paths use, ahead of need",
        description="Compile (or load from Numba's and CuPy's disk caches) the kernels the "
                    "default solve and solve_many paths use on the given devices, and print "
                    "what was compiled and how long it took. For container images and "
                    "cluster workers: later processes load the kernels instead of compiling.")
    warm.add_argument("--device", default=None,
                      help="cpu, cuda:N, cuda (every GPU) or a comma-separated list "
                           "(default: the CPU and every usable GPU)")
    warm.add_argument("--methods", default="cg,bicgstab,gmres", metavar="LIST",
                      help="batched methods to prepare (default cg,bicgstab,gmres)")
    warm.add_argument("--dtypes", default="float64", metavar="LIST",
                      help="value dtypes, float64 and/or float32 (default float64)")
    warm.add_argument("--json", action="store_true",
                      help="print a JSON summary on stdout (the text goes to stderr)")
    warm.set_defaults(func=cmd_warmup)
    return p


#: The exit status of a command whose reader went away: 128 + SIGPIPE, as a shell reports it.
EXIT_PIPE_CLOSED = 141


def _pipe_closed() -> int:
    """Stop quietly after the reader of the output went away (``managed-solve info | head -1``).

    Command-line tools end silently there. Python would also report, at
    exit, that it could not flush what is left in ``sys.stdout``; pointing
    standard output at the null device gives that flush somewhere to go.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a file descriptor (captured output)
        pass
    return EXIT_PIPE_CLOSED


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    0 on success, 1 when the demo's systems did not all converge, 2 for a
    usage error (one line on stderr, no traceback), and
    :data:`EXIT_PIPE_CLOSED` when the output's reader closed the pipe.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        return _pipe_closed()
    except (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError, MemoryError) as exc:
        # A user mistake is one clear line, never a traceback.
        try:
            print(f"managed-solve {args.command}: error: {exc}", file=sys.stderr)
        except BrokenPipeError:
            return _pipe_closed()
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
