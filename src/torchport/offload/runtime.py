"""Running a model whose blocks live on three tiers: device, pinned host memory, disk.

How an offloaded block runs (stream mode, on devices with streams such as CUDA and Ascend NPUs):

- The device keeps a pool of ``B = min(prefetch + 1, offloaded blocks)`` flat byte buffers ("slots"), each as large
  as the largest offloaded block. A block's parameters are laid out in one flat byte range (offsets aligned to
  256 bytes), the same in its host copy, its staging copy and its slot, so one copy moves a whole block.
- Copies run on a side stream. Each slot has two events: ``ready`` (recorded on the copy stream after the copy into
  the slot) and ``free`` (recorded on the compute stream after the block that used the slot finished). A copy into a
  slot first waits for ``free``; a block's compute first waits for ``ready``. So copies overlap compute, and a slot
  is never overwritten while a kernel still reads it.
- A forward pre-hook on the block makes the compute wait for its slot, points the block's parameters at views of
  the slot, and queues the copies of the next ``B - 1`` offloaded blocks (cyclically: after the last block the
  first ones of the next forward are fetched, which overlaps the head of the model in decoding). A forward hook
  records ``free`` and points the parameters back at their home tier.
- Host-tier blocks are copied from pinned memory with one asynchronous copy. Disk-tier blocks are read by one
  worker thread from the file's memory map into one of two pinned staging buffers, then copied to the slot; a
  staging buffer is reused only after the copy out of it finished (its own event). After each read the process
  drops its mapping of the file's pages, so no copy of a disk-tier block stays in the process between forwards:
  every forward reads the files again (from the page cache while the kernel keeps the pages there, from the disk
  once they are evicted; :func:`evict_disk_tier` evicts them, for measurements).

Parameters are re-pointed by replacing the entries of each submodule's ``_parameters`` with cached ``Parameter``
views, not by assigning ``param.data``: on devices registered from Python (the simulated NPU) a tensor's data lives
outside its TensorImpl and ``.data =`` would silently keep the old weights. Dict assignment works on every device.

On a device without streams (the CPU) a block is copied when it runs, serially; torchport says so once.

Inference only: a backward through an offloaded block would read weights that were already replaced in the slot,
so a forward that autograd would record raises instead.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import weakref
from typing import Any

import torch
from torch import nn

from ..backends import Backend
from ..backends.cpu import host_memory
from ..device import DeviceLike, resolve
from .budget import Budget, parse_budget
from .disk import DiskBlock, check_dir, evict, open_tier, write_tier
from .placement import Blocks, ModelBlocks, Placement, aligned, find_blocks, place

__all__ = ["evict_disk_tier", "offload", "placement", "plan"]

logger = logging.getLogger("torchport")

_ATTRIBUTE = "_torchport_offload"
_warned: set[str] = set()


@dataclasses.dataclass
class _Param:
    key: str  # name inside the block
    places: list[tuple[nn.Module, str]]  # (submodule, attribute) holding it
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    source: torch.Tensor | None  # the original parameter, while offload builds the tiers

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclasses.dataclass
class _Block:
    name: str
    module: nn.Module
    tier: str
    params: list[_Param]
    nbytes: int
    home: dict[str, nn.Parameter] = dataclasses.field(default_factory=dict)  # key -> parameter on its tier
    host: torch.Tensor | None = None  # host tier: the flat (pinned) copy
    disk: DiskBlock | None = None

    @property
    def requires_grad(self) -> bool:
        return any(p.requires_grad for p in self.home.values())

    def bind(self, tensors: dict[str, nn.Parameter]) -> None:
        for p in self.params:
            for module, attr in p.places:
                module._parameters[attr] = tensors[p.key]

    def fill(self, dst: torch.Tensor) -> None:
        """Copy the block's bytes from the disk tier into ``dst`` (host, at least ``nbytes``), synchronously."""
        self.disk.read((p.key, dst[p.offset:p.offset + p.nbytes]) for p in self.params)

    def fill_views(self, views: dict[str, nn.Parameter]) -> None:
        """Copy the block's parameters from its tier into ``views`` (on any device), synchronously."""
        try:
            for p in self.params:
                views[p.key].copy_(self.home[p.key])
        finally:
            if self.disk is not None:
                self.disk.release()  # the next forward reads the file again


def _layout(block_name: str, module: nn.Module, own: list[nn.Parameter]) -> list[_Param]:
    places: dict[int, list[tuple[nn.Module, str]]] = {id(p): [] for p in own}
    keys: dict[int, str] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is not None and id(p) in places:
                if (sub, attr) not in places[id(p)]:
                    places[id(p)].append((sub, attr))
                keys.setdefault(id(p), f"{prefix}.{attr}" if prefix else attr)
    out, offset = [], 0
    for p in own:
        nbytes = p.numel() * p.element_size()
        out.append(_Param(keys[id(p)], places[id(p)], offset, nbytes, p.dtype, tuple(p.shape), p.requires_grad, p))
        offset += aligned(nbytes)
    return out


class _Slot:
    """One reusable device buffer, with views made once for every offloaded block: no tensor is made per call
    (the simulated NPU cannot even make views inside ``torch.inference_mode()``)."""

    def __init__(self, buffer: torch.Tensor, backend: Backend, blocks: list[_Block]) -> None:
        self.ready = backend.event()
        self.free = backend.event()
        self.heads = [buffer[:block.nbytes] for block in blocks]  # copy destinations
        self.views = [{p.key: nn.Parameter(p.view(buffer), requires_grad=False) for p in block.params}
                      for block in blocks]


@dataclasses.dataclass
class _Pending:
    index: int
    slot: _Slot
    future: concurrent.futures.Future | None


class OffloadState:
    """What ``offload`` attached to a model: the placement, the blocks, the buffers, the copy pipeline."""

    def __init__(self, backend: Backend, index: int, plan: Placement, blocks: ModelBlocks,
                 offloaded: list[_Block], slots: list[_Slot], staging: list[torch.Tensor],
                 copy_stream: Any | None, disk_dir: str | None) -> None:
        self.backend, self.index, self.plan, self.blocks = backend, index, plan, blocks
        self.device = backend.device(index)
        self.offloaded, self.slots, self.copy_stream, self.disk_dir = offloaded, slots, copy_stream, disk_dir
        self.staging = [(buffer, backend.event()) for buffer in staging]
        self._next_slot = 0
        self._next_staging = 0
        self._queue: collections.deque[_Pending] = collections.deque()
        self._active: dict[int, _Slot] = {}
        self._reader = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchport-offload")
                        if copy_stream is not None and any(b.disk is not None for b in offloaded) else None)
        self.handles: list[Any] = []
        # Copies may still be in flight when the model is dropped (the last forward prefetched the next one's first
        # blocks): wait for them before the buffers go back to the allocator, which could hand them out meanwhile.
        weakref.finalize(self, _quiesce, copy_stream)
        self.places: dict[str, list[tuple[nn.Module, str]]] = {}  # block -> where its own parameters sit

    @property
    def streamed(self) -> bool:
        return self.copy_stream is not None

    # -- copies ------------------------------------------------------------------------------------------------
    def _issue(self, index: int) -> _Pending:
        slot = self.slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self.slots)
        block = self.offloaded[index]
        if block.host is not None:
            self._to_slot(block.host, slot.heads[index], slot)
            return _Pending(index, slot, None)
        return _Pending(index, slot, self._reader.submit(self._read_disk, index, block, slot))

    def _to_slot(self, source: torch.Tensor, dst: torch.Tensor, slot: _Slot, done: Any | None = None) -> None:
        stream = self.copy_stream
        with self.backend.use_stream(stream):
            stream.wait_event(slot.free)
            dst.copy_(source, non_blocking=True)
            slot.ready.record(stream)
            if done is not None:
                done.record(stream)

    def _read_disk(self, index: int, block: _Block, slot: _Slot) -> None:
        # worker thread: the only user of the staging buffers, so they rotate without a lock
        buffer, done = self.staging[self._next_staging]
        self._next_staging = (self._next_staging + 1) % len(self.staging)
        done.synchronize()  # the previous copy out of this staging buffer has finished
        block.fill(buffer)
        self._to_slot(buffer[:block.nbytes], slot.heads[index], slot, done)

    def _drain(self) -> None:
        while self._queue:
            pending = self._queue.popleft()
            if pending.future is not None:
                concurrent.futures.wait([pending.future])

    # -- hooks -------------------------------------------------------------------------------------------------
    def acquire(self, index: int) -> None:
        block = self.offloaded[index]
        if not self.streamed:
            slot = self.slots[0]
            block.fill_views(slot.views[index])
        else:
            if not self._queue or self._queue[0].index != index:
                # not the block the pipeline expected (first call, or a model that skips or repeats blocks):
                # start again from this one; copies already queued finish first, in stream order
                self._drain()
                self._queue.append(self._issue(index))
            pending = self._queue.popleft()
            if pending.future is not None:
                try:
                    pending.future.result()
                except BaseException:
                    self._drain()
                    raise
            slot = pending.slot
            self.backend.current_stream(self.index).wait_event(slot.ready)
            last = self._queue[-1].index if self._queue else index
            while len(self._queue) < len(self.slots) - 1:
                last = (last + 1) % len(self.offloaded)
                self._queue.append(self._issue(last))
        self._active[index] = slot
        block.bind(slot.views[index])

    def release(self, index: int) -> None:
        slot = self._active.pop(index, None)
        if slot is None:
            return
        if self.streamed:
            slot.free.record(self.backend.current_stream(self.index))
        block = self.offloaded[index]
        block.bind(block.home)

    def reset(self) -> None:
        """Wait for the reads in flight and forget the blocks fetched ahead: the next forward fetches every
        offloaded block itself."""
        self._drain()

    def close(self) -> None:
        self._drain()
        if self._reader is not None:
            self._reader.shutdown(wait=True)


def _quiesce(stream: Any | None) -> None:
    if stream is not None:
        stream.synchronize()


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_requires_grad(v) for v in value.values())
    return False


def _hooks(state: OffloadState, index: int) -> tuple[Any, Any]:
    block = state.offloaded[index]

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled() and (block.requires_grad or _requires_grad(args) or _requires_grad(kwargs)):
            raise RuntimeError(
                f"torchport.offload runs inference only: block {block.name!r} is offloaded to the {block.tier} "
                "tier and this forward would be recorded for backward, which needs weights no longer on the "
                "device. Run the model under torch.inference_mode() or torch.no_grad()"
            )
        state.acquire(index)

    def after(module: nn.Module, args: tuple, output: Any) -> None:
        state.release(index)

    return before, after


def _has_streams(backend: Backend, index: int) -> bool:
    try:
        return backend.current_stream(index) is not None
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


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
                   streams=_has_streams(backend, index))
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
        before, after = _hooks(state, i)
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
    offloaded: list[_Block] = []
    for name, module, own in zip(found.names, found.modules, found.params):
        if tiers[name] != "device":
            params = _layout(name, module, own)
            nbytes = sum(aligned(p.nbytes) for p in params)
            offloaded.append(_Block(name, module, tiers[name], params, nbytes))
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

    copy_stream = backend.stream(index) if offloaded and _has_streams(backend, index) else None
    slots: list[_Slot] = []
    staging: list[torch.Tensor] = []
    if offloaded:
        size = max(b.nbytes for b in offloaded)
        slots = [_Slot(torch.empty(size, dtype=torch.uint8, device=target), backend, offloaded)
                 for _ in range(result.buffers)]
        if copy_stream is not None and on_disk:
            staging = [backend.empty_pinned(max(b.nbytes for b in on_disk)) for _ in range(min(2, len(on_disk)))]
    for block in offloaded:
        for p in block.params:
            p.source = None  # the originals are released when the model lets go of them
    state = OffloadState(backend, index, result, found, offloaded, slots, staging, copy_stream, folder)
    state.places = {name: [place for p in _layout(name, module, own) for place in p.places]
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
