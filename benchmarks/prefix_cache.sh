#!/usr/bin/env bash
# The chat-like load with the prefix cache on and off, side by side on one machine:
# every prompt starts with one 768-token system prompt, then a 64-token question; 64
# tokens out; 16 at a time (vllm bench serve's flags). Runs alternate on/off, twice.
#   benchmarks/prefix_cache.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-bench_results/prefix_cache}
mkdir -p "$OUT"
LOAD=(--random-prefix-len 768 --random-input-len 64 --random-output-len 64 --ignore-eos
      --num-prompts 48 --max-concurrency 16 --disable-tqdm --no-plots --result-dir "$OUT")
serve() {  # port, extra flags...
  local port=$1; shift
  ridgeline serve --dtype bfloat16 --port "$port" "$@" > "$OUT/server_$port.log" 2>&1 &
  echo $! > "$OUT/pid_$port"
  for _ in $(seq 1 180); do curl -sf "localhost:$port/health" > /dev/null && return 0; sleep 1; done
  return 1
}
hit_rate() {  # port: prefix-cache hits / queries from the server's own counters
  curl -s "localhost:$1/metrics" | awk '/^ridgeline:prefix_cache_(hits|queries)_total/ {
    if ($1 ~ /hits/) h += $2; else q += $2 } END { printf "%.3f", (q ? h / q : 0) }'
}
serve 8301
serve 8302 --no-enable-prefix-caching
for round in 1 2; do
  for port in 8301 8302; do
    curl -sf -X POST "localhost:$port/reset_prefix_cache" > /dev/null
    ridgeline bench serve --port "$port" "${LOAD[@]}" --result-filename "run${round}_$port.json" \
      > "$OUT/run${round}_$port.txt"
    echo "round $round port $port hit_rate_so_far $(hit_rate "$port")"
  done
done
kill -TERM "$(cat "$OUT/pid_8301")" "$(cat "$OUT/pid_8302")"
python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'run':<18}{'cache':<7}{'TTFT med ms':>12}{'TTFT p99 ms':>12}{'out tok/s':>10}{'wall s':>8}")
for f in sorted(out.glob("run*.json")):
    d = json.loads(f.read_text())
    cache = "on" if "8301" in f.name else "off"
    print(f"{f.stem:<18}{cache:<7}{d['median_ttft_ms']:>12.0f}{d['p99_ttft_ms']:>12.0f}"
          f"{d['output_throughput']:>10.1f}{d['duration']:>8.1f}")
PY
