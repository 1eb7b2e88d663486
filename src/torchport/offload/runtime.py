"""Offloading a model: where each block goes (:func:`plan`), moving it there (:func:`offload`), where its weights
are now (:func:`placement`), and its disk tier dropped from memory for measurements (:func:`evict_disk_tier`).

:func:`offload` makes every new tensor first (device copies, host copies, disk files, buffers) and changes the model
only when all of them exist, so an error leaves the model as it was; then it attaches the copy pipeline of
:mod:`torchport.offload.pipeline`, which says how copies and compute are ordered.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from ..backends import Backend
from ..backends.cpu import host_memory
from ..device import DeviceLike, resolve
from .budget import Budget, parse_budget
from .disk import check_dir, evict, open_tier, write_tier
from .pipeline import OffloadedBlock, OffloadState, Slot, has_streams, hooks, layout
from .placement import Blocks, ModelBlocks, Placement, aligned, find_blocks, place

__all__ = ["evict_disk_tier", "offload", "placement", "plan"]

logger = logging.getLogger("torchport")

_ATTRIBUTE = "_torchport_offload"
_warned: set[str] = set()


# -- planning ------------------------------------------------------------------------------------------------------
def _budgets(backend: Backend, index: int, budget: Budget, host_budget: Budget | None,
             disk_dir: Any) -> tuple[int, int | None]:
    info = backend.mem_get_info(index)
    device_bytes = parse_budget(budget, info[0] if info else None, name="budget")
    available = host_memory()["available"]
    if host_budget is None:
        # with a disk tier, leave half the available RAM to the rest of the program and the page cache
        host_bytes = None if disk_dir is None else (available // 2 if available else 0)
    else:
        host_bytes = parse_budget(host_budget, available, name="host_budget") if host_budget != 0 else 0
    return device_bytes, host_bytes


def _plan(model: nn.Module, budget: Budget, host_budget: Budget | None, disk_dir: Any, prefetch: int,
          blocks: Blocks, device: DeviceLike) -> tuple[Backend, int, ModelBlocks, Placement]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload takes an nn.Module, got {type(model).__name__}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(f"prefetch must be an int (blocks copied ahead), got {prefetch!r}")
    backend, index = resolve(device)
    device_bytes, host_bytes = _budgets(backend, index, budget, host_budget, disk_dir)
    found = find_blocks(model, blocks)
    sizes = found.block_bytes()
    result = place(found.names, sizes, found.resident_bytes, device_bytes, prefetch=prefetch,
                   host_budget=host_bytes, disk=disk_dir is not None, device=str(backend.device(index)),
                   streams=has_streams(backend, index))
    return backend, index, found, result


def plan(
    model: nn.Module,
    budget: Budget,
    *,
    host_budget: Budget | None = None,
    disk_dir: str | os.PathLike[str] | None = None,
    prefetch: int = 1,
    blocks: Blocks = None,
    device: DeviceLike = None,
) -> Placement:
    """Where :func:`offload` would put each block, and the bytes of each tier, without moving anything.

    Takes the same arguments as :func:`offload`.

    Example:
        >>> p = torchport.offload.plan(model, "8GiB", host_budget="32GiB", disk_dir="/nvme/tier")
        >>> p.tiers()["model.layers.31"]
        'disk'
    """
    return _plan(model, budget, host_budget, disk_dir, prefetch, blocks, device)[3]


# -- offloading ----------------------------------------------------------------------------------------------------
def offload(
    model: nn.Module,
    budget: Budget,
    *,
    host_budget: Budget | None = None,
    disk_dir: str | os.PathLike[str] | None = None,
    prefetch: int = 1,
    blocks: Blocks = None,
    device: DeviceLike = None,
    progress: bool = True,
) -> nn.Module:
    """Run ``model`` on a device with less memory than its weights: blocks that fit stay on the device, the rest
    live in pinned host memory (up to ``host_budget``) and then on disk, and are copied in ahead of use.

    Args:
        model: the model (its weights anywhere: host or device). Changed in place and returned.
        budget: device bytes for the weights: an int, a string such as ``"8GiB"`` / ``"512MB"``, or a float in
            (0, 1], a fraction of the device's free memory. Activations and the KV cache come on top.
        host_budget: bytes of pinned host memory for offloaded blocks (same forms; a fraction is of available RAM).
            None: no limit without ``disk_dir``; with ``disk_dir``, half the available RAM.
        disk_dir: folder for the disk tier (one safetensors file per block, checksummed); None: no disk tier.
        prefetch: how many offloaded blocks are copied ahead of the one computing (device buffers = prefetch + 1).
        blocks: the repeated layers: a module name (``"model.layers"``), an ``nn.ModuleList`` or a list of
            modules; None finds the largest ``nn.ModuleList`` of same-class modules.
        device: the device (default :func:`torchport.device`).
        progress: show a progress bar while the disk tier is written.

    Returns:
        The model, ready for inference (``torch.inference_mode()`` or ``torch.no_grad()``); outputs are
        bit-identical to the model run on the device. :func:`placement` tells where each block is.

    Raises:
        ValueError: a budget too small for the largest block (named, with its size), a bad budget string, an
            unwritable or full ``disk_dir``; nothing is moved then. On any error while moving, the model is left
            as it was.

    Example:
        >>> model = torchport.offload(model, "8GiB", host_budget="32GiB", disk_dir="/nvme/tier")
        >>> with torch.inference_mode():
        ...     logits = model(input_ids.to(torchport.device())).logits
    """
    if getattr(model, _ATTRIBUTE, None) is not None:
        raise ValueError(f"{type(model).__name__} is already offloaded; offload a fresh model")
    backend, index, found, result = _plan(model, budget, host_budget, disk_dir, prefetch, blocks, device)
    target = backend.device(index)
    tiers = result.tiers()
    folder = None
    if result.tier_bytes("disk"):
        folder = check_dir(disk_dir, result.tier_bytes("disk"))

    written: list[str] = []
    try:
        state, changes = _build(model, backend, index, found, result, tiers, folder, progress, written)
    except BaseException:
        for path in written:  # never leave a partial disk tier behind; the model was not touched yet
            if os.path.exists(path):
                os.remove(path)
        raise
    # commit: from here on nothing allocates, so the model is never left half-moved
    for table, name, new in changes:
        table[name] = new
    for i, block in enumerate(state.offloaded):
        block.bind(block.home)
        before, after = hooks(state, i)
        state.handles.append(block.module.register_forward_pre_hook(before, with_kwargs=True))
        state.handles.append(block.module.register_forward_hook(after, always_call=True))
    setattr(model, _ATTRIBUTE, state)
    logger.info("%s", result)
    if state.offloaded and not state.streamed and backend.name not in _warned:
        _warned.add(backend.name)
        logger.warning("torchport.offload: %s has no streams, so offloaded blocks are copied when they run, one "
                       "after another, without overlapping compute", target)
    return model


def _build(model: nn.Module, backend: Backend, index: int, found: ModelBlocks, result: Placement,
           tiers: dict[str, str], folder: str | None, progress: bool,
           written: list[str]) -> tuple[OffloadState, list[tuple[dict, str, Any]]]:
    """Make every new tensor (device copies, host copies, disk files, buffers) without touching the model, and
    return the list of assignments that put them in place."""
    target = backend.device(index)
    offloaded: list[OffloadedBlock] = []
    for name, module, own in zip(found.names, found.modules, found.params):
        if tiers[name] != "device":
            params = layout(name, module, own)
            nbytes = sum(aligned(p.nbytes) for p in params)
            offloaded.append(OffloadedBlock(name, module, tiers[name], params, nbytes))
    away = {id(p) for name, own in zip(found.names, found.params) if tiers[name] != "device" for p in own}

    changes: list[tuple[dict, str, Any]] = []
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is None or id(t) in away:
                    continue
                new = moved.get(id(t))
                if new is None:
                    if t.device == target:
                        new = t
                    elif is_param:
                        new = nn.Parameter(t.detach().to(target), requires_grad=t.requires_grad)
                    else:
                        new = t.to(target)
                    moved[id(t)] = new
                if new is not t:
                    changes.append((table, name, new))

    for block in offloaded:
        if block.tier == "host":
            block.host = backend.empty_pinned(block.nbytes)
            for p in block.params:
                p.view(block.host).copy_(p.source.detach())
            block.home = {p.key: nn.Parameter(p.view(block.host), requires_grad=p.requires_grad)
                          for p in block.params}
    on_disk = [b for b in offloaded if b.tier == "disk"]
    if on_disk:
        written += write_tier(folder, [(b.name, {p.key: p.source for p in b.params}) for b in on_disk],
                              progress=progress)
        tier = open_tier(folder)
        for block in on_disk:
            block.disk = tier[block.name]
            block.home = {p.key: nn.Parameter(block.disk.tensor(p.key), requires_grad=p.requires_grad)
                          for p in block.params}

    copy_stream = backend.stream(index) if offloaded and has_streams(backend, index) else None
    slots: list[Slot] = []
    staging: list[torch.Tensor] = []
    if offloaded:
        size = max(b.nbytes for b in offloaded)
        slots = [Slot(torch.empty(size, dtype=torch.uint8, device=target), backend, offloaded)
                 for _ in range(result.buffers)]
        if copy_stream is not None and on_disk:
            staging = [backend.empty_pinned(max(b.nbytes for b in on_disk)) for _ in range(min(2, len(on_disk)))]
    for block in offloaded:
        for p in block.params:
            p.source = None  # the originals are released when the model lets go of them
    state = OffloadState(backend, index, result, found, offloaded, slots, staging, copy_stream, folder)
    state.places = {name: [place for p in layout(name, module, own) for place in p.places]
                    for name, module, own in zip(found.names, found.modules, found.params)}
    return state, changes


def evict_disk_tier(model: nn.Module) -> dict[str, Any]:
    """Make the next forward of an offloaded model read its disk tier from the disk, not from RAM: wait for reads
    in flight, forget blocks fetched ahead (so the next forward reads every disk-tier block itself), then drop the
    files' pages from this process's mapping and from the page cache (as root, also the system page cache when
    the per-file advice left pages behind) and check with ``mincore`` that they are gone.

    For measurements; a model running normally needs no call (each forward reads the files, through the page cache).

    Returns:
        ``{"bytes", "cached_bytes", "verified", "method"}`` (see :func:`torchport.offload.disk.evict`);
        ``verified`` is False when pages stayed cached or the check was not possible: reads may then come from RAM.

    Example:
        >>> torchport.offload.evict_disk_tier(model)
        {'bytes': 4127195136, 'cached_bytes': 0, 'verified': True, 'method': '...'}
    """
    state: OffloadState | None = getattr(model, _ATTRIBUTE, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not offloaded by torchport.offload")
    disks = [b.disk for b in state.offloaded if b.disk is not None]
    if not disks:
        raise ValueError(f"{type(model).__name__} has no disk tier: offload it with disk_dir= and a host_budget "
                         "too small for every offloaded block")
    state.reset()
    return evict(disks)


def placement(model: nn.Module) -> dict[str, str]:
    """Where each block's weights are now, read from the tensors themselves: ``{block name: tier}``.

    ``"disk"``: the parameters are views of a disk-tier file's memory map; ``"host"``: of a host-tier buffer;
    ``"device"``: on the model's device. Matches ``plan(...).tiers()`` for the arguments ``offload`` was given.

    Example:
        >>> torchport.offload.placement(model)["model.layers.0"]
        'device'
    """
    state: OffloadState | None = getattr(model, _ATTRIBUTE, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not offloaded by torchport.offload")
    hosts = [(b.host.data_ptr(), b.host.data_ptr() + b.host.numel()) for b in state.offloaded if b.host is not None]
    disks = [b.disk for b in state.offloaded if b.disk is not None]
    out: dict[str, str] = {}
    for name in state.blocks.names:
        found = set()
        for module, attr in state.places[name]:
            p = module._parameters[attr]
            if p.device.type == "cpu" and any(d.contains(p.data_ptr()) for d in disks):
                found.add("disk")
            elif p.device.type == "cpu" and any(lo <= p.data_ptr() < hi for lo, hi in hosts):
                found.add("host")
            elif p.device == state.device:
                found.add("device")
            else:
                found.add(f"elsewhere ({p.device})")
        out[name] = found.pop() if len(found) == 1 else "mixed: " + ", ".join(sorted(found))
    return out
