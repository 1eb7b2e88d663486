"""Triton kernels of torchport's ops, imported only when the Triton implementation of an op is chosen.

Keeping them out of the op modules means ``torchport.kernels`` works where Triton is not installed and does not pay
Triton's import time on devices that never use it. The kernels run on CUDA/ROCm GPUs, and on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the test suite checks the kernel code on machines without a GPU.

Launch configurations (block sizes, warps, programs per multiprocessor) are chosen by :mod:`.autotune`: timed once
per shape bucket on the GPU, remembered in ``TORCHPORT_CACHE_DIR`` for later processes; the hand-tuned heuristic is
the first candidate, and the only one where nothing can be timed.
"""

from __future__ import annotations

import functools
import math

import torch

from ...backends import get_backend

__all__ = ["cdiv", "multiprocessor_count", "next_power_of_2", "nvidia", "rows_view", "shared_memory_per_program"]


_UNKNOWN_COUNT = 8  # compute units assumed where the device does not say


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device_type: str, index: int) -> int:
    try:
        props = get_backend(device_type).properties(index)
    except Exception:  # a device module without properties
        return _UNKNOWN_COUNT
    # a vendor may declare the field and leave it None (torch_npu's 7.3.0 releases: the npu backend then counts the
    # vector cores, as torch_npu's 26.x releases do); the host, where Triton's interpreter runs, has none
    count = props.get("multi_processor_count")
    return int(count) if isinstance(count, int) and count > 0 else _UNKNOWN_COUNT


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors (compute units) of ``device``, used to size persistent grids: the properties'
    ``multi_processor_count`` (an Ascend NPU's vector cores), else 8 (the host under Triton's interpreter)."""
    return _multiprocessor_count(device.type, device.index or 0)


def shared_memory_per_program(device: torch.device) -> int | None:
    """Bytes of shared memory one program (thread block) may use on a GPU ``device``, as Triton's driver reports it
    for its own launch checks (227 KiB on an H100 or H200, 99 KiB on an RTX 4090); None off GPUs (the host under
    Triton's interpreter has no such limit) or where the driver does not say."""
    if device.type != "cuda":
        return None
    return _shared_memory(device.index if device.index is not None else torch.accelerator.current_device_index())


@functools.lru_cache(maxsize=None)
def _shared_memory(index: int) -> int | None:
    try:
        from triton.runtime.driver import driver

        value = driver.active.utils.get_device_properties(index).get("max_shared_mem")
    except Exception:  # an interpreter or driver without the query
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


@functools.lru_cache(maxsize=None)
def _vendor(device_type: str, index: int) -> str | None:
    try:
        return get_backend(device_type).properties(index).get("vendor")
    except Exception:  # a device module without properties
        return None


def nvidia(device: torch.device) -> bool:
    """Whether ``device`` is an NVIDIA GPU, where a kernel may hold PTX (``tl.inline_asm_elementwise``); not a ROCm
    GPU, which torch also calls ``cuda``, nor the host under Triton's interpreter."""
    return device.type == "cuda" and _vendor(device.type, device.index or 0) == "NVIDIA"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids: plain integer arithmetic (``triton.cdiv`` is a constexpr-function wrapper
    that costs microseconds per host call in Triton 3.6, on kernels whose launches are host-bound)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as a 2-D ``(rows, n)`` tensor whose last dimension is contiguous (a view when possible).

    Row strides of 0 (an expanded gradient) are kept: the kernels only need unit stride along a row.
    """
    rows = t.reshape(math.prod(t.shape[:-1]), n)  # not (-1, n): with n == 0 the row count would be ambiguous
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows
