#!/usr/bin/env bash
# Everything that needs a GPU, in one command (at most about 6 minutes on a bare H200).
# Usage: bash scripts/gpu_check.sh OUT_DIR [--tokenizer DIR] [--layers N] [--budget-s S]
# Results: OUT_DIR/gpu_check.json (one JSON), gpu_check.log, pytest.txt; one table on stdout.
set -euo pipefail
# Compiled kernels go to a fresh writable folder unless one is given.
TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$(mktemp -d -t ridgeline-triton-XXXXXX)}"
export TRITON_CACHE_DIR
exec python3 "$(dirname "$0")/gpu_check.py" "${1:?usage: bash scripts/gpu_check.sh OUT_DIR}" "${@:2}"
