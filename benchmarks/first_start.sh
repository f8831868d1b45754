#!/usr/bin/env bash
# Start to ready of `ridgeline serve` on the embedded model: first on a fresh machine (no
# converted GGUF, no built C++ kernels: both caches empty), then warm (the same caches,
# the files in the page cache), ROUNDS times each, alternating. Writes a JSON.
#
#   benchmarks/first_start.sh [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_results/first_start.json}
ROUNDS=${ROUNDS:-2}
PORT=${PORT:-8300}
WORK=$(mktemp -d /tmp/ridgeline-first-start.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$(dirname "$OUT")"

# Seconds from launch to the first 200 on /health, with the given cache directories.
ready_after() {
  local models=$1 kernels=$2 start pid took
  start=$(date +%s.%N)
  RIDGELINE_CACHE_DIR=$models TORCH_EXTENSIONS_DIR=$kernels \
    ridgeline serve --port "$PORT" > "$WORK/server.log" 2>&1 &
  pid=$!
  until curl -sf -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/health"; do
    kill -0 "$pid" 2>/dev/null || { cat "$WORK/server.log" >&2; return 1; }
    sleep 0.1
  done
  took=$(python -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" \
    "$start" "$(date +%s.%N)")
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
  echo "$took"
}

fresh=() warm=()
for ((i = 0; i < ROUNDS; i++)); do
  rm -rf "$WORK/models" "$WORK/kernels"
  fresh+=("$(ready_after "$WORK/models" "$WORK/kernels")")
  warm+=("$(ready_after "$WORK/models" "$WORK/kernels")")
done
dtype=$(grep -o "dtype [a-z0-9]* (auto[^)]*)" "$WORK/server.log" | head -1 || true)
python - "$OUT" "$dtype" "${fresh[*]}" "${warm[*]}" <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from host import describe
out, dtype, fresh, warm = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
report = {"what": "ridgeline serve, embedded model, start to ready (s): fresh = GGUF "
          "converted and C++ kernels built in this start; warm = both cached",
          **describe(), "dtype": dtype,
          "fresh_s": [float(x) for x in fresh], "warm_s": [float(x) for x in warm]}
print(json.dumps(report, indent=1))
open(out, "w").write(json.dumps(report, indent=1) + "\n")
PY
