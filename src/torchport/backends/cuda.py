"""NVIDIA GPUs through CUDA, and AMD GPUs through ROCm (PyTorch exposes HIP as ``torch.cuda``)."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from typing import Any

import torch

from . import register_backend
from .base import Backend

__all__ = ["CudaBackend"]

logger = logging.getLogger("torchport")

# flash-attn packages: (module, distribution, lowest version transformers accepts) -> importable or not, per process
_FLASH_PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn", (2, 3, 3)),
                   "flash_attention_3": ("flash_attn_interface", "flash-attn-3", None)}
_flash_found: dict[str, bool] = {}


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _flash_attn(implementation: str) -> bool:
    """Whether the flash-attn package behind ``implementation`` is installed under the distribution name and version
    that transformers accepts, and imports (a wheel built for another torch fails here, with undefined symbols)."""
    if implementation not in _flash_found:
        module, distribution, minimum = _FLASH_PACKAGES[implementation]
        try:
            version = importlib.metadata.version(distribution)
            if minimum is not None and _version(version) < minimum:
                raise ImportError(f"{distribution} {version} is older than {'.'.join(map(str, minimum))}")
            importlib.import_module(module)
            _flash_found[implementation] = True
        except Exception as exc:  # not installed, too old, or built against another torch / CUDA
            logger.info("%s is not used: %s: %s", implementation, type(exc).__name__, exc)
            _flash_found[implementation] = False
    return _flash_found[implementation]


# TF32 switches as (read, write, value that enables TF32). The legacy booleans come first: once torch's newer
# fp32_precision API has been written, reading the legacy flags raises "you have used mix of the legacy and new
# APIs" (torch 2.13), and programs and libraries still read them. A program that already uses the new API keeps it.
_TF32_LEGACY = {
    "torch.backends.cuda.matmul.allow_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                                              lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v), True),
    "torch.backends.cudnn.allow_tf32": (lambda: torch.backends.cudnn.allow_tf32,
                                        lambda v: setattr(torch.backends.cudnn, "allow_tf32", v), True),
}
_TF32_NEW = {
    "torch.backends.cuda.matmul.fp32_precision": (
        lambda: torch.backends.cuda.matmul.fp32_precision,
        lambda v: setattr(torch.backends.cuda.matmul, "fp32_precision", v), "tf32"),
    "torch.backends.cudnn.conv.fp32_precision": (
        lambda: torch.backends.cudnn.conv.fp32_precision,
        lambda v: setattr(torch.backends.cudnn.conv, "fp32_precision", v), "tf32"),
}


def _nvidia_driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            first = f.readline()
    except OSError:
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
    for word in first.split():
        if word[:1].isdigit() and "." in word:
            return word
    return None


@register_backend("cuda")
class CudaBackend(Backend):
    name = "cuda"
    dist_backend = "nccl"  # on ROCm, RCCL answers to the same name
    safetensors_direct = True
    profiler_activity = "CUDA"
    dispatch_key = "CUDA"  # ROCm builds register their kernels under CUDA too
    _no_utilization = False

    @property
    def visible_devices_variable(self) -> str:  # type: ignore[override]
        return "HIP_VISIBLE_DEVICES" if torch.version.hip else "CUDA_VISIBLE_DEVICES"

    def module(self):
        return torch.cuda

    def dynamo_compiler(self) -> tuple[str, Callable[..., Any] | None]:
        # Inductor generates Triton (GPU) or C++/OpenMP (CPU) code for this device type.
        from torch._dynamo.backends.registry import lookup_backend

        return "inductor", lookup_backend("inductor")

    def attention_implementation(self, index: int) -> str:
        # flash-attn where it is installed and built for this GPU: FlashAttention-3 on Hopper (sm_90; its kernels use
        # wgmma and TMA), FlashAttention-2 from Ampere (sm_80) on, and on ROCm where its ROCm build is installed.
        # Otherwise SDPA, which runs PyTorch's own flash / cuDNN / memory-efficient kernels.
        major, _ = torch.cuda.get_device_capability(index)
        if not torch.version.hip and major == 9 and _flash_attn("flash_attention_3"):
            return "flash_attention_3"
        if (torch.version.hip or major >= 8) and _flash_attn("flash_attention_2"):
            return "flash_attention_2"
        return "sdpa"

    def enable_tf32(self, index: int) -> dict[str, Any] | None:
        # TF32 tensor cores arrived with Ampere (sm_80). On ROCm, hipBLASLt decides through its own environment
        # variable (HIPBLASLT_ALLOW_TF32), which a running process cannot switch.
        if torch.version.hip or torch.cuda.get_device_capability(index) < (8, 0):
            return None
        switches = _TF32_LEGACY
        try:
            previous = {name: read() for name, (read, _, _) in switches.items()}
        except RuntimeError:  # the program set precisions through the new API
            switches = _TF32_NEW
            previous = {name: read() for name, (read, _, _) in switches.items()}
        for _, write, on in switches.values():
            write(on)
        return previous

    def restore_tf32(self, previous: dict[str, Any]) -> None:
        switches = {**_TF32_LEGACY, **_TF32_NEW}
        unknown = sorted(set(previous) - set(switches))
        if unknown:
            raise ValueError(f"unknown TF32 switch(es) {', '.join(unknown)}; known: {', '.join(switches)}")
        for name, value in previous.items():
            switches[name][1](value)

    def preferred_conv_memory_format(self, index: int) -> torch.memory_format:
        # Tensor Cores (compute capability 7.0 and later) compute convolutions in NHWC; NVIDIA's convolution guide
        # recommends NHWC "where possible", cuDNN transposes NCHW tensors around each convolution otherwise. On
        # ROCm, PyTorch sends NHWC convolutions to MIOpen only under PYTORCH_MIOPEN_SUGGEST_NHWC (ConvUtils.h):
        # a channels-last tensor would be converted back, so the default format stays.
        if torch.version.hip:
            return torch.contiguous_format
        return torch.channels_last if torch.cuda.get_device_capability(index) >= (7, 0) else torch.contiguous_format

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if torch.version.cuda is None and torch.version.hip is None:
            return f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA or ROCm build of torch"
        return super().unavailable_reason()

    def properties(self, index: int) -> dict[str, Any]:
        out = super().properties(index)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(index)))
        out["vendor"] = "AMD" if torch.version.hip else "NVIDIA"
        return out

    def utilization(self, index: int) -> float | None:
        # torch.cuda.utilization reads NVML (the pynvml package) or, on ROCm, amdsmi; without them, or where the
        # driver refuses the query, there is no reading. A failure is remembered: the dashboard asks every second.
        if self._no_utilization:
            return None
        try:
            return float(torch.cuda.utilization(index))
        except Exception:  # ModuleNotFoundError without pynvml/amdsmi, NVMLError from the driver
            self._no_utilization = True
            return None

    def versions(self) -> dict[str, str | None]:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if torch.version.hip:
            return {"rocm_hip": torch.version.hip, "miopen": None if cudnn is None else str(cudnn)}
        return {"cuda_runtime": torch.version.cuda, "driver": _nvidia_driver(),
                "cudnn": None if cudnn is None else str(cudnn)}

    @property
    def onnx_provider(self) -> str:  # type: ignore[override]
        # On ROCm, onnxruntime runs AMD GPUs through MIGraphX (its ROCm provider was removed in 1.23).
        return "MIGraphXExecutionProvider" if torch.version.hip else "CUDAExecutionProvider"
