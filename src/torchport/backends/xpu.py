"""Intel GPUs through ``torch.xpu`` (SYCL / Level Zero)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import register_backend
from .base import Backend

__all__ = ["XpuBackend"]


@register_backend("xpu")
class XpuBackend(Backend):
    name = "xpu"
    dist_backend = "xccl"
    visible_devices_variable = "ZE_AFFINITY_MASK"
    safetensors_direct = True
    profiler_activity = "XPU"
    dispatch_key = "XPU"

    def is_available(self) -> bool:
        return hasattr(torch, "xpu") and torch.xpu.is_available()

    def dynamo_compiler(self) -> tuple[str, Callable[..., Any] | None]:
        # Inductor generates Triton code for Intel GPUs (upstream PyTorch ships the XPU Triton backend).
        from torch._dynamo.backends.registry import lookup_backend

        return "inductor", lookup_backend("inductor")

    def versions(self) -> dict[str, str | None]:
        return {"sycl": getattr(torch.version, "xpu", None)}
