#!/usr/bin/env bash
# Set up, then run the test suite on every device this machine can test: cpu and the simulated npu, plus
# cuda/xpu/mps when present. The simulated npu cannot share a process with a real accelerator (tests/conftest.py
# says why), so on such machines it gets a second pytest pass of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/python -m pytest "$@"
if .venv/bin/python -c "
import sys
from torchport.backends import get_backend
others = any(get_backend(name).is_available() for name in ('cuda', 'xpu', 'mps'))
sys.exit(0 if others and not get_backend('npu').is_available() else 1)
"; then
    .venv/bin/python -m pytest --devices npu "$@"
fi
