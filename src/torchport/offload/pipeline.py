"""The copy pipeline of an offloaded model: how its blocks, living on three tiers (device, pinned host memory,
disk), are copied in ahead of use.

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
  once they are evicted; :func:`torchport.offload.evict_disk_tier` evicts them, for measurements).

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
import weakref
from typing import Any

import torch
from torch import nn

from ..backends import Backend
from .disk import DiskBlock
from .placement import ModelBlocks, Placement, aligned

__all__ = ["BlockParam", "OffloadState", "OffloadedBlock", "Slot", "has_streams", "hooks", "layout"]


@dataclasses.dataclass
class BlockParam:
    """One parameter of an offloaded block: its place in the block's flat byte range, and the submodules holding it."""

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
class OffloadedBlock:
    """A block that lives off the device: its parameters' layout, and its copy on its home tier."""

    name: str
    module: nn.Module
    tier: str
    params: list[BlockParam]
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


def layout(block_name: str, module: nn.Module, own: list[nn.Parameter]) -> list[BlockParam]:
    """The parameters ``own`` of block ``module`` laid out in one flat byte range, each offset aligned."""
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
        out.append(BlockParam(keys[id(p)], places[id(p)], offset, nbytes, p.dtype, tuple(p.shape), p.requires_grad, p))
        offset += aligned(nbytes)
    return out


class Slot:
    """One reusable device buffer, with views made once for every offloaded block: no tensor is made per call
    (the simulated NPU cannot even make views inside ``torch.inference_mode()``)."""

    def __init__(self, buffer: torch.Tensor, backend: Backend, blocks: list[OffloadedBlock]) -> None:
        self.ready = backend.event()
        self.free = backend.event()
        self.heads = [buffer[:block.nbytes] for block in blocks]  # copy destinations
        self.views = [{p.key: nn.Parameter(p.view(buffer), requires_grad=False) for p in block.params}
                      for block in blocks]


@dataclasses.dataclass
class _Pending:
    index: int
    slot: Slot
    future: concurrent.futures.Future | None


class OffloadState:
    """What ``offload`` attached to a model: the placement, the blocks, the buffers, the copy pipeline."""

    def __init__(self, backend: Backend, index: int, plan: Placement, blocks: ModelBlocks,
                 offloaded: list[OffloadedBlock], slots: list[Slot], staging: list[torch.Tensor],
                 copy_stream: Any | None, disk_dir: str | None) -> None:
        self.backend, self.index, self.plan, self.blocks = backend, index, plan, blocks
        self.device = backend.device(index)
        self.offloaded, self.slots, self.copy_stream, self.disk_dir = offloaded, slots, copy_stream, disk_dir
        self.staging = [(buffer, backend.event()) for buffer in staging]
        self._next_slot = 0
        self._next_staging = 0
        self._queue: collections.deque[_Pending] = collections.deque()
        self._active: dict[int, Slot] = {}
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

    def _to_slot(self, source: torch.Tensor, dst: torch.Tensor, slot: Slot, done: Any | None = None) -> None:
        stream = self.copy_stream
        with self.backend.use_stream(stream):
            stream.wait_event(slot.free)
            dst.copy_(source, non_blocking=True)
            slot.ready.record(stream)
            if done is not None:
                done.record(stream)

    def _read_disk(self, index: int, block: OffloadedBlock, slot: Slot) -> None:
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


def hooks(state: OffloadState, index: int) -> tuple[Any, Any]:
    """The forward pre-hook and the forward hook of offloaded block ``index``: fetch its weights, then let them go."""
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


def has_streams(backend: Backend, index: int) -> bool:
    """Whether device ``index`` of ``backend`` has streams, so that copies can overlap compute."""
    try:
        return backend.current_stream(index) is not None
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
