#!/usr/bin/env bash
# Everything that needs a GPU, in one command (about 4 minutes on a bare H200, at most 8).
# Usage: bash scripts/gpu_check.sh OUT_DIR   (results: OUT_DIR/gpu_check.json, .log, pytest.txt)
set -euo pipefail
exec python3 "$(dirname "$0")/gpu_check.py" "${1:?usage: bash scripts/gpu_check.sh OUT_DIR}" "${@:2}"
