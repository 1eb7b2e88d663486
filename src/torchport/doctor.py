"""Health checks of this machine for torchport: torch build, devices, numerics against the CPU, memory, packages.

Library functions only: they return :class:`Check` results and print nothing, so ``torchport doctor`` and any
other front end show the same data.

Example:
    >>> from torchport.doctor import run_checks
    >>> [f"{c.device} {c.name}: {c.detail}" for c in run_checks("cpu") if not c.ok]
    []
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import torch
import torch.nn.functional as F

from . import _settings
from ._bytes import format_bytes
from .backends import Backend, get_backend
from .backends.npu import cann_version
from .device import device as selected_device
from .device import devices, resolve
from .info import torch_build

__all__ = ["Check", "MIN_TORCH", "OPTIONAL_PACKAGES", "REQUIRED_PACKAGES", "run_checks"]

MIN_TORCH = "2.9"  # the oldest torch with torch.accelerator's memory API
# Import name -> (what to pip install, what needs it). Looked up in package metadata, never imported (importing
# torch_npu registers a device). A missing one is skipped, not failed: torchport works without it.
OPTIONAL_PACKAGES = {
    "triton": ("triton", "the fused Triton kernels on GPUs"),
    "transformers": ("transformers", "patching Hugging Face models (torchport.patch)"),
    "torch_npu": ("torch-npu", "Ascend NPUs; take the release matching your torch, with CANN"),
    "onnxruntime": (None, "torchport bench --onnx and checking ONNX exports"),  # the package that fits the device
    "liger_kernel": ("liger-kernel", "the kernel benchmarks' comparison with Liger-Kernel"),
}
# Dependencies of torchport itself (pyproject.toml): a missing one fails.
REQUIRED_PACKAGES = ("numpy", "safetensors")
_ROUND_TRIP_BYTES = 16 * 2**20
# Largest max|device fp32 - cpu fp64| / max|cpu fp64| that passes. Measured fp32 errors: 1.1e-7 to 3.0e-7 on CPU
# (torch 2.13) and on an H100 (torch 2.11). Matmul, conv and the MLP may run in TF32 / HF32 (cuDNN and CANN allow
# it for convolutions by default): inputs rounded to a 10-bit mantissa give 2.6e-4, 3.8e-4 and 5.7e-4, so 5e-3
# passes those with a 10x margin while a wrong kernel (error near 1) fails. Softmax has no such path.
_TOLERANCE = {"matmul": 5e-3, "conv2d": 5e-3, "softmax": 1e-4, "autograd": 5e-3}


@dataclasses.dataclass(frozen=True)
class Check:
    """The outcome of one check: what was checked, on which device (None: the machine), and why it passed or not."""

    name: str
    device: str | None
    ok: bool
    detail: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    skipped: bool = False  # nothing to check (an optional package that is not installed); not a failure

    @property
    def status(self) -> str:
        """``"PASS"``, ``"FAIL"``, or ``"SKIP"`` for a check with nothing to check (which does not fail)."""
        if self.skipped:
            return "SKIP"
        return "PASS" if self.ok else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (values that JSON lacks, such as dtypes, are already strings)."""
        return {**dataclasses.asdict(self), "status": self.status}


def run_checks(device: str | None = None) -> list[Check]:
    """Run every check, on every device or only on ``device``; never raises for a failing check.

    Args:
        device: a device type or ``type:index`` to check alone, e.g. ``"npu:1"``; None checks all of
            :func:`torchport.devices`.

    Raises:
        ValueError, RuntimeError: ``device`` is not a device type, or this machine does not have it.

    Example:
        >>> all(c.ok for c in run_checks("cpu"))
        True
    """
    targets = [resolve(device, source="--device")] if device is not None else [
        (get_backend(d.type), d.index if d.index is not None else 0) for d in devices()
    ]
    checks = [
        _run("torch", None, _check_torch),
        _run("settings", None, _check_settings),
        _run("environment", None, _check_environment),
        _run("accelerators", None, _check_accelerators),
    ]
    for backend, index in targets:
        label = str(backend.device(index))
        checks.append(_run("device", label, functools.partial(_check_device, backend, index)))
        checks.append(_run("dtypes", label, functools.partial(_check_dtypes, backend, index)))
        if hasattr(backend, "chip"):  # a backend that knows its device's chips (Ascend)
            checks.append(_run("chip", label, functools.partial(_check_chip, backend, index)))
        for name, (make_inputs, compute) in _SMOKE_TESTS.items():
            checks.append(_run(name, label, functools.partial(_compare, name, backend, index, make_inputs, compute)))
        checks.append(_run("memory", label, functools.partial(_check_memory, backend, index)))
    checks.extend(_run(package, None, functools.partial(_check_package, package)) for package in OPTIONAL_PACKAGES)
    checks.extend(_run(package, None, functools.partial(_check_package, package)) for package in REQUIRED_PACKAGES)
    checks.append(_run("cann", None, _check_cann))
    return checks


# (passed, detail, data); passed is SKIPPED when there was nothing to check
Outcome = tuple[Any, str, dict[str, Any]]
SKIPPED = None


def _run(name: str, device: str | None, check: Callable[[], Outcome]) -> Check:
    try:
        ok, detail, data = check()
    except Exception as exc:  # a doctor reports a broken device; it must not be stopped by one
        message = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__
        return Check(name, device, False, detail, {"error": type(exc).__name__})
    if ok is SKIPPED:
        return Check(name, device, True, detail, data, skipped=True)
    return Check(name, device, ok, detail, data)


# -- the machine -------------------------------------------------------------------------------------------------
def _check_torch() -> Outcome:
    build = torch_build()
    toolkits = [f"{key} {value}" for key, value in build.items() if key not in ("version", "git", "debug") and value]
    detail = f"torch {build['version']}, built with {', '.join(toolkits) or 'no accelerator toolkit'}"
    if torch.__version__ < MIN_TORCH:
        return False, f"{detail}; torchport needs torch >= {MIN_TORCH}: pip install -U 'torch>={MIN_TORCH}'", build
    return True, detail, build


def _check_settings() -> Outcome:
    settings = dataclasses.asdict(_settings.get())  # raises ValueError naming the variable and the valid values
    chosen = str(selected_device())  # fails when TORCHPORT_DEVICE names a device this machine lacks
    return True, f"valid; torchport.device() picks {chosen}", {"settings": settings, "selected": chosen}


def _check_environment() -> Outcome:
    env = _settings.environment()
    detail = ", ".join(f"{key}={value}" for key, value in env.items()) or "no variable that matters to torchport is set"
    return True, detail, {"variables": env}


def _check_accelerators() -> Outcome:
    found = [str(d) for d in devices()]
    accelerators = found[:-1]  # devices() always ends with the CPU
    detail = ", ".join(found) if accelerators else "none; the cpu runs everything"
    return True, detail, {"devices": found}


def _check_package(package: str) -> Outcome:
    for distribution in metadata.packages_distributions().get(package, [package]):
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        return True, version, {"version": version, "distribution": distribution}
    if package not in OPTIONAL_PACKAGES:
        return False, f"not installed, and torchport needs it: pip install {package}", {"version": None}
    install, needed_for = OPTIONAL_PACKAGES[package]
    if install is None:  # onnxruntime: the build with the execution provider of this machine's first device
        from .export.runtime import onnxruntime_package

        install = onnxruntime_package(get_backend(devices()[0].type))
    detail = f"not installed: pip install {install} (needed only for {needed_for})"
    return SKIPPED, detail, {"version": None, "install": f"pip install {install}"}


def _check_cann() -> Outcome:
    version = cann_version()
    if version is None:
        return SKIPPED, "not installed (Ascend's CANN toolkit, needed only for Ascend NPUs)", {"version": None}
    return True, version, {"version": version}


# -- one device --------------------------------------------------------------------------------------------------
def _check_device(backend: Backend, index: int) -> Outcome:
    name = backend.device_name(index)
    memory = backend.mem_get_info(index)
    if memory is None:
        return True, f"{name}; memory not reported", {"name": name, "free": None, "total": None}
    free, total = memory
    data = {"name": name, "free": free, "total": total}
    return True, f"{name}; {format_bytes(free)} free of {format_bytes(total)}", data


def _check_dtypes(backend: Backend, index: int) -> Outcome:
    # Only float32 is required: a failing bf16 or fp16 changes the preferred dtype, which is reported.
    probes = backend.dtype_probes(index)
    preferred = _dtype_name(backend.preferred_dtype(index))
    parts = [
        f"{_dtype_name(p.dtype)} ok (error {p.max_error:.1e}, {p.ms:.2f} ms)" if p.works
        else f"{_dtype_name(p.dtype)} does not work ({p.error})"
        for p in probes.values()
    ]
    data = {"probes": {_dtype_name(p.dtype): p.to_dict() for p in probes.values()}, "preferred": preferred}
    if not probes[torch.float32].works:
        return False, f"float32 must work and does not; {'; '.join(parts)}", data
    return True, f"{'; '.join(parts)}; preferred {preferred}", data


def _check_chip(backend: Backend, index: int) -> Outcome:
    """What this chip runs of torchport: the kernels on a fused vendor operator, those on PyTorch operators (the
    chip lacks the operator, or there is none), and its dtypes; ``torchport coverage --device npu`` has the rest."""
    from .compile.chip_coverage import chip_coverage

    chip = backend.chip(index)  # type: ignore[attr-defined]
    if chip is None:
        name = backend.device_name(index)
        return True, (f"{name}: not a chip torchport has a profile of; fused operators are tried and a failing one "
                      f"falls back to the reference"), {"soc": name, "known": False}
    report = chip_coverage(chip)
    fused = [f"{row.kernel} ({row.operator})" for row in report.kernels if row.fused]
    lacking = [f"{row.kernel} -> {row.implementation} (no {row.operator})" for row in report.kernels
               if not row.fused and row.operator]
    dtypes = ", ".join(name if ok else f"no {name}" for name, ok in report.dtypes().items())
    detail = (f"{chip.soc_version} ({chip.family}); {dtypes}; fused: {', '.join(fused) or 'none'}; not on this chip: "
              f"{', '.join(lacking) or 'none'}; torchport coverage --device {backend.name} lists the limits")
    return True, detail, report.to_dict()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _matmul_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(67, 129, generator=gen), torch.randn(129, 45, generator=gen)]


def _conv2d_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(2, 3, 17, 19, generator=gen), torch.randn(8, 3, 3, 3, generator=gen)
    return [x, weight, torch.randn(8, generator=gen)]


def _softmax_inputs() -> list[torch.Tensor]:
    return [4 * torch.randn(33, 257, generator=torch.Generator().manual_seed(2))]


def _mlp_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x, target = torch.randn(16, 24, generator=gen), torch.randn(16, 6, generator=gen)
    w1, b1 = torch.randn(40, 24, generator=gen) / 5, torch.randn(40, generator=gen)
    w2, b2 = torch.randn(6, 40, generator=gen) / 6, torch.randn(6, generator=gen)
    return [x, target, w1, b1, w2, b2]


def _mlp_grads(x: torch.Tensor, target: torch.Tensor, *weights: torch.Tensor) -> Sequence[torch.Tensor]:
    w1, b1, w2, b2 = params = [w.detach().requires_grad_() for w in weights]
    loss = F.mse_loss(F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2), target)
    return torch.autograd.grad(loss, params)


_SMOKE_TESTS: dict[str, tuple[Callable[[], list[torch.Tensor]], Callable[..., Any]]] = {
    "matmul": (_matmul_inputs, torch.matmul),
    "conv2d": (_conv2d_inputs, lambda x, w, b: F.conv2d(x, w, b, padding=1)),
    "softmax": (_softmax_inputs, lambda x: torch.softmax(x, dim=-1)),
    "autograd": (_mlp_inputs, _mlp_grads),
}


def _compare(
    name: str, backend: Backend, index: int, make_inputs: Callable[[], list[torch.Tensor]], compute: Callable[..., Any]
) -> Outcome:
    """Run ``compute`` in float32 on the device and in float64 on the CPU; compare the results."""
    inputs = make_inputs()
    expected = compute(*(t.double() for t in inputs))
    got = compute(*(t.to(backend.device(index)) for t in inputs))
    backend.synchronize(index)
    pairs = zip(got, expected) if isinstance(expected, (tuple, list)) else [(got, expected)]
    error = max(_relative_error(g, e) for g, e in pairs)
    tolerance = _TOLERANCE[name]
    data = {"max_rel_error": error, "tolerance": tolerance}
    if not (math.isfinite(error) and error <= tolerance):
        return False, f"float32 differs from the cpu's float64 by {error:.2e} (tolerance {tolerance:.0e})", data
    return True, f"max relative error {error:.1e} (tolerance {tolerance:.0e})", data


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().clamp_min(1e-30)
    return ((got.to("cpu", torch.float64) - expected).abs().max() / scale).item()


def _check_memory(backend: Backend, index: int) -> Outcome:
    def allocated() -> int | None:
        backend.synchronize(index)
        return backend.memory_stats(index)["allocated"]

    gc.collect()  # else garbage from earlier checks, collected mid-check, hides part of the 16 MiB
    collecting = gc.isenabled()
    gc.disable()  # nor may an automatic collection run between the two readings
    try:
        before = allocated()
        block = torch.ones(_ROUND_TRIP_BYTES // 4, device=backend.device(index))
        during = allocated()
    finally:
        if collecting:
            gc.enable()
    del block
    gc.collect()
    after = allocated()
    backend.empty_cache()
    data = {"bytes": _ROUND_TRIP_BYTES, "before": before, "during": during, "after": after}
    size = _ROUND_TRIP_BYTES // 2**20
    if before is None or during is None or after is None:
        return True, f"allocated and freed {size} MiB; this device does not count allocated bytes", data
    # Tensors that other threads free meanwhile make the count grow by up to ``before`` bytes less (seen once: 4984
    # bytes); a counter that misses the allocation grows by about nothing, and still fails.
    if during - before < _ROUND_TRIP_BYTES - min(before, _ROUND_TRIP_BYTES // 2):
        return False, f"allocated {size} MiB but the allocated count grew by {during - before} bytes", data
    if after > before:
        return False, f"freed {size} MiB but {after - before} bytes stay counted as allocated", data
    return True, f"allocated {size} MiB (counted), freed it, count back to {after / 2**20:.1f} MiB", data


