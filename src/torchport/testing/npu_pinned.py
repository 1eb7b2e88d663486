"""Pinned host memory on the simulated NPU, as torch_npu provides it on a chip.

torch_npu registers a pinned host allocator with its device hooks (Ascend/pytorch,
``torch_npu/csrc/core/npu/NPUHooksInterface.cpp``: ``getPinnedMemoryAllocator``, ``isPinnedPtr``), so
``t.pin_memory()``, ``DataLoader(pin_memory=True)`` and factories with ``pin_memory=True`` work on an NPU machine.
PyTorch's hooks for a backend written in Python cannot provide an allocator (``torch._C._acc.PrivateUse1Hooks``
has ``is_available``, ``is_built`` and ``has_primary_context`` only), so each of them fails in C++ there. The
simulation answers the two tensor methods in Python instead: pinning copies a host tensor into new host memory that
it remembers as pinned, ``is_pinned()`` says whether a host tensor's memory is such memory (views included), and a
device tensor cannot be pinned. DataLoader pins through ``Tensor.pin_memory``. The factories' ``pin_memory=True``
stays unsupported: replacing torch's factory functions would hide them from what looks them up by identity
(``torch.device`` as a context manager, TorchScript's builtins).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

__all__ = ["empty_pinned", "install", "is_pinned"]

# data_ptr of a pinned host storage -> the tensors handed out on it (weakly). A pointer counts as pinned while one of
# them is alive and still on that memory, so an address freed and reused, or a tensor moved to other memory
# (set_, resize_, .data =), is not taken for pinned memory.
_lock = threading.RLock()  # a weak reference's callback may run in a collection inside a locked section
_pinned: dict[int, list[weakref.ref]] = {}


def _forget(pointer: int) -> Any:
    def callback(dead: weakref.ref) -> None:
        with _lock:
            alive = [ref for ref in _pinned.get(pointer, ()) if ref is not dead and ref() is not None]
            if alive:
                _pinned[pointer] = alive
            else:
                _pinned.pop(pointer, None)

    return callback


def _mark(tensor: torch.Tensor) -> torch.Tensor:
    pointer = tensor.untyped_storage().data_ptr()
    if pointer:
        with _lock:
            _pinned.setdefault(pointer, []).append(weakref.ref(tensor, _forget(pointer)))
    return tensor


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a host tensor whose memory the simulation handed out as pinned (views included)."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return False
    pointer = tensor.untyped_storage().data_ptr()
    with _lock:
        holders = [ref() for ref in _pinned.get(pointer, ())]
    return any(held is not None and held.untyped_storage().data_ptr() == pointer for held in holders)


def empty_pinned(nbytes: int) -> torch.Tensor:
    """An uninitialised pinned host buffer of ``nbytes`` bytes (uint8): what ``torch.empty(nbytes,
    dtype=torch.uint8, pin_memory=True)`` gives on a chip."""
    return _mark(torch.empty(nbytes, dtype=torch.uint8))


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    if self.device.type != "cpu" or self.layout != torch.strided:
        raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
    if is_pinned(self):
        return self
    return _mark(self.clone())  # new host memory laid out as clone lays it out; differentiable, as pin_memory is


def _is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    return is_pinned(self)


def install() -> None:
    """Answer pinning in Python from now on (the simulation stays for the life of the process)."""
    torch.Tensor.pin_memory = _pin_memory
    torch.Tensor.is_pinned = _is_pinned
