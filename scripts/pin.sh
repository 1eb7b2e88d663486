#!/usr/bin/env bash
# Write constraints.txt from a virtual environment's installed packages (default .venv-latest, after
# `scripts/test.sh --latest` passed): the exact versions CI and scripts/setup.sh install from then on.
# torch is left out (setup.sh pins it, and GPU/NPU machines bring their own build), and so is torchport itself.
#
# Usage: scripts/pin.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-latest}"
if [ ! -x "$venv/bin/python" ]; then
    echo "pin: $venv has no python; create it first with: bash scripts/test.sh --latest" >&2
    exit 2
fi
{
    echo "# Exact versions of everything CI and scripts/setup.sh install (torch itself is pinned in scripts/setup.sh)."
    echo "# Written by scripts/pin.sh from $venv; Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())')."
    echo "# Test the newest releases instead: bash scripts/test.sh --latest"
    "$venv/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check 2>/dev/null \
        | grep -v -i -E '^(torch|torchport|pip|nvidia-[a-z0-9-]+)(==| @)'
    # the build backend of torchport's own editable install (pyproject.toml's build-system)
    echo "setuptools==$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("setuptools"))')"
} > constraints.txt
echo "pin: wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages) from $venv"
