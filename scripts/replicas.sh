#!/usr/bin/env bash
# N Ridgeline replicas behind vllm-router, on this machine; Ctrl-C stops them all.
#   scripts/replicas.sh --replicas 2 --policy cache_aware -- --model DIR --max-num-seqs 32
# Needs `pip install 'ridgeline[engine,router]'`. See docs/scale-out.md.
set -euo pipefail
exec ridgeline replicas "$@"
