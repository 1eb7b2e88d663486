#!/usr/bin/env bash
# Set up, then run the demo on whatever device this machine has (NPU, GPU, or CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/device_tour.py "$@"
