#!/usr/bin/env bash
# The whole GPU suite in one go: install, GPU tests, benchmarks, report.
#   bash benchmarks/run_gpu_suite.sh [OUTDIR] [extra pytest args for the benchmarks]
# Writes OUTDIR/{tests.log, bench.log, bench.json, report.md, report.png} and
# prints the report table last. OUTDIR defaults to $OUT, else out/gpu-<date>.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-out/gpu-$(date +%Y%m%d-%H%M%S)}}"
shift || true
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# Multi-GPU hosts here keep NVLink multicast off (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

"$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUTDIR/install.log" 2>&1 \
    || { echo "install failed"; tail -20 "$OUTDIR/install.log"; exit 1; }
nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv \
    | tee "$OUTDIR/gpus.csv"

echo "== GPU tests"
"$PY" -m pytest -q -m "gpu or multi_gpu or cudasim" -p no:cacheprovider ${TEST_ARGS:-} 2>&1 \
    | tee "$OUTDIR/tests.log" | tail -40
test_rc=${PIPESTATUS[0]}

echo "== benchmarks"
(cd benchmarks && "$PY" -m pytest -q -p no:cacheprovider --benchmark-json="$(realpath "$OUTDIR")/bench.json" "$@") \
    >"$OUTDIR/bench.log" 2>&1
bench_rc=$?
tail -60 "$OUTDIR/bench.log"

echo "== report"
"$PY" benchmarks/report.py "$OUTDIR/bench.json" --out "$OUTDIR" || true
echo "tests rc=$test_rc benchmarks rc=$bench_rc; logs in $OUTDIR"
exit $(( test_rc != 0 || bench_rc != 0 ))
