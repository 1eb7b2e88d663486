"""Process groups on any device: the right backend (hccl, nccl, xccl, gloo) and device for each rank."""

from __future__ import annotations

import os
from typing import Any

import torch

from .device import DeviceLike, resolve

__all__ = ["backend_name", "init"]


def backend_name(device: DeviceLike = None) -> str:
    """The torch.distributed backend for a device type: hccl (NPU), nccl (CUDA/ROCm), xccl (XPU), gloo (CPU).

    Example:
        >>> torchport.distributed.backend_name("cpu")
        'gloo'
    """
    backend, _ = resolve(device)
    return backend.dist_backend


def init(device: DeviceLike = None, backend: str | None = None, **kwargs: Any) -> torch.device:
    """``init_process_group`` with the backend for the device, and this rank's device set from LOCAL_RANK.

    Works under ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); a second call returns
    the device without initialising again.

    Args:
        device: the device type to use (default: :func:`torchport.device`'s type); the index comes from LOCAL_RANK.
        backend: override the process-group backend (default: :func:`backend_name`).
        kwargs: passed to ``torch.distributed.init_process_group`` (``init_method``, ``timeout``...).

    Returns:
        This rank's device, e.g. ``npu:3`` for LOCAL_RANK=3, or ``cpu``.

    Example:
        >>> device = torchport.distributed.init()   # under torchrun --nproc-per-node 8
    """
    import torch.distributed as dist

    chosen, _ = resolve(device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = chosen.device_count()
    host = chosen.device(0).index is None  # the CPU: every rank shares it
    if local_rank >= count and not host:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this machine has {count} {chosen.name} device(s): start at most {count} "
            f"processes per node (torchrun --nproc-per-node {count})"
        )
    index = 0 if host else local_rank
    chosen.set_index(index)
    rank_device = chosen.device(index)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend or chosen.dist_backend, **kwargs)
    return rank_device
