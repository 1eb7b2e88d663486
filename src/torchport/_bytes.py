"""Byte counts: how many bytes a model's weights hold (:func:`weight_bytes`) and how to write one
(:func:`format_bytes`)."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

__all__ = ["format_bytes", "weight_bytes"]


def format_bytes(n: int | float | None) -> str:
    """Bytes in binary units with three significant digits, ``"-"`` for None.

    Example:
        >>> format_bytes(3 * 2**30), format_bytes(512), format_bytes(None)
        ('3.00 GiB', '512 B', '-')
    """
    if n is None:
        return "-"
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n / size >= 100 else f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _memory(t: torch.Tensor) -> Any:
    """What identifies the bytes a tensor holds: its device, first address, and extent (tensors without memory of
    their own, on the meta device, by identity)."""
    if t.device.type == "meta":
        return id(t)
    try:
        return t.device, t.data_ptr(), t.numel() * t.element_size()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
        return id(t)


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers, each block of memory counted once.

    A weight tied between modules (one parameter, or two tensors over the same memory, as ``a.weight.data =
    b.weight.data`` makes) counts once; disjoint slices of one storage (q, k and v cut from one fused weight)
    count each. Quantised layers count by their codes and scales.

    Example:
        >>> weight_bytes(nn.Linear(4, 4))   # 16 weights + 4 biases, float32
        80
    """
    seen: set[Any] = set()
    total = 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        key = _memory(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
