#!/usr/bin/env bash
# Set up, then run a training script written for CUDA, unchanged, on whatever device this machine has
# (Ascend NPU, GPU, or CPU), and show what torchport redirected.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/torchport run --report examples/train_cuda.py "$@"
