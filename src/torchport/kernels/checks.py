"""Argument checks shared by the ops: one clear error naming the op, the argument, and what is allowed."""

from __future__ import annotations

import torch

__all__ = ["FLOATING", "capturing", "check_floating", "check_same_device", "check_same_dtype", "widen"]

FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_floating(op: str, **tensors: torch.Tensor | None) -> None:
    """Every given tensor is a tensor of a floating dtype (None entries are skipped)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in FLOATING:
            raise TypeError(
                f"{op}: {name} has dtype {t.dtype}; allowed: float32, bfloat16, float16 (float64 for the reference)"
            )


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """All given tensors are on one device."""
    devices = [t.device for t in tensors.values() if t is not None]
    if any(d != devices[0] for d in devices[1:]):  # no set or dict on the path every kernel call takes
        present = {name: t.device for name, t in tensors.items() if t is not None}
        listing = ", ".join(f"{name} on {device}" for name, device in present.items())
        raise ValueError(f"{op}: tensors must be on one device, got {listing}")


def check_same_dtype(op: str, **tensors: torch.Tensor | None) -> None:
    """All given tensors have one dtype."""
    present = {name: t.dtype for name, t in tensors.items() if t is not None}
    if len(set(present.values())) > 1:
        listing = ", ".join(f"{name} {dtype}" for name, dtype in present.items())
        raise TypeError(f"{op}: tensors must have one dtype, got {listing}")


def widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 when it is a 16-bit float, else unchanged: the references compute in at least float32,
    and in float64 for float64 inputs (which is how the tests obtain their float64 ground truth)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def capturing(device: torch.device) -> bool:
    """Whether code runs where a tensor's value cannot be read on the host: while torch.compile traces, or while the
    device's current stream captures a graph (CUDA graphs, or another device module's ``is_current_stream_capturing``).

    Example:
        >>> capturing(torch.device("cpu"))
        False
    """
    if torch.compiler.is_compiling():
        return True
    if device.type == "cpu":
        return False
    try:
        query = getattr(torch.get_device_module(device), "is_current_stream_capturing", None)
        return bool(query()) if query is not None else False
    except Exception:  # noqa: BLE001 - a device module without the query is not capturing
        return False
