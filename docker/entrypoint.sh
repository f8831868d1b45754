#!/usr/bin/env bash
# The container's entry point: `ridgeline serve --host 0.0.0.0`, with RIDGELINE_* environment
# variables mapped to flags. Arguments given after the image name (`docker run IMAGE --seed 3`)
# come after the mapped ones, so they win. docker/README.md documents every variable and
# tests/test_docker.py checks that each flag below exists in `ridgeline serve --help`.
#
# RIDGELINE_API_KEY, RIDGELINE_ADMIN_API_KEY and RIDGELINE_CACHE_DIR are read by Ridgeline
# itself, not mapped here: a key passed as a flag would show in the process list.
set -euo pipefail

# VARIABLE=--flag, one per line.
MAPPING=(
  RIDGELINE_MODEL=--model
  RIDGELINE_SERVED_MODEL_NAME=--served-model-name
  RIDGELINE_DTYPE=--dtype
  RIDGELINE_MAX_MODEL_LEN=--max-model-len
  RIDGELINE_MAX_NUM_SEQS=--max-num-seqs
  RIDGELINE_MAX_NUM_BATCHED_TOKENS=--max-num-batched-tokens
  RIDGELINE_MAX_QUEUED_REQUESTS=--max-queued-requests
  RIDGELINE_GPU_MEMORY_UTILIZATION=--gpu-memory-utilization
  RIDGELINE_KV_CACHE_MEMORY=--kv-cache-memory
  RIDGELINE_BLOCK_SIZE=--block-size
  RIDGELINE_PREEMPTION_POLICY=--preemption-policy
  RIDGELINE_ATTENTION_BACKEND=--attention-backend
  RIDGELINE_SEED=--seed
  RIDGELINE_SHUTDOWN_TIMEOUT=--shutdown-timeout
  RIDGELINE_LOG_STATS_INTERVAL=--log-stats-interval
  RIDGELINE_MAX_REQUEST_BODY_BYTES=--max-request-body-bytes
  RIDGELINE_ALLOWED_HOSTS=--allowed-hosts
)

args=(--host "${RIDGELINE_HOST:-0.0.0.0}" --port "${RIDGELINE_PORT:-8000}")
for pair in "${MAPPING[@]}"; do
  var=${pair%%=*}
  flag=${pair#*=}
  if [[ -n "${!var:-}" ]]; then
    args+=("$flag" "${!var}")
  fi
done
# A switch, not a value: RIDGELINE_ENFORCE_EAGER=1 adds it.
if [[ "${RIDGELINE_ENFORCE_EAGER:-0}" == 1 ]]; then
  args+=(--enforce-eager)
fi

exec ridgeline serve "${args[@]}" "$@"
