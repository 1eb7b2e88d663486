"""Fixtures for the `torchport run` tests: a clean environment and a runner for fresh python processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# Variables that would change what a child process does, whatever the test asks: torchport's own settings, and
# those of a torchrun launch that may surround the pytest process.
_LAUNCH_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"}


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without TORCHPORT_* and torchrun variables, plus ``extra``."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("TORCHPORT_") and key not in _LAUNCH_VARS}
    return {**env, "COLUMNS": "200", **extra}


def _run_python(*args: str, cwd: Path, env: dict[str, str] | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_clean_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def run_python() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_python(*args, cwd=..., env={...})``: ``python *args`` in a fresh process, with the environment cleaned of
    TORCHPORT_* and torchrun variables and ``env`` added; output captured as text; 120 s timeout by default."""
    return _run_python


@pytest.fixture(scope="session")
def torchport_run() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``torchport_run(*args, cwd=..., env={...})``: ``python -m torchport run *args``, as ``run_python`` runs it."""

    def run(*args: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return _run_python("-m", "torchport", "run", *args, cwd=cwd, env=env, timeout=timeout)

    return run
