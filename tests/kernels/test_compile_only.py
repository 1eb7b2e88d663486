"""scripts/compile_only.py: the kernel tests, run with it, compile their Triton kernels for an NVIDIA GPU (sm_90) on a
machine without one, and its exit status is the compiler's.

One kernel file's tests compile here (RoPE's: one kernel, a few specialisations); the whole of tests/kernels takes
minutes, and is a documented command (docs/testing.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """pytest with the plugin on ``args``; its completed process and the plugin's record."""
    record = tmp_path / "record.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("TORCHPORT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts"), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compiled afresh, not found in a cache
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "compile_only", "-p", "no:cacheprovider", "-q", "--tb=no",
         "--compile-only-record", str(record), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert record.exists(), f"no record written (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc, json.loads(record.read_text())


def test_the_rope_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    proc, record = _run(tmp_path, "--devices", "cpu", "tests/kernels/test_rope.py", "-k", "triton")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert record["arch"] == 90 and record["failed"] == []
    assert record["compiled"].get("torchport.kernels.triton.rope._rope_kernel", 0) > 0, record
    assert "compile-only: Triton" in proc.stdout and "0 distinct failures" in proc.stdout


def test_a_kernel_the_compiler_refuses_fails_the_run(tmp_path: Path) -> None:
    """A kernel that does not compile makes the exit status 1 and is named, with Triton's error, in the record."""
    test = tmp_path / "test_broken_kernel.py"
    test.write_text(
        "import torch\n"
        "import triton\n"
        "import triton.language as tl\n\n\n"
        "@triton.jit\n"
        "def broken_kernel(X):\n"
        "    tl.store(X + tl.arange(0, 3), 1.0)  # a range that is not a power of two\n\n\n"
        "def test_launch():\n"
        "    broken_kernel[(1,)](torch.zeros(4))\n")
    proc, record = _run(tmp_path, str(test), "--rootdir", str(tmp_path))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [f["kernel"].rpartition(".")[2] for f in record["failed"]] == ["broken_kernel"]
    assert "broken_kernel" in proc.stdout
