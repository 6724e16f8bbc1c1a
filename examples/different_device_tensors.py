"""Tensors on different devices, combined without a single manual ``.to()``.

The bridgesign/managed prototype's first example, done with out-of-place
moves: each operation runs where most of its operand bytes already are (or
on a pinned tensor's device), and autograd follows the moves back. Without
GPUs, two simulated ones (``sim:0``, ``sim:1``) show the same placement
decisions on the CPU.

Run: ``python examples/different_device_tensors.py [--small] [--simulate 2x1GiB]``;
the last line is ``max_abs_error=...``, the largest difference from the same
computation with plain tensors on one device (gradients included).
"""

from __future__ import annotations

import argparse

import torch

from managed_solve import _backend
from managed_solve.manager import DeviceManager
from managed_solve.tensor import managed


def pick_devices(simulate: str | None) -> tuple[DeviceManager, str, str]:
    """A manager and two device names: two GPUs, one GPU and the CPU, or two simulated GPUs."""
    if simulate is None and _backend.cuda_probe()[0] == 0:
        simulate = "2x1GiB"
        print("no usable GPU: two simulated GPUs (sim:0, sim:1) on the CPU")
    dm = DeviceManager(simulate=simulate) if simulate else DeviceManager()
    names = [str(d) for d in dm.accelerators] + ["cpu"]
    return dm, names[0], names[1]


def compute(a, b, c, w):
    """A small mixed computation: matmul, broadcasting, stack, in-place, indexing, reduction."""
    h = torch.tanh(a @ w)                         # a and w
    s = torch.stack([h.sum(dim=1), b[: h.shape[0]]])  # operands from two devices
    s2 = s * c[: s.shape[1]]                      # broadcast with a third tensor
    acc = torch.zeros_like(s2[0])
    acc.add_(s2[1])                               # in-place: runs where acc lives
    idx = torch.arange(0, acc.shape[0], 2)
    return (acc[idx] ** 2).sum() + s2.mean()


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="small sizes (for the test suite)")
    p.add_argument("--simulate", default=None, help="simulated GPUs, e.g. 2x1GiB")
    args = p.parse_args(argv)
    n = 64 if args.small else 4096
    dm, dev_a, dev_b = pick_devices(args.simulate)

    g = torch.Generator().manual_seed(0)
    host = {k: torch.randn(*shape, dtype=torch.float64, generator=g)
            for k, shape in {"a": (n, 32), "b": (4 * n,), "c": (n,), "w": (32, 16)}.items()}

    a = managed(host["a"].clone(), manager=dm).to(dev_a).requires_grad_()
    b = managed(host["b"].clone(), manager=dm).to(dev_b)
    c = managed(host["c"].clone(), manager=dm).to(dev_b)
    w = managed(host["w"].clone(), manager=dm).to(dev_b).pin().requires_grad_()
    out = compute(a, b, c, w)
    out.backward()
    print(f"a on {a.placement}, b and c on {b.placement}, w pinned to {w.pinned}: "
          f"result computed on {out.placement}")
    print(f"gradients: a.grad on {a.grad.placement}, w.grad on {w.grad.placement}")

    ra = host["a"].clone().requires_grad_()
    rw = host["w"].clone().requires_grad_()
    ref = compute(ra, host["b"], host["c"], rw)
    ref.backward()
    plain = lambda t: t.detach().as_subclass(torch.Tensor).cpu()  # noqa: E731
    err = max(
        float((plain(out) - ref.detach()).abs()),
        float((plain(a.grad) - ra.grad).abs().max()),
        float((plain(w.grad) - rw.grad).abs().max()),
    )
    print(f"max_abs_error={err:.3e}")
    return err


if __name__ == "__main__":
    main()
