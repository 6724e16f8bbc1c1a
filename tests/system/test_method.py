"""The auto policy (system/method.py): which systems the CPU factorises."""

from __future__ import annotations

from managed_solve.system import method as method_policy


def test_large_and_3d_like_systems_are_not_factorised():
    big = method_policy.DIRECT_MAX_N + 1
    assert not method_policy.wants_direct("csr", big, 5 * big)
    assert not method_policy.wants_direct("csr", 1000, 27 * 1000)  # 3D-like: too much fill
