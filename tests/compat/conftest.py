"""Fixtures for the shim's tests: the shim patched for the test's device, and a runner of `python -m torchport run`
in a fresh process."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from torchport import compat


@pytest.fixture(scope="session")
def torchport_run(run_python: Callable[..., subprocess.CompletedProcess[str]]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``torchport_run(*args, cwd=..., env={...})``: ``python -m torchport run *args``, as ``run_python`` runs it."""

    def run(*args: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run_python("-m", "torchport", "run", *args, cwd=cwd, env=env, timeout=timeout)

    return run


@pytest.fixture
def shim(device: torch.device):
    """The shim patched for the test's device (the device itself), undone after the test; skipped on CUDA, where it
    has nothing to redirect."""
    if device.type == "cuda":
        pytest.skip("on CUDA the shim has nothing to redirect")
    compat.patch(device)
    yield device
    compat.unpatch()
