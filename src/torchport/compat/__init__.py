"""The zero-change shim: code written for CUDA runs on whatever device is present.

``patch()`` maps every CUDA device name (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda", N)``, ``.cuda()``,
``torch.cuda.*``, the legacy ``torch.cuda.FloatTensor``-style types, autocast and GradScaler for "cuda", ``nccl``,
device meshes on "cuda") onto the target device; ``unpatch()`` puts every attribute back. On a CUDA target nothing
needs redirecting and nothing is patched. On the CPU, ``torch.cuda.is_available()`` answers True to the program
(not to torch or other libraries, which would then pick CUDA-only internals, unless a library is checking a CUDA
device the program handed it), so the program takes its GPU path and that path runs on the host: autocast in bf16,
loss scaling off, synchronize a no-op, memory functions reporting the process's resident memory, and
``torch.cuda.device_count()`` at least the number of torchrun ranks sharing the host.

Example:
    >>> import torchport.compat
    >>> torchport.compat.patch()          # or: import torchport.auto; or: torchport run train.py
    >>> torch.ones(2, device="cuda").device
    device(type='npu', index=0)
    >>> torchport.compat.unpatch()
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

from .._settings import parse_device_spec
from ..device import DeviceLike, resolve
from .cpu_fallback import cpu_fallback
from .redirect import Patcher, Target
from .report import Recorder

__all__ = ["patch", "unpatch", "is_patched", "target", "report", "cpu_fallback"]

_lock = threading.RLock()
_state: dict[str, Any] = {}


def patch(target: DeviceLike = None) -> torch.device:
    """Redirect CUDA calls to ``target`` (default: :func:`torchport.device`). Idempotent; thread-safe.

    Returns:
        The target device. Patching again with another target first undoes the previous patch.

    Example:
        >>> torchport.compat.patch("cpu")
        device(type='cpu')
    """
    backend, index = resolve(target, source="target")
    if isinstance(target, str):
        explicit = parse_device_spec(target, "target")[1] is not None
    else:
        explicit = isinstance(target, torch.device) and target.index is not None
    with _lock:
        current = _state.get("target")
        if current is not None:
            if current.type == backend.name:
                return current.device(index)
            unpatch()
        if explicit:  # selecting a device creates its context (0.3 s on an H100): only when one was named
            backend.set_index(index)
        chosen = Target(backend, Recorder())
        patcher = Patcher()
        _state.update(target=chosen, patcher=patcher, guard=None, jit=[])
        if backend.name != "cuda":  # on CUDA itself there is nothing to redirect
            from . import cuda_api, cuda_only, jit, libraries, tensor_types, torch_api
            from torch.jit import _builtins

            _builtins._get_builtin_table()  # built from torch's own functions, before any is replaced

            torch_api.install(chosen, patcher, lambda *a, **k: cuda_api.make_event(chosen, *a, **k),
                              lambda *a, **k: cuda_api.make_stream(chosen, *a, **k))
            cuda_api.install(chosen, patcher)
            tensor_types.install(chosen, patcher)
            _state["guard"] = cuda_only.install(chosen, patcher, libraries.hooks(chosen, patcher))
            _state["jit"] = jit.install(patcher)
        return chosen.device(index)


def unpatch() -> None:
    """Undo :func:`patch`: every patched attribute gets back its original value. Safe to call when not patched."""
    with _lock:
        patcher = _state.pop("patcher", None)
        guard = _state.pop("guard", None)
        _state.pop("target", None)
        from . import jit

        jit.uninstall(_state.pop("jit", []))
        failures = patcher.restore() if patcher is not None else []
        if guard is not None and guard in sys.meta_path:
            sys.meta_path.remove(guard)
        if failures:
            raise RuntimeError(f"torchport.compat.unpatch could not put back: {'; '.join(failures)}")


def is_patched() -> bool:
    """Whether the shim is active in this process."""
    return "target" in _state


def target() -> torch.device | None:
    """The device CUDA calls go to, or None when the shim is not active."""
    chosen = _state.get("target")
    return None if chosen is None else chosen.device()


def report() -> dict[str, Any]:
    """What the active shim redirected (API, count, first call site), the CUDA-only things it met, and the operators
    :func:`cpu_fallback` ran on the CPU."""
    chosen = _state.get("target")
    if chosen is None:
        from .cpu_fallback import calls

        return {"target": None, "redirected": [], "cuda_only": [], "cpu_fallback": calls()}
    return {"target": str(chosen.device()), **chosen.recorder.to_dict()}


def print_report(file: Any = None) -> None:
    """Print :func:`report` as tables (stderr by default)."""
    chosen = _state.get("target")
    if chosen is not None:
        chosen.recorder.print(str(chosen.device()), file)
