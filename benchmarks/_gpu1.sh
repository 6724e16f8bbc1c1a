set -uo pipefail
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONUNBUFFERED=1
timeout 290 python3 -m pytest -q -m "gpu or cudasim" -p no:cacheprovider -o addopts="--strict-markers -ra" -x --timeout=120 > $OUT/tests.log 2>&1 || true
grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -15
cd benchmarks
timeout 150 python3 -m pytest -q -p no:cacheprovider bench_w5_rhs.py -k "gpu and not direct" --benchmark-json=$OUT/w5.json > $OUT/w5.log 2>&1; echo "w5 rc=$?"
timeout 120 python3 -m pytest -q -p no:cacheprovider bench_amg.py -k "auto" --benchmark-json=$OUT/auto.json > $OUT/auto.log 2>&1; echo "auto rc=$?"
cd ..
python3 - <<'PY'
import json, os
for f in ("w5.json", "auto.json"):
    p = os.path.join(os.environ["OUT"], f)
    if not os.path.exists(p): print("missing", f); continue
    for b in json.load(open(p))["benchmarks"]:
        e = b["extra_info"]
        keep = {k: e[k] for k in ("who", "iterations", "preconditioner", "throughput_ratio", "path", "cold_first_call_s", "k") if k in e}
        print(f"{b['name'][:60]:60s} median {b['stats']['median']*1e3:10.2f} ms {keep}")
PY
