"""Turn a pytest-benchmark JSON run into a markdown table of ratios and a PNG plot.

Usage::

    python benchmarks/report.py RUN.json [--out DIR]

Benchmarks are grouped by pytest-benchmark's ``group``. Inside a group the
anchor is the entry whose ``extra_info["role"] == "anchor"`` (or whose name
says scipy/cupyx/numpy/torch/loop/host when no role is given); every other
entry gets its ratio to it, so ratios always compare timings of the same run.
Where a benchmark records ``extra_info["per_iteration_s"]`` that figure is
used instead of the call's median (Krylov solves compare per iteration).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

_ANCHOR_WORDS = re.compile(r"(anchor|scipy|cupyx|numpy|torch_cg|loop|host|naive|plain)", re.I)


_ROLE_TOKENS = re.compile(r"^(ours|ours_solve|anchor|candidate|cupyx|scipy|numpy|torch|plain|managed|managed_pinned|"
                          r"dlpack|host_round_trip|loop|naive|block-diagonal)$", re.I)
_ANCHOR_WHO = {"cupyx", "scipy", "numpy", "torch", "plain", "host_round_trip", "anchor"}


def _metric(bench: dict) -> tuple[float, str]:
    extra = bench.get("extra_info", {})
    for key in ("per_iteration_s", "seconds_per_iteration"):
        if key in extra:
            return float(extra[key]), "per iteration" if "metric" not in extra else "per system"
    return float(bench["stats"]["median"]), "median call"


def _is_anchor(bench: dict) -> bool:
    extra = bench.get("extra_info", {})
    role = extra.get("role", extra.get("who"))
    if role is not None:
        return role in _ANCHOR_WHO
    return bool(_ANCHOR_WORDS.search(bench["name"]))


def _pair_key(bench: dict) -> str:
    """The benchmark's name with its role token removed: ours and its anchor share it."""
    name = bench["name"]
    base, _, params = name.partition("[")
    tokens = [t for t in params.rstrip("]").split("-") if t and not _ROLE_TOKENS.match(t)]
    return base + "[" + "-".join(tokens) + "]" if params else base


def _fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def build_rows(data: dict) -> list[dict]:
    groups: dict[str, list[dict]] = {}
    for b in data.get("benchmarks", []):
        groups.setdefault(b.get("group") or b["name"].split("[")[0], []).append(b)
    rows = []
    for group, benches in sorted(groups.items()):
        anchors = [b for b in benches if _is_anchor(b)]
        by_key = {_pair_key(a): a for a in anchors}
        for b in sorted(benches, key=lambda b: (_pair_key(b), _is_anchor(b), b["name"])):
            value, kind = _metric(b)
            anchor = by_key.get(_pair_key(b)) or (anchors[0] if len(anchors) == 1 else None)
            ratio = None
            reported_only = b.get("extra_info", {}).get("role") == "reported"  # no anchor of its kind
            if anchor is not None and b is not anchor and not _is_anchor(b) and not reported_only:
                ratio = value / _metric(anchor)[0]
            extra = b.get("extra_info", {})
            note = extra.get("note", extra.get("bandwidth_fraction", ""))
            rows.append({
                "group": group,
                "name": b["name"],
                "value": value,
                "kind": kind,
                "anchor": anchor["name"] if ratio is not None else "",
                "ratio": ratio,
                "is_anchor": _is_anchor(b),
                "device": extra.get("device", ""),
                "note": note,
            })
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    when = meta.get("datetime", "")
    machine = meta.get("machine_info", {})
    head = [f"Run of {when} on {machine.get('node', '?')} ({machine.get('cpu', {}).get('brand_raw', '')})", ""]
    head.append("| group | benchmark | time | measure | vs anchor | anchor | device | note |")
    head.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = "anchor" if r["is_anchor"] else (f"{r['ratio']:.3g} x" if r["ratio"] is not None else "")
        note = f"{r['note']:.3g}" if isinstance(r["note"], float) else str(r["note"])
        head.append(f"| {r['group']} | {r['name']} | {_fmt_time(r['value'])} | {r['kind']} | {ratio} | "
                    f"{r['anchor']} | {r['device']} | {note} |")
    return "\n".join(head) + "\n"


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ratios = [r for r in rows if r["ratio"] is not None]
    if not ratios:
        return False
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(ratios) + 1.5))
    labels = [f"{r['group']}: {r['name']}"[:70] for r in ratios]
    vals = [r["ratio"] for r in ratios]
    ax.barh(range(len(vals)), vals, color=["tab:green" if v < 1 else "tab:red" for v in vals])
    ax.set_yticks(range(len(vals)), labels, fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("time relative to the anchor of the same run (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="pytest-benchmark JSON (--benchmark-json)")
    p.add_argument("--out", default=None, help="folder for report.md and report.png (default: beside the JSON)")
    args = p.parse_args(argv)
    try:
        with open(args.json) as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"report.py: cannot read {args.json}: {exc}", file=sys.stderr)
        return 2
    out = args.out or os.path.dirname(os.path.abspath(args.json))
    os.makedirs(out, exist_ok=True)
    rows = build_rows(data)
    text = markdown(rows, data)
    with open(os.path.join(out, "report.md"), "w") as fh:
        fh.write(text)
    made = plot(rows, os.path.join(out, "report.png"))
    print(text)
    print(f"wrote {os.path.join(out, 'report.md')}" + (f" and {os.path.join(out, 'report.png')}" if made else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
