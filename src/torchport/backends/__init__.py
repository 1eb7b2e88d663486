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

import importlib
import logging
import threading
from collections.abc import Callable
from importlib import metadata

from .base import Backend, DtypeProbe

__all__ = ["Backend", "DtypeProbe", "register_backend", "get_backend", "list_backends", "detect", "DETECTION_ORDER"]

logger = logging.getLogger("torchport")

#: Built-in device types in detection order. NPU goes before CUDA: a CUDA->NPU shim (torch_npu's
#: transfer_to_npu, or torchport's own) makes torch.cuda.is_available() report True on Ascend machines.
DETECTION_ORDER = ("npu", "cuda", "xpu", "mps", "cpu")
_BUILTIN_MODULES = {name: f"{__name__}.{name}" for name in DETECTION_ORDER}
ENTRY_POINT_GROUP = "torchport.backends"

_backends: dict[str, type[Backend]] = {}
_instances: dict[str, Backend] = {}
_lock = threading.RLock()
_entry_points_loaded = False


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
            if name in _backends and not replace and _backends[name] is not cls:
                raise ValueError(
                    f"a backend named {name!r} is already registered ({_backends[name].__qualname__}); "
                    "choose another name or pass replace=True"
                )
            _backends[name] = cls
            _instances.pop(name, None)
        return cls

    return decorate


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as exc:  # a broken third-party plugin must not stop torchport from working
            logger.warning("torchport backend plugin %r failed to load: %s", entry.value, exc)


def list_backends() -> list[str]:
    """Names of every registered device type: built-ins in detection order, then third-party ones."""
    _load_entry_points()
    with _lock:
        extra = sorted(name for name in _backends if name not in _BUILTIN_MODULES)
    return [*DETECTION_ORDER, *extra]


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
        if name not in _backends and name in _BUILTIN_MODULES:
            importlib.import_module(_BUILTIN_MODULES[name])
        if name not in _backends:
            _load_entry_points()
        cls = _backends.get(name)
        if cls is None:
            label = f"{source}={name!r}" if source else repr(name)
            raise ValueError(f"{label} is not a device type; registered: {', '.join(list_backends())}")
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
