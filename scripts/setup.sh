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
# The dashboard's browser test drives the system's Chromium (tests/ui/test_browser.py). For the test extras, install
# it where this can (root with apt, e.g. a fresh CI machine); anywhere else that one test is skipped with the reason.
if [[ ",$extras," == *",test,"* ]] && ! command -v chromedriver >/dev/null 2>&1 \
        && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing chromium and chromium-driver (Debian packages) for the browser test"
    log="$(mktemp)"
    if ! (export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq chromium chromium-driver) \
            >"$log" 2>&1; then
        tail -n 5 "$log" >&2
        echo "setup: chromium could not be installed; the browser test will be skipped" >&2
    fi
    rm -f "$log"
fi
