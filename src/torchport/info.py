"""One dict that describes this machine for torchport: torch build, host, and every device."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import torch

from . import __version__, _settings
from .backends import get_backend, list_backends
from .backends.cpu import host_memory, host_name
from .device import describe, device, devices

__all__ = ["info", "torch_build"]


def torch_build() -> dict[str, Any]:
    """The running torch's version and what it was built with."""
    return {
        "version": torch.__version__,
        "git": torch.version.git_version,
        "debug": bool(torch.version.debug),
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "xpu": getattr(torch.version, "xpu", None),
    }


def info(probe: bool = True) -> dict[str, Any]:
    """Everything torchport knows about this machine, as JSON-ready data.

    Args:
        probe: run the dtype probes (a small matmul + softmax per dtype and device, cached for the process).

    Returns:
        ``torchport``, ``python``, ``platform``, ``torch`` (build), ``host`` (CPU and RAM), ``backends``
        (registered type -> available), ``selected`` (what :func:`torchport.device` returns), ``devices`` (per
        device: name, properties, memory, dtype probes, preferred dtype, distributed backend, visible-devices
        variable, vendor versions) and ``environment`` (the variables that matter).

    Example:
        >>> torchport.info()["selected"]
        'npu:0'
    """
    return {
        "torchport": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch_build(),
        "host": {"cpu": host_name(), "logical_cores": os.cpu_count(), **host_memory()},
        "backends": {name: get_backend(name).is_available() for name in list_backends()},
        "selected": str(device()),
        "devices": [describe(d, probe=probe) for d in devices()],
        "environment": _settings.environment(),
    }
