"""The state of the simulated NPU: its devices, the current one per thread, memory, generators and the operators
declared missing.

Memory follows a caching allocator: the bytes of live simulated storages count as allocated (views share),
allocations round up to 512-byte blocks, freed blocks stay reserved until ``empty_cache``, peaks are kept, and an
allocation past the device's size (times its memory fraction) raises ``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from ..backends.npu import ChipProfile

if TYPE_CHECKING:
    from .npu_tensor import SimulatedTensor

__all__ = ["NPU", "DeviceMemory", "State", "is_active", "start", "state"]

#: the device type the simulation registers, as torch_npu does
NPU = "npu"
GiB = 1024**3
_BLOCK = 512  # the caching allocator's rounding, as in CUDA's and torch_npu's allocators


@dataclasses.dataclass
class DeviceMemory:
    """One device's memory counters, in bytes (``cached``: freed but still reserved)."""

    total: int
    allocated: int = 0
    peak_allocated: int = 0
    reserved: int = 0
    peak_reserved: int = 0
    cached: int = 0
    alloc_count: int = 0
    free_count: int = 0


class State:
    """The simulated NPU of this process: its chip, and per device its memory, generator and memory fraction."""

    def __init__(self, device_count: int, total_memory: int, chip: ChipProfile) -> None:
        self.device_count = device_count
        self.chip = chip
        self.memory = [DeviceMemory(total_memory) for _ in range(device_count)]
        self.generators = [torch.Generator() for _ in range(device_count)]
        self.initial_seeds = [g.initial_seed() for g in self.generators]
        self.memory_fraction = [1.0] * device_count
        self.storages: dict[tuple[int, int], list[int]] = {}  # (device, data_ptr) -> [wrapper count, bytes]
        self.lock = threading.RLock()
        self.local = threading.local()
        # operators declared missing: one (overloads, torch_npu_fallback) entry per active declaration
        self.declarations: list[tuple[frozenset[str], bool]] = []
        self.missing: frozenset[str] = frozenset()  # "aten::add.Tensor", "aten::erfinv" (the default overload)
        self.host_fallback = False
        self.support: dict[str, str | None] = {}  # operator -> op_support answer, for the declarations in force
        self.fallback_warned: set[str] = set()

    def redeclare(self) -> None:
        with self.lock:
            self.missing = frozenset().union(*(d[0] for d in self.declarations))
            self.host_fallback = self.declarations[-1][1] if self.declarations else False
            self.support.clear()

    # -- current device (per thread, as on CUDA and torch_npu) --------------------------------------------------
    @property
    def current(self) -> int:
        return getattr(self.local, "index", 0)

    @current.setter
    def current(self, index: int) -> None:
        self.local.index = index

    def check_index(self, index: int) -> int:
        if not 0 <= index < self.device_count:
            raise RuntimeError(
                f"Invalid device npu:{index}: the simulated NPU has {self.device_count} device(s), "
                f"indices 0 to {self.device_count - 1}"
            )
        return index

    def resolve(self, device: torch.device | str | int | None) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return self.check_index(device)
        device = torch.device(device)
        if device.type != NPU:
            raise ValueError(f"expected an npu device, got {device}")
        return self.current if device.index is None else self.check_index(device.index)

    # -- memory accounting --------------------------------------------------------------------------------------
    def track(self, wrapper: SimulatedTensor, index: int) -> None:
        storage = wrapper._raw.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        key = (index, storage.data_ptr())
        with self.lock:
            entry = self.storages.get(key)
            if entry is None:
                self._allocate(index, nbytes)
                entry = self.storages[key] = [0, nbytes]
            entry[0] += 1
        # kept on the wrapper, so that a new host tensor behind it (t.data = other) releases this one at once
        wrapper.__dict__["_tracked"] = weakref.finalize(wrapper, self._release, key)

    def _allocate(self, index: int, nbytes: int) -> None:
        mem = self.memory[index]
        rounded = -(-nbytes // _BLOCK) * _BLOCK
        from_cache = min(mem.cached, rounded)
        grow = rounded - from_cache
        limit = int(mem.total * self.memory_fraction[index])
        if mem.reserved + grow > limit:
            raise torch.OutOfMemoryError(
                f"NPU out of memory (simulated). Tried to allocate {nbytes / 2**20:.2f} MiB on npu:{index} "
                f"({mem.total / GiB:.2f} GiB total; {mem.allocated / GiB:.2f} GiB already allocated; "
                f"{mem.reserved / GiB:.2f} GiB reserved in total; limit {limit / GiB:.2f} GiB)"
            )
        mem.cached -= from_cache
        mem.reserved += grow
        mem.allocated += nbytes
        mem.alloc_count += 1
        mem.peak_allocated = max(mem.peak_allocated, mem.allocated)
        mem.peak_reserved = max(mem.peak_reserved, mem.reserved)

    def _release(self, key: tuple[int, int]) -> None:
        with self.lock:
            entry = self.storages.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] > 0:
                return
            del self.storages[key]
            mem = self.memory[key[0]]
            mem.allocated -= entry[1]
            mem.cached += -(-entry[1] // _BLOCK) * _BLOCK
            mem.free_count += 1


_state: State | None = None


def state() -> State:
    if _state is None:
        raise RuntimeError("the simulated NPU is not active; call torchport.testing.simulate_npu() first")
    return _state


def is_active() -> bool:
    """Whether this process runs the simulated NPU."""
    return _state is not None


def start(device_count: int, total_memory: int, chip: ChipProfile) -> State:
    """The state of the simulated NPU that :func:`torchport.testing.simulated_npu.activate` starts, once a process."""
    global _state
    _state = State(device_count, total_memory, chip)
    return _state
