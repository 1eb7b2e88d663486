"""The memory tiers of this machine and their measured bandwidths: what ``torchport stack`` prints.

Bandwidths are measured, not looked up: host-to-device copies from pinned and from pageable memory, and disk reads
through the same path and the same eviction the disk tier uses: a one-block disk tier is written, and before each
timed read :func:`torchport.offload.disk.evict` drops its pages from the process and the page cache and checks
with ``mincore`` that they are gone; then :meth:`DiskBlock.read` copies it out of the memory map into a pinned
buffer. When the eviction cannot be verified, a note says the figure may be RAM speed.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from ..backends import Backend
from ..backends.cpu import host_memory
from ..device import DeviceLike, resolve
from .disk import check_dir, evict, open_tier, write_tier

__all__ = ["measure_stack"]


def _time(fn: Callable[[], None], sync: Callable[[], None], iterations: int) -> float:
    fn()  # warm-up: first-touch page faults, lazy allocations
    sync()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _host_to_device(backend: Backend, index: int, source: torch.Tensor, pinned: bool,
                    iterations: int) -> float | None:
    target = backend.device(index)
    src = source
    if pinned:
        src = backend.empty_pinned(source.numel())
        src.copy_(source)
    dst = torch.empty(source.numel(), dtype=torch.uint8, device=target)
    seconds = _time(lambda: dst.copy_(src, non_blocking=True), lambda: backend.synchronize(index), iterations)
    return source.numel() / seconds


def _disk_read(backend: Backend, folder: str, source: torch.Tensor, iterations: int) -> tuple[float, bool]:
    tier = os.path.join(folder, f".torchport-stack-{os.getpid()}")
    os.makedirs(tier)
    try:
        write_tier(tier, [("stack", {"data": source})], progress=False)
        block = open_tier(tier, verify=False)["stack"]
        staging = backend.empty_pinned(source.numel())
        verified = True
        times = []
        for _ in range(iterations):
            verified = evict([block])["verified"] and verified
            start = time.perf_counter()
            block.read([("data", staging)])
            times.append(time.perf_counter() - start)
        del block
        return source.numel() / statistics.median(times), verified
    finally:
        shutil.rmtree(tier, ignore_errors=True)


def measure_stack(
    device: DeviceLike = None,
    disk_dir: str | os.PathLike[str] | None = None,
    *,
    size: int = 256 * 2**20,
    iterations: int = 3,
) -> dict[str, Any]:
    """Sizes of device memory, host RAM and a disk folder, and measured bandwidths between them.

    Args:
        device: the device (default :func:`torchport.device`).
        disk_dir: folder on the disk to measure (default: a new temporary folder, removed afterwards).
        size: bytes moved per measurement (default 256 MiB).
        iterations: timed repetitions per measurement, after one warm-up; the median is reported.

    Returns:
        ``{"device": {...}, "host": {...}, "disk": {...}, "bandwidth": {"pinned_h2d", "pageable_h2d",
        "disk_read"}, "size", "iterations", "notes"}``; bandwidths in bytes/s, None where they do not apply.

    Example:
        >>> torchport.offload.measure_stack()["bandwidth"]["pinned_h2d"] / 1e9
        45.9
    """
    if size < 2**20 or iterations < 1:
        raise ValueError(f"size={size} and iterations={iterations}: measure at least 1 MiB, at least once")
    backend, index = resolve(device)
    notes: list[str] = []
    free_total = backend.mem_get_info(index)
    mem = host_memory()
    out: dict[str, Any] = {
        "size": size, "iterations": iterations,
        "device": {"device": str(backend.device(index)), "name": backend.device_name(index),
                   "free": free_total[0] if free_total else None, "total": free_total[1] if free_total else None},
        "host": {"total": mem["total"], "available": mem["available"]},
    }
    source = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    bandwidth: dict[str, float | None] = {"pinned_h2d": None, "pageable_h2d": None, "disk_read": None}
    if backend.name == "cpu":
        notes.append("no accelerator: the device is the host, so host-to-device copies do not apply")
    else:
        bandwidth["pageable_h2d"] = _host_to_device(backend, index, source, False, iterations)
        if backend.pins_memory:
            bandwidth["pinned_h2d"] = _host_to_device(backend, index, source, True, iterations)
        else:
            notes.append(f"{backend.name} cannot pin host memory here: the host tier uses pageable memory")
    temporary = disk_dir is None
    folder = tempfile.mkdtemp(prefix="torchport-stack-") if temporary else check_dir(disk_dir, size)
    try:
        usage = shutil.disk_usage(folder)
        out["disk"] = {"path": folder if not temporary else f"{folder} (temporary)", "total": usage.total,
                       "free": usage.free}
        bandwidth["disk_read"], dropped = _disk_read(backend, folder, source, iterations)
        out["disk"]["page_cache_dropped"] = dropped
        if not dropped:
            notes.append("page cache not dropped (or not verifiable) before reading: the disk figure is an upper "
                         "bound and may be RAM speed")
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
    out["bandwidth"] = bandwidth
    out["notes"] = notes
    return out
