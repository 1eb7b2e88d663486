#!/usr/bin/env bash
# Set up, then run the test suite on every device this machine can test: cpu and the simulated npu, plus
# cuda/xpu/mps when present. The simulated npu cannot share a process with a real accelerator (tests/conftest.py
# says why), so on such machines it gets a second pytest pass of its own.
#
# Usage: scripts/test.sh [--latest] [PYTEST ARGS]      e.g. scripts/test.sh -m "not slow" -x
#   --latest   test the newest releases of every dependency instead of constraints.txt (in .venv-latest)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv setup=(bash scripts/setup.sh)
if [ "${1:-}" = "--latest" ]; then
    venv=.venv-latest setup+=(--latest)
    shift
fi
"${setup[@]}" test
"$venv/bin/python" -m pytest "$@"
if "$venv/bin/python" -c "
import sys
from torchport.backends import get_backend
others = any(get_backend(name).is_available() for name in ('cuda', 'xpu', 'mps'))
sys.exit(0 if others and not get_backend('npu').is_available() else 1)
"; then
    "$venv/bin/python" -m pytest --devices npu "$@"
fi
