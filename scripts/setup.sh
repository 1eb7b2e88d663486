#!/usr/bin/env bash
# Create a virtual environment (once) and install torchport into it.
#
# Usage: scripts/setup.sh [--latest] [EXTRAS]        e.g. scripts/setup.sh test
#
#   (default)   .venv, every package at the exact version in constraints.txt: a release upstream cannot change
#               what is tested.
#   --latest    .venv-latest, every package upgraded to its newest release (torch stays at the pinned build), then
#               the versions that differ from constraints.txt are listed. scripts/pin.sh .venv-latest writes them
#               into constraints.txt once the tests pass with them.
#
# torch is installed first and pinned, so pip takes the CPU build instead of resolving a bare "torch" to the
# multi-GB CUDA packages; on a GPU or NPU machine, install your torch build into the venv before running this
# (constraints.txt pins no torch, so yours stays).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv latest=0
if [ "${1:-}" = "--latest" ]; then
    venv=.venv-latest latest=1
    shift
fi
extras="${1:-}"
torch_pin="torch==2.13.0"
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "${pip[@]}" "$torch_pin"
fi
if [ "$latest" = 1 ]; then
    # every package upgraded but torch: the installed build is held (an eager upgrade would otherwise replace the
    # CPU build with the newest CUDA one, several GB, as soon as no other pin holds it back)
    torch_now="$("$venv/bin/python" -c "from importlib.metadata import version; print(version('torch'))")"
    "${pip[@]}" --upgrade --upgrade-strategy eager -c <(echo "torch==$torch_now") -e ".${extras:+[$extras]}"
    echo "setup: versions in $venv that differ from constraints.txt:"
    "$venv/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check 2>/dev/null \
        | grep -v -i -x -F -f constraints.txt | grep -v -i '^torch==' || echo "  (none)"
else
    # PIP_CONSTRAINT also reaches the isolated build of torchport itself (setuptools); -c alone would not
    PIP_CONSTRAINT="$PWD/constraints.txt" "${pip[@]}" -c constraints.txt -e ".${extras:+[$extras]}"
fi
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
