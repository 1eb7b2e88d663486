"""Apple GPUs through Metal Performance Shaders: one device, memory counters under other names."""

from __future__ import annotations

import platform

import torch

from . import register_backend
from .base import Backend

__all__ = ["MpsBackend"]


@register_backend("mps")
class MpsBackend(Backend):
    name = "mps"
    safetensors_direct = True
    dispatch_key = "MPS"

    def is_available(self) -> bool:
        return torch.backends.mps.is_available()

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def current_index(self) -> int:
        return 0

    def set_index(self, index: int) -> None:
        if index != 0:
            raise ValueError(f"mps has one device, index 0; got {index}")

    def device_name(self, index: int) -> str:
        return f"Apple {platform.machine()} GPU (MPS)"

    def properties(self, index: int) -> dict[str, object]:
        return {"name": self.device_name(index), "recommended_max_memory": torch.mps.recommended_max_memory()}

    def versions(self) -> dict[str, str | None]:
        return {"macos": platform.mac_ver()[0] or None}

    def mem_get_info(self, index: int) -> tuple[int, int] | None:
        total = torch.mps.recommended_max_memory()
        return max(total - torch.mps.driver_allocated_memory(), 0), total

    def memory_stats(self, index: int) -> dict[str, int | None]:
        # MPS keeps no peak counters.
        return {"allocated": torch.mps.current_allocated_memory(), "reserved": torch.mps.driver_allocated_memory(),
                "peak_allocated": None, "peak_reserved": None}

    def reset_peak_memory_stats(self, index: int) -> None:
        pass

    def synchronize(self, index: int) -> None:
        torch.mps.synchronize()

    def manual_seed_all(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def event(self, enable_timing: bool = False):
        return torch.mps.Event(enable_timing=enable_timing)

    def stream(self, index: int) -> None:
        return None  # MPS has a single command queue

    def current_stream(self, index: int) -> None:
        return None
