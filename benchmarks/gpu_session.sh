#!/usr/bin/env bash
# This release's GPU verification in two calls of at most ten minutes each.
#   bash benchmarks/gpu_session.sh tests   OUTDIR   # GPU tests, then W1-W3 against the baseline build
#   bash benchmarks/gpu_session.sh bench   OUTDIR   # the pytest-benchmark groups (AMG, W5, W6, W2)
#   (BENCH_FILES and BENCH_K pick the files and a pytest -k expression)
# BASELINE (a checkout of the previous release, default .baseline) is timed back to back
# with this checkout by benchmarks/compare_builds.py (public API only).
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT="${1:-tests}"
OUTDIR="${2:-${OUT:-out/gpu-$(date +%Y%m%d-%H%M%S)}}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUTDIR/install.log" 2>&1 \
    || { echo "install failed"; tail -20 "$OUTDIR/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ "$WHAT" = tests ]; then
    timeout 330 "$PY" -m pytest -q -m "gpu or cudasim" -p no:cacheprovider \
        -o addopts="--strict-markers -ra" 2>&1 | tee "$OUTDIR/tests.log" | grep -E "passed|failed|^FAILED|^ERROR" | tail -25
    BASE="${BASELINE:-$PWD/.baseline}"
    for round in 1 2; do
        for build in old new new-opt-in; do
            case $build in
                old) P="$BASE"; FLAGS="" ;;
                new) P="$PWD"; FLAGS="" ;;
                new-opt-in) P="$PWD"; FLAGS="--opt-in --only W2" ;;
            esac
            PYTHONPATH="$P" timeout 150 "$PY" benchmarks/compare_builds.py --label "${build%-opt-in}" \
                --rounds 7 $FLAGS 2>>"$OUTDIR/compare.err" | tee -a "$OUTDIR/compare.jsonl" >/dev/null
        done
    done
    "$PY" - "$OUTDIR/compare.jsonl" <<'PYEOF'
import json, sys, collections, statistics
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    d = json.loads(line)
    rows[(d["figure"], d["label"])].append(d["median_s"])
figs = sorted({f for f, _ in rows})
print(f"{'figure':58s} {'old':>10s} {'new':>10s} {'new opt-in':>10s} {'new/old':>8s}")
for f in figs:
    o = statistics.median(rows.get((f, "old"), [float("nan")]))
    n = statistics.median(rows.get((f, "new"), [float("nan")]))
    oi = statistics.median(rows.get((f, "new opt-in"), [float("nan")]))
    print(f"{f:58s} {o*1e3:10.3f} {n*1e3:10.3f} {oi*1e3:10.3f} {n/o:8.3f}")
PYEOF
else
    (cd benchmarks && timeout 540 "$PY" -m pytest -q -p no:cacheprovider ${BENCH_FILES:-bench_amg.py bench_w5_rhs.py bench_grad.py} ${BENCH_K:+-k "$BENCH_K"} \
        --benchmark-json="$(realpath "$OUTDIR")/bench.json" 2>&1 | tee "$(realpath "$OUTDIR")/bench.log" | tail -60)
fi
