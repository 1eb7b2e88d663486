"""Fixtures for the `torchport run` tests: a runner of `python -m torchport run` in a fresh process."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def torchport_run(run_python: Callable[..., subprocess.CompletedProcess[str]]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``torchport_run(*args, cwd=..., env={...})``: ``python -m torchport run *args``, as ``run_python`` runs it."""

    def run(*args: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run_python("-m", "torchport", "run", *args, cwd=cwd, env=env, timeout=timeout)

    return run
