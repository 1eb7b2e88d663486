"""The backend registry: one file per device type, found by name.

Built-in backends are imported on first use; third-party packages add theirs through the
``torchport.backends`` entry-point group (the entry point loads a module that calls :func:`register_backend`).

Example:
    >>> from torchport.backends import get_backend, list_backends
    >>> list_backends()
    ['npu', 'cuda', 'xpu', 'mps', 'cpu']
    >>> get_backend("cpu").device_count()
    1
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .._registry import Registry
from .base import Backend, DtypeProbe

__all__ = ["Backend", "DtypeProbe", "register_backend", "get_backend", "list_backends", "detect", "DETECTION_ORDER"]

#: Built-in device types in detection order. NPU goes before CUDA: a CUDA->NPU shim (torch_npu's
#: transfer_to_npu, or torchport's own) makes torch.cuda.is_available() report True on Ascend machines.
DETECTION_ORDER = ("npu", "cuda", "xpu", "mps", "cpu")
ENTRY_POINT_GROUP = "torchport.backends"

_backends: Registry[type[Backend]] = Registry(
    "device type", modules={name: f"{__name__}.{name}" for name in DETECTION_ORDER},
    entry_point_group=ENTRY_POINT_GROUP, replaceable=True, origin=lambda cls: cls.__qualname__)
_instances: dict[str, Backend] = {}
_lock = threading.RLock()


def register_backend(name: str, *, replace: bool = False) -> Callable[[type[Backend]], type[Backend]]:
    """Class decorator that registers a :class:`Backend` subclass for the device type ``name``.

    A second registration of the same name is refused unless ``replace=True`` (used by torchport.testing to put
    the simulated NPU's variant of the npu backend in place).

    Example:
        >>> @register_backend("mydev")
        ... class MyDevBackend(Backend):
        ...     name = "mydev"
    """

    def decorate(cls: type[Backend]) -> type[Backend]:
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise TypeError(f"register_backend({name!r}) decorates Backend subclasses, got {cls!r}")
        if getattr(cls, "name", None) != name:
            raise ValueError(f"register_backend({name!r}) got {cls.__name__} whose name is {cls.name!r}")
        with _lock:
            _backends.register(name, cls, replace=replace)
            _instances.pop(name, None)
        return cls

    return decorate


def list_backends() -> list[str]:
    """Names of every registered device type: built-ins in detection order, then third-party ones."""
    return _backends.names()


def get_backend(name: str, *, source: str | None = None) -> Backend:
    """Return the backend for a device type, importing it on first use.

    Args:
        name: a device type such as ``"npu"``, ``"cuda"`` or ``"cpu"``.
        source: where the name came from (``"TORCHPORT_DEVICE"``, ``"--device"``), for the error message.

    Raises:
        ValueError: no backend is registered under that name; the message lists the registered ones.
    """
    with _lock:
        instance = _instances.get(name)
        if instance is not None:
            return instance
        cls = _backends.get(name, source=source)
        instance = _instances[name] = cls()
        return instance


def detect() -> Backend:
    """The first available backend in detection order (npu, cuda, xpu, mps, then third-party, then cpu)."""
    order = [name for name in list_backends() if name != "cpu"] + ["cpu"]
    for name in order:
        backend = get_backend(name)
        if backend.is_available() and backend.device_count() > 0:
            return backend
    raise AssertionError("the cpu backend is always available")  # pragma: no cover
