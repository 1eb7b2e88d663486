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

__all__ = ["install", "is_pinned"]

_lock = threading.Lock()
_pinned: dict[int, int] = {}  # data_ptr of a pinned host storage -> tensors handed out on it that are alive


def _mark(tensor: torch.Tensor) -> torch.Tensor:
    pointer = tensor.untyped_storage().data_ptr()
    if pointer:
        with _lock:
            _pinned[pointer] = _pinned.get(pointer, 0) + 1
        weakref.finalize(tensor, _unmark, pointer)
    return tensor


def _unmark(pointer: int) -> None:
    with _lock:
        left = _pinned.get(pointer, 0) - 1
        if left > 0:
            _pinned[pointer] = left
        else:
            _pinned.pop(pointer, None)


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a host tensor whose memory the simulation handed out as pinned (views included)."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return False
    pointer = tensor.untyped_storage().data_ptr()
    with _lock:
        return pointer in _pinned


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    if self.device.type != "cpu" or self.layout != torch.strided:
        raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
    if is_pinned(self):
        return self
    return _mark(self.clone())  # new host memory, strides kept, differentiable as pin_memory is


def _is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    return is_pinned(self)


def install() -> None:
    """Answer pinning in Python from now on (the simulation stays for the life of the process)."""
    torch.Tensor.pin_memory = _pin_memory
    torch.Tensor.is_pinned = _is_pinned
