"""Distributed training on any device: process groups, DDP/FSDP wrapping, and checkpoints.

* :func:`init` starts the process group with the device's backend (hccl on Ascend, nccl on CUDA/ROCm, xccl on
  XPU, gloo on the CPU) and binds this rank to its device from ``LOCAL_RANK``;
* :func:`wrap` makes a model data-parallel (``"ddp"``) or fully sharded (``"fsdp"``, FSDP2's ``fully_shard``) with
  the device ids, mixed-precision policy and gradient-reduction dtype right for the device;
* :func:`save_checkpoint` / :func:`load_checkpoint` write and read a wrapped (or plain) model and its optimizer
  through ``torch.distributed.checkpoint``, which reshards: a checkpoint written by 8 ranks loads on 1.

The same script runs under ``torchrun`` or ``torchport run --nproc-per-node N`` on NPUs, GPUs or CPUs, and as a
plain single process (a process group of one).

Example:
    >>> device = torchport.distributed.init()
    >>> model = torchport.distributed.wrap(model, "fsdp")
    >>> torchport.distributed.save_checkpoint("ckpt/step100", model, optimizer)
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from .. import _settings
from ..device import DeviceLike, resolve

__all__ = [
    "CheckpointError",
    "STRATEGIES",
    "backend_name",
    "check_backend",
    "init",
    "load_checkpoint",
    "save_checkpoint",
    "wrap",
]

STRATEGIES = ("ddp", "fsdp")
_rank_device: torch.device | None = None  # this rank's device, set when init() starts the process group


def backend_name(device: DeviceLike = None) -> str:
    """The torch.distributed backend for a device type: hccl (NPU), nccl (CUDA/ROCm), xccl (XPU), gloo (CPU).

    Example:
        >>> torchport.distributed.backend_name("cpu")
        'gloo'
    """
    backend, _ = resolve(device)
    return backend.dist_backend


def check_backend(backend: str, device: DeviceLike = None) -> None:
    """Raise a clear error if the process-group ``backend`` cannot serve ``device``'s type or is not built in.

    Example:
        >>> torchport.distributed.check_backend("nccl", "cpu")
        Traceback (most recent call last):
        ValueError: process-group backend 'nccl' cannot run on cpu tensors (it serves: cuda); ...
    """
    import torch.distributed as dist

    chosen, _ = resolve(device)
    name = backend.lower()
    if name == chosen.dist_backend:
        return  # the device's own backend (registered by its vendor library when that loads)
    capability = getattr(dist.Backend, "backend_capability", {})
    serves = capability.get(name)
    if serves is None:
        raise ValueError(
            f"process-group backend {backend!r} is not registered with torch.distributed (registered: "
            f"{', '.join(sorted(capability))}); {chosen.name} uses {chosen.dist_backend!r}"
        )
    if chosen.name not in serves:
        raise ValueError(
            f"process-group backend {backend!r} cannot run on {chosen.name} tensors (it serves: {', '.join(serves)}); "
            f"use {chosen.dist_backend!r} for {chosen.name}, or leave the backend out and torchport picks it"
        )
    available = getattr(dist, "is_backend_available", None)
    if available is not None and not available(name):
        raise ValueError(
            f"process-group backend {backend!r} is not built into this PyTorch; {chosen.name} uses "
            f"{chosen.dist_backend!r}"
        )


def init(device: DeviceLike = None, backend: str | None = None, **kwargs: Any) -> torch.device:
    """``init_process_group`` with the backend for the device, and this rank's device set from LOCAL_RANK.

    Works under ``torchrun`` / ``torchport run --nproc-per-node`` (which set RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT). Started without them, it forms a process group of one, so the same script also runs as a
    plain single process. A second call returns the device without initialising again. The rendezvous and the
    collectives time out after ``TORCHPORT_DIST_TIMEOUT`` seconds (default 300) with an error rather than hang.

    Args:
        device: the device type to use (default: :func:`torchport.device`'s type); the index comes from LOCAL_RANK.
        backend: override the process-group backend (default: :func:`backend_name`); checked against the device.
        kwargs: passed to ``torch.distributed.init_process_group`` (``init_method``, ``timeout``...).

    Returns:
        This rank's device, e.g. ``npu:3`` for LOCAL_RANK=3, or ``cpu``.

    Example:
        >>> device = torchport.distributed.init()   # under torchrun --nproc-per-node 8
    """
    import torch.distributed as dist

    global _rank_device
    if device is None and dist.is_initialized() and _rank_device is not None:
        return _rank_device  # the device the group was started for
    chosen, _ = resolve(device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = chosen.device_count()
    host = chosen.device(0).index is None  # the CPU: every rank shares it
    if local_rank >= count and not host:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this machine has {count} {chosen.name} device(s): start at most {count} "
            f"processes per node (torchrun --nproc-per-node {count})"
        )
    name = backend or chosen.dist_backend
    check_backend(name, chosen.name)
    index = 0 if host else local_rank
    chosen.set_index(index)
    rank_device = chosen.device(index)
    if not dist.is_initialized():
        kwargs.setdefault("timeout", datetime.timedelta(seconds=_settings.value("dist_timeout")))
        launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        if not launched and "init_method" not in kwargs and "store" not in kwargs:
            # not started by a launcher: a process group of one, so single-process runs need no torchrun
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(backend=name, **kwargs)
        _rank_device = rank_device
    return rank_device


def __getattr__(name: str):
    if name == "wrap":
        from .parallel import wrap

        return wrap
    if name in ("save_checkpoint", "load_checkpoint", "CheckpointError"):
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'torchport.distributed' has no attribute {name!r}")
