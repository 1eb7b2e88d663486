"""The pieces every patch uses: where "cuda" goes (:class:`Target`), how attributes are swapped and restored
(:class:`Patcher`), and whether a call comes from the user's program or from a library (:func:`called_by_user`)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..backends import Backend
from .report import Recorder

__all__ = ["Patcher", "Target", "called_by_user"]

# Libraries that ask torch.cuda.is_available() to choose CUDA-only internals (kernels, NCCL, streams). They get the
# real answer; the user's program gets "yes" so it takes its GPU path. accelerate#3020 is this failure, seen with
# torch_npu's transfer_to_npu, which answers "yes" to everyone.
_LIBRARIES = frozenset({
    "torch", "torchport", "transformers", "accelerate", "peft", "triton", "torchvision", "torchaudio", "diffusers",
    "deepspeed", "lightning", "pytorch_lightning", "safetensors", "timm", "numpy", "torch_npu", "torchao",
})


def called_by_user(depth: int = 2) -> bool:
    """Whether the frame ``depth`` levels up belongs to the user's code rather than to a known library."""
    name = sys._getframe(depth).f_globals.get("__name__") or ""
    return name.partition(".")[0] not in _LIBRARIES


class Target:
    """Where CUDA-written code is sent: a backend, and the mapping of CUDA device names onto it."""

    def __init__(self, backend: Backend, recorder: Recorder) -> None:
        self.backend = backend
        self.type = backend.name
        self.recorder = recorder

    def __repr__(self) -> str:
        return f"Target({self.type})"

    @property
    def host(self) -> bool:
        """Whether the target is the host CPU, which every rank and every CUDA index shares."""
        return self.backend.device(0).index is None

    def device(self, index: int | None = None) -> torch.device:
        """The target device for a CUDA index (None: the current device)."""
        return self.backend.device(self.backend.current_index() if index is None else index)

    def index(self, value: Any) -> int:
        """The device index meant by a torch.cuda function's ``device`` argument (None, int, str, device)."""
        if value is None:
            return self.backend.current_index()
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, (str, torch.device)):
            dev = torch.device(self.map(value))
            return dev.index if dev.index is not None else self.backend.current_index()
        index = getattr(value, "index", None)  # a device object from another API
        return index if isinstance(index, int) else self.backend.current_index()

    def map(self, value: Any, api: str | None = None) -> Any:
        """``"cuda"``, ``"cuda:N"`` and ``torch.device("cuda", N)`` onto the target; anything else unchanged."""
        if isinstance(value, str):
            if value != "cuda" and not value.startswith("cuda:"):
                return value
            index = value.partition(":")[2]
            mapped: Any = str(self.device(int(index))) if index else self.type
        elif isinstance(value, torch.device) and value.type == "cuda":
            mapped = self.device(value.index) if value.index is not None else torch.device(self.type)
        else:
            return value
        if api:
            self.recorder.record(api)
        return mapped

    def map_index(self, value: Any, api: str | None = None) -> Any:
        """Like :meth:`map`, and a bare int (a CUDA device index) too."""
        if isinstance(value, int) and not isinstance(value, bool):
            if api:
                self.recorder.record(api)
            return self.device(value)
        return self.map(value, api)


_MISSING = object()


class Patcher:
    """Swaps attributes and puts back exactly what was there (or removes what was not)."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self.lock = threading.RLock()

    def set(self, owner: Any, name: str, value: Any) -> None:
        original = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, value)

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` by ``make(current)``; skipped when this torch has no such attribute."""
        current = getattr(owner, name, _MISSING)
        if current is not _MISSING:
            self.set(owner, name, make(current))

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            if original is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)
        self._saved.clear()

    def patched(self) -> list[tuple[Any, str]]:
        return [(owner, name) for owner, name, _ in self._saved]
