"""A pytest plugin that compiles every Triton kernel the tests launch for an NVIDIA GPU, on a machine without one.

The kernel tests run on CPU tensors as usual, but each Triton launch only compiles its kernel, down to the GPU's
machine code (Triton's own ``ptxas``), for the architecture ``--compile-only-arch`` (default 90: H100/H200), and
runs nothing. A new Triton release is checked this way before any GPU sees it: the interpreter
(``TRITON_INTERPRET=1``, the normal CPU test run) checks what the kernels compute, this checks that Triton's compiler
takes them.

    PYTHONPATH=scripts .venv/bin/python -m pytest -p compile_only --devices cpu -q --tb=no -k "not npu" \\
        tests/kernels tests/quant

The tests' own results mean nothing here (no kernel ran; ``torch.testing.assert_close`` and the kernel tests'
``check_close`` check nothing, so that a test goes on to its next launch), so the session's exit status is the
compiler's: 0 when every launch compiled, 1 otherwise. The last line names how many
launches of how many kernels compiled; ``--compile-only-record PATH`` writes them, and each distinct failure with its
traceback, as JSON. Kernels are named by module and name (two modules may each have a ``_fwd_kernel``). Where
torchport's launch passes a flag chosen for the CPU host, the variant an NVIDIA GPU runs is compiled instead:
``UPCAST`` off (float32 dots, for the interpreter) and ``ASM`` on for half-precision activations (the int4 kernel's
inline PTX decode).
"""

from __future__ import annotations

import collections
import json
import os
import traceback
from typing import Any

import pytest

# The kernels must be decorated as compiled kernels, not for the interpreter: off before anything imports Triton.
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_compiled: collections.Counter[str] = collections.Counter()
_failed: dict[tuple[str, str], str] = {}
_run = JITFunction.run


class _NoDevice:
    """Triton's driver, as far as compiling needs one: a device 0 of the chosen architecture."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def _compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
    if kwargs.get("UPCAST"):
        kwargs["UPCAST"] = False
    if kwargs.get("ASM") is False and args and getattr(args[0], "dtype", None) in (torch.bfloat16, torch.float16):
        kwargs["ASM"] = True
    name = f"{self.__module__}.{self.__name__}"
    try:
        kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    except Exception as exc:
        _failed.setdefault((name, f"{type(exc).__name__}: {exc}"[:2000]), traceback.format_exc()[-4000:])
        raise
    _compiled[name] += 1
    return kernel


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("compile-only", "compile the Triton kernels for a GPU and run nothing")
    group.addoption("--compile-only-arch", type=int, default=90,
                    help="the NVIDIA architecture to compile for, e.g. 80 (A100), 90 (H100/H200), 100 (B200)")
    group.addoption("--compile-only-record", default=None, help="write the compiled kernels and the failures here")


def pytest_configure(config: pytest.Config) -> None:
    driver.set_active(_NoDevice(config.getoption("--compile-only-arch")))
    JITFunction.run = _compile_only
    # torchport's kernels exist now, compiled ones; its direct launcher needs a loaded kernel: Triton's path instead
    import importlib
    import pkgutil

    import torchport.kernels.triton as package
    from torchport.kernels.triton import launch

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")

    def through_triton(self: launch.Kernel, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        self.fn[grid](*args, **meta)

    launch.Kernel.launch = through_triton
    launch.Kernel.prepare = lambda self, *args, **meta: None
    torch.testing.assert_close = lambda *args, **kwargs: None


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Any:
    # kernels that test modules define are decorated while they are collected: as compiled kernels too
    result = yield
    # the tests themselves run Triton on CPU tensors only under the interpreter's variable
    os.environ["TRITON_INTERPRET"] = "1"
    return result


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # the kernel tests' own comparison (tests/kernels/kernel_cases.py) stops a test at its first launch otherwise
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        if hasattr(module, "check_close"):
            module.check_close = lambda *args, **kwargs: None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    arch = session.config.getoption("--compile-only-arch")
    record = session.config.getoption("--compile-only-record")
    if record:
        with open(record, "w") as f:
            json.dump({"triton": triton.__version__, "arch": arch, "compiled": dict(_compiled),
                       "failed": [{"kernel": name, "error": error, "traceback": tb}
                                  for (name, error), tb in _failed.items()]}, f, indent=1)
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = 1 if _failed or not _compiled else 0  # else: interrupted, or pytest's own error


def pytest_terminal_summary(terminalreporter: Any) -> None:
    arch = terminalreporter.config.getoption("--compile-only-arch")
    terminalreporter.write_line(
        f"compile-only: Triton {triton.__version__}, sm_{arch}: {sum(_compiled.values())} launches of "
        f"{len(_compiled)} kernels compiled; {len(_failed)} distinct failures"
        + "".join(f"\n  {name}: {error.splitlines()[0]}" for name, error in _failed))
