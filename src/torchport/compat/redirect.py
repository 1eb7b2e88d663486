"""The pieces every patch uses: where "cuda" goes (:class:`Target`), how attributes are swapped and restored
(:class:`Patcher`), and whether a call comes from the user's program or from a library (:func:`called_by_user`,
:func:`asked_for_user`)."""

from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Any

import torch

from .._patching import Journal as Patcher  # swaps attributes and puts back exactly what was there
from ..backends import Backend
from .report import Recorder

__all__ = ["Patcher", "Target", "asked_for_user", "asked_outside_inductor", "called_by_user"]

# Libraries that ask torch.cuda.is_available() to choose CUDA-only internals (kernels, NCCL, streams). They get the
# real answer; the user's program gets "yes" so it takes its GPU path. accelerate#3020 is this failure, seen with
# torch_npu's transfer_to_npu, which answers "yes" to everyone.
_LIBRARIES = frozenset({
    "torch", "torchport", "transformers", "accelerate", "peft", "triton", "torchvision", "torchaudio", "diffusers",
    "deepspeed", "lightning", "pytorch_lightning", "safetensors", "timm", "numpy", "torch_npu", "torchao",
})


# Never answered for the user: torch maps CUDA device names at its own API (the shim patches it there), and asks
# is_available() itself only to choose CUDA-only internals (lazy init, streams, NCCL).
_DEVICE_LIBRARIES = frozenset({"torch", "torchport", "torch_npu", "triton"})


def _package(frame: FrameType) -> str:
    return (frame.f_globals.get("__name__") or "").partition(".")[0]


def called_by_user(depth: int = 2) -> bool:
    """Whether the frame ``depth`` levels up belongs to the user's code rather than to a known library."""
    return _package(sys._getframe(depth)) not in _LIBRARIES


def asked_outside_inductor(depth: int = 2) -> bool:
    """Whether the frame ``depth`` levels up is not Inductor's.

    Inductor reads CUDA's device properties for its own purposes without asking ``is_available()`` first: its cache
    key reads ``get_device_properties(current_device())`` on every machine and expects the error a build without
    CUDA raises. It hears the truth. Everyone else hears the target's answer, dynamo included: when it traces a
    program's ``get_device_capability()`` it calls the function from its own frames, and the compiled program must
    see what the eager one sees.
    """
    return not (sys._getframe(depth).f_globals.get("__name__") or "").startswith("torch._inductor")


def asked_for_user(depth: int = 2) -> bool:
    """Whether the frame ``depth`` levels up is the user's code, or a library doing what the user's code asked of
    it on a CUDA device.

    A library asks ``torch.cuda.is_available()`` for one of two reasons: to choose CUDA-only internals on its own
    initiative (then it must hear the truth), or to check that a device it was handed can be used, as a helper
    called with ``device="cuda"`` that asserts CUDA is there before ``torch.device(device)``. The second is told
    what the user's code is told, since the shim sends that device to the target. The call counts as the second
    when the library's frames, from the user's call down to the question, hold a CUDA device (``"cuda"``,
    ``"cuda:N"``, ``torch.device("cuda")``) among their arguments, and the frame that asks is not torch's own.
    """
    frame: FrameType | None = sys._getframe(depth)
    if _package(frame) not in _LIBRARIES:
        return True
    if _package(frame) in _DEVICE_LIBRARIES:
        return False
    handed = False
    while frame is not None:
        if _package(frame) not in _LIBRARIES:
            return handed  # the user's call into the library
        handed = handed or _has_cuda_argument(frame)
        frame = frame.f_back
    return False  # no user code above: the library runs on its own (at import, in a thread it started)


def _has_cuda_argument(frame: FrameType) -> bool:
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    star, double_star = code.co_flags & inspect.CO_VARARGS, code.co_flags & inspect.CO_VARKEYWORDS
    names = code.co_varnames[:count + bool(star) + bool(double_star)]
    values = frame.f_locals
    for position, name in enumerate(names):
        value = values.get(name)
        if position >= count and isinstance(value, (tuple, dict)):  # *args, **kwargs
            if any(_is_cuda(v) for v in (value.values() if isinstance(value, dict) else value)):
                return True
        elif _is_cuda(value):
            return True
    return False


def _is_cuda(value: Any) -> bool:
    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    return isinstance(value, torch.device) and value.type == "cuda"


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
