"""NVIDIA GPUs through CUDA, and AMD GPUs through ROCm (PyTorch exposes HIP as ``torch.cuda``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import register_backend
from .base import Backend

__all__ = ["CudaBackend"]


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

    @property
    def visible_devices_variable(self) -> str:  # type: ignore[override]
        return "HIP_VISIBLE_DEVICES" if torch.version.hip else "CUDA_VISIBLE_DEVICES"

    def module(self):
        return torch.cuda

    def dynamo_compiler(self) -> tuple[str, Callable[..., Any] | None]:
        # Inductor generates Triton (GPU) or C++/OpenMP (CPU) code for this device type.
        from torch._dynamo.backends.registry import lookup_backend

        return "inductor", lookup_backend("inductor")

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

    def versions(self) -> dict[str, str | None]:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if torch.version.hip:
            return {"rocm_hip": torch.version.hip, "miopen": None if cudnn is None else str(cudnn)}
        return {"cuda_runtime": torch.version.cuda, "driver": _nvidia_driver(),
                "cudnn": None if cudnn is None else str(cudnn)}

    @property
    def onnxruntime_package(self) -> str:  # type: ignore[override]
        return "onnxruntime-migraphx" if torch.version.hip else "onnxruntime-gpu"

    def onnx_providers(self, index: int, options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        # On ROCm, onnxruntime runs AMD GPUs through MIGraphX (its ROCm provider was removed in 1.23).
        name = "MIGraphXExecutionProvider" if torch.version.hip else "CUDAExecutionProvider"
        return [(name, {"device_id": index, **options}), ("CPUExecutionProvider", {})]
