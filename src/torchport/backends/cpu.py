"""The host CPU: always present, one device, memory read from the operating system."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

import torch

from . import register_backend
from .base import Backend

__all__ = ["CpuBackend", "host_memory", "host_name"]


def host_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what the platform module reports."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def host_memory() -> dict[str, int | None]:
    """Host RAM in bytes: total, available, and this process's resident set (current and peak)."""
    total = available = rss = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    except (OSError, ValueError, IndexError):
        pass
    if total is None and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            pass
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    peak = None
    try:
        import resource

        # ru_maxrss is KiB on Linux, bytes on macOS
        scale = 1 if platform.system() == "Darwin" else 1024
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    except (ImportError, OSError):
        pass
    if peak is not None and rss is not None:
        peak = max(peak, rss)  # ru_maxrss and statm count pages differently; a peak is never below the present
    return {"total": total, "available": available, "process_rss": rss, "process_peak_rss": peak}


@register_backend("cpu")
class CpuBackend(Backend):
    name = "cpu"
    dist_backend = "gloo"
    safetensors_direct = True
    pins_memory = False  # host memory is already where the CPU computes
    dispatch_key = "CPU"

    def dynamo_compiler(self) -> tuple[str, Callable[..., Any] | None]:
        # Inductor generates Triton (GPU) or C++/OpenMP (CPU) code for this device type.
        from torch._dynamo.backends.registry import lookup_backend

        return "inductor", lookup_backend("inductor")

    def preferred_conv_memory_format(self, index: int) -> torch.memory_format:
        # oneDNN (mkldnn) computes convolutions in NHWC or blocked layouts. Four 64->64 3x3 convolutions, each with
        # a ReLU, on an 8x64x56x56 fp32 input: 152 ms in NCHW, 66 ms in channels-last (2-core x86 host, torch 2.13).
        # Inductor's own layout choice also uses channels-last for every convolution oneDNN runs.
        if torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available():
            return torch.channels_last
        return torch.contiguous_format

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_index(self) -> int:
        return 0

    def set_index(self, index: int) -> None:
        if index != 0:
            raise ValueError(f"cpu has one device, index 0; got {index}")

    def device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def device_name(self, index: int) -> str:
        return host_name()

    def properties(self, index: int) -> dict[str, Any]:
        return {
            "name": host_name(),
            "logical_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": _native_bf16(),
            "total_memory": host_memory()["total"],
        }

    def mem_get_info(self, index: int) -> tuple[int, int] | None:
        mem = host_memory()
        if mem["total"] is None or mem["available"] is None:
            return None
        return mem["available"], mem["total"]

    def memory_stats(self, index: int) -> dict[str, int | None]:
        # PyTorch keeps no count of CPU tensor bytes; the process's resident set is the honest stand-in.
        mem = host_memory()
        return {"allocated": None, "reserved": None, "peak_allocated": None, "peak_reserved": None,
                "process_rss": mem["process_rss"], "process_peak_rss": mem["process_peak_rss"]}

    def reset_peak_memory_stats(self, index: int) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def synchronize(self, index: int) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def new_generator(self, index: int) -> torch.Generator:
        return torch.Generator()

    def event(self, enable_timing: bool = False) -> None:
        return None  # host work is synchronous: the host clock times it

    def stream(self, index: int) -> None:
        return None

    def current_stream(self, index: int) -> None:
        return None

    def claims_dtype(self, dtype: torch.dtype, index: int) -> bool:
        return dtype == torch.float32 or _native_bf16() and dtype == torch.bfloat16

    def autocast_dtype(self, requested: torch.dtype | None, index: int) -> torch.dtype:
        # CPU autocast computes fp16 slowly and with no loss scaling to protect it: bf16 has fp32's range.
        return torch.bfloat16

    def preferred_dtype(self, index: int, probe: bool | None = None) -> torch.dtype:
        # bf16 runs everywhere on CPU but is emulated (slower than fp32) without AVX512-BF16 or AMX.
        if _native_bf16() and self.dtype_works(torch.bfloat16, index, probe):
            return torch.bfloat16
        return torch.float32


def _native_bf16() -> bool:
    cpu = getattr(torch._C, "_cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)
