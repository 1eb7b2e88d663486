#!/usr/bin/env bash
# Set up, then run the test suite on every device this machine can test (cpu, simulated npu, cuda when present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest "$@"
