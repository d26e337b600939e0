#!/usr/bin/env bash
# Install shardmerge with its test-only packages (torch pinned by constraints.txt), then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q -c constraints.txt -e ".[test]"
# verl's own checkpoint writer and merger are used as references; installed without its (GPU) dependencies.
"$PY" -m pip install -q --no-deps -c constraints.txt "verl==0.9.1"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec "$PY" -m pytest -q "$@"
