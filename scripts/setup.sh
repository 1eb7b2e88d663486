#!/usr/bin/env bash
# Create .venv (once) and install torchport into it. Usage: scripts/setup.sh [EXTRAS], e.g. scripts/setup.sh test
# torch is installed first and pinned, so pip takes the CPU build instead of resolving a bare "torch" to the
# multi-GB CUDA packages; on a GPU or NPU machine, install your torch build into .venv before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
