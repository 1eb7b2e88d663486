"""Memory of every device and of the host, in bytes."""

from __future__ import annotations

from typing import Any

from .backends import get_backend, list_backends
from .backends.cpu import host_memory
from .device import _memory_entry, devices

__all__ = ["memory", "empty_cache", "host_memory"]


def memory() -> dict[str, Any]:
    """Memory of every usable device and of the host.

    Returns:
        ``{"devices": {"npu:0": {"free", "total", "allocated", "reserved", "peak_allocated", "peak_reserved"}, ...},
        "host": {"total", "available", "process_rss", "process_peak_rss"}}``; a value the device does not report
        is None (PyTorch counts no CPU tensor bytes, so the CPU entry gives the process's resident set instead).

    Example:
        >>> torchport.memory()["devices"]["cuda:0"]["allocated"]
        0
    """
    per_device = {}
    for dev in devices():
        backend = get_backend(dev.type)
        per_device[str(dev)] = _memory_entry(backend, dev.index if dev.index is not None else 0)
    return {"devices": per_device, "host": host_memory()}


def empty_cache() -> None:
    """Return cached, unused device memory to the driver on every available device type.

    Example:
        >>> del activations; torchport.empty_cache()
    """
    for name in list_backends():
        backend = get_backend(name)
        if backend.is_available():
            backend.empty_cache()
