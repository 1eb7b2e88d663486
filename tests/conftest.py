"""Tests are written once and run per device: cpu, the NPU (simulated unless real), and cuda/xpu/mps when present.

A pytest process tests the devices chosen by ``--devices`` (default ``auto``). The simulated NPU cannot share a
process with a real accelerator: once it is registered, a CUDA backward fails an autograd-engine assertion
(seen on an H100, torch 2.11), and it must be registered before the process's first backward, because the engine
sizes its per-device queues then. So ``auto`` means every real device plus the CPU, and the simulated NPU only on a
machine with no other accelerator; ``scripts/test.sh`` runs a second pass, ``--devices npu``, on such machines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from torchport.backends import get_backend
from torchport.testing import simulate_npu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ACCELERATORS = ("cuda", "xpu", "mps")
_selected: list[str] = []

# Without a GPU, Triton kernels run on CPU tensors under Triton's interpreter, so CI tests the kernel code itself.
# The variable must be set before the first kernel is decorated, i.e. before torchport.kernels.triton is imported.
if not get_backend("cuda").is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns a scalar into ``int`` with ``int(array)``, which NumPy >= 2.4 refuses for the
    one-element arrays it uses (loops with a run-time bound then fail); Triton 3.8 squeezes first. Same fix here."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:  # noqa: ANN001 - Triton's internal signature
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_triton_interpreter()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--devices", default="auto",
        help="comma-separated device types to test (cpu, npu, cuda, xpu, mps) or 'auto': every real device, and "
             "the simulated npu when no other accelerator is present",
    )
    parser.addoption(
        "--no-tuning", action="store_true",
        help="launch every Triton kernel with its heuristic configuration: no candidates timed, no tuning cache read "
             "or written (tests that turn tuning on themselves still do)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--no-tuning"):
        from torchport.kernels.triton import autotune

        autotune.set_enabled(False)
    real = [name for name in _ACCELERATORS if get_backend(name).is_available()]
    npu_real = get_backend("npu").is_available()
    choice = config.getoption("--devices")
    if choice == "auto":
        wanted = ["cpu"] + (["npu"] if npu_real or not real else []) + real
    else:
        wanted = [name.strip() for name in choice.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in ("cpu", "npu", *_ACCELERATORS)]
        if unknown:
            raise pytest.UsageError(f"--devices: unknown device type(s) {unknown}; valid: cpu, npu, cuda, xpu, mps")
        if "npu" in wanted and not npu_real and any(name in wanted for name in real):
            raise pytest.UsageError(
                "--devices: the simulated npu cannot share a process with a real accelerator; run two passes"
            )
        absent = [name for name in wanted if name in _ACCELERATORS and name not in real]
        if absent:
            raise pytest.UsageError(f"--devices: {absent} not available on this machine")
    if "npu" in wanted and not npu_real:
        simulate_npu()  # before any test runs a backward
    _selected[:] = wanted


def _use(kind: str) -> torch.device:
    if kind not in _selected:
        pytest.skip(f"{kind} is not tested in this pass (--devices {','.join(_selected)})")
    return get_backend(kind).device(0)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", _selected, indirect=True)


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device type tested in this pass, with index 0."""
    return _use(request.param)


@pytest.fixture
def npu() -> torch.device:
    """The NPU: a real one when torch_npu finds one, else the simulated one."""
    return _use("npu")


@pytest.fixture(params=list(DTYPES), ids=list(DTYPES))
def dtype(request: pytest.FixtureRequest, device: torch.device) -> torch.dtype:
    """fp32, bf16, fp16 on the device under test; skipped where the device lacks the dtype (by probe)."""
    chosen = DTYPES[request.param]
    if not get_backend(device.type).dtype_works(chosen, device.index or 0):
        pytest.skip(f"{chosen} does not work on {device} (dtype probe)")
    return chosen


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


# torch's gloo can abort a rank at interpreter exit, after the script's work and destroy_process_group() are done:
# "terminate called without an active exception", exit code -6. The plain-PyTorch port of the torchrun DDP tutorial
# (tests/compat/corpus_cpu/ddp_torchrun.py, no torchport involved) failed so in 2 of 30 launches with torch 2.13 on
# a 2-core machine, its result line already printed.
_EXIT_ABORT = "terminate called without an active exception"
_SIGABRT = re.compile(r"exitcode\s*:\s*-6\b")  # how torchrun's failure report names a rank killed by SIGABRT


def _launch_ranks(launch: Callable[[], subprocess.CompletedProcess[str]],
                  tries: int = 3) -> subprocess.CompletedProcess[str]:
    result = launch()
    for _ in range(tries - 1):
        if result.returncode == 0 or _EXIT_ABORT not in result.stderr or not _SIGABRT.search(result.stderr):
            break
        result = launch()
    return result


@pytest.fixture(scope="session")
def launch_ranks() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``launch_ranks(launch)``: ``launch()``, a torchrun launch returning its ``CompletedProcess``, run again (at most
    twice) while it fails only by a rank's abort at interpreter exit, a race in torch's gloo teardown that no script
    can avoid; any other failure, or that one three times, is returned as it is."""
    return _launch_ranks
