"""The public device API: which device to use, what it can do, and the chores every script repeats.

Everything here asks the backend registry; nothing names a vendor module.
"""

from __future__ import annotations

import os
import random
from typing import Any, Union

import torch

from . import _settings
from .backends import Backend, detect, get_backend, list_backends

__all__ = ["DeviceLike", "device", "devices", "dtype", "generator", "resolve", "seed", "synchronize"]

DeviceLike = Union[str, torch.device, None]


def _available_types() -> list[str]:
    return [name for name in list_backends() if get_backend(name).is_available()]


def _describe_devices(backend: Backend) -> str:
    count = backend.device_count()
    if count == 0:
        return f"no {backend.name} device"
    listed = ", ".join(str(backend.device(i)) for i in range(count))
    return f"{count} {backend.name} device{'s' if count > 1 else ''} ({listed})"


def _select(kind: str, index: int | None, source: str) -> torch.device:
    """Check that ``kind[:index]`` exists on this machine and return it as a torch.device with an index."""
    backend = get_backend(kind, source=source)
    label = f"{kind}:{index}" if index is not None else kind
    if not backend.is_available() or backend.device_count() == 0:
        raise RuntimeError(
            f"{source}={label!r} asked for {kind}, but no {kind} device is available: "
            f"{backend.unavailable_reason()}. Available device types: {', '.join(_available_types())}"
            f"{_simulation_hint(kind)}"
        )
    if index is None:
        index = backend.current_index()
    if not 0 <= index < backend.device_count():
        variable = backend.visible_devices_variable
        hint = f" ({variable}={_env(variable)!r})" if variable and _env(variable) is not None else ""
        raise ValueError(
            f"{source}={label!r} asked for a device this machine does not have: it has "
            f"{_describe_devices(backend)}{hint}. Use an index below {backend.device_count()}."
        )
    return backend.device(index)


def _simulation_hint(kind: str) -> str:
    """How to try ``kind``'s code path on this machine, for the device types torchport can simulate."""
    if kind not in _settings._SIMULATABLE:
        return ""
    return (f". To try the {kind} code path without one, set TORCHPORT_SIMULATE={kind}: a simulated {kind} whose "
            f"arithmetic runs on the host (for tests and demos; its timings are the host's, not an {kind}'s)")


def _env(name: str) -> str | None:
    return os.environ.get(name)


def _parse(spec: str | torch.device | int, source: str) -> tuple[str, int | None]:
    if isinstance(spec, torch.device):
        return spec.type, spec.index
    if isinstance(spec, int) and not isinstance(spec, bool):
        return detect().name, spec
    if isinstance(spec, str):
        return _settings.parse_device_spec(spec, source)
    raise TypeError(f"{source} must be a device string, torch.device or index, got {type(spec).__name__}")


def device(prefer: str | torch.device | None = None, force_cpu: bool = False) -> torch.device:
    """Return the device to run on.

    Order: ``force_cpu``; then ``TORCHPORT_DEVICE`` (which forces, and fails if that device is absent); then
    ``prefer`` when that device type is available (an index in ``prefer`` must exist); then the first available
    of npu, cuda, xpu, mps, cpu. The returned device always carries an index (except the CPU).

    Args:
        prefer: a device type or ``type:index`` to use when present, e.g. ``"cuda"`` or ``"npu:1"``.
        force_cpu: return the CPU whatever is present.

    Example:
        >>> torchport.device()
        device(type='cuda', index=0)
    """
    if force_cpu:
        return torch.device("cpu")
    forced = _settings.get().device
    if forced is not None:
        kind, index = _settings.parse_device_spec(forced, "TORCHPORT_DEVICE")
        return _select(kind, index, "TORCHPORT_DEVICE")
    if prefer is not None:
        kind, index = _parse(prefer, "device")
        backend = get_backend(kind, source="device")
        if index is not None or (backend.is_available() and backend.device_count() > 0):
            return _select(kind, index, "device")  # an explicit index is a demand: say why it cannot be met
    backend = detect()
    return backend.device(backend.current_index())


def resolve(spec: DeviceLike | int = None, source: str = "device") -> tuple[Backend, int]:
    """Turn a user's device argument into (backend, index), checking that it exists.

    ``None`` means :func:`device`'s choice.

    Example:
        >>> from torchport.device import resolve
        >>> backend, index = resolve("cpu")
    """
    if spec is None:
        chosen = device()
    else:
        kind, index = _parse(spec, source)
        chosen = _select(kind, index, source)
    backend = get_backend(chosen.type)
    return backend, chosen.index if chosen.index is not None else 0


def devices() -> list[torch.device]:
    """Every usable device, accelerators first (in detection order), the CPU last.

    Example:
        >>> torchport.devices()
        [device(type='npu', index=0), device(type='npu', index=1), device(type='cpu')]
    """
    found: list[torch.device] = []
    for name in list_backends():
        if name == "cpu":
            continue
        backend = get_backend(name)
        if backend.is_available():
            found.extend(backend.device(i) for i in range(backend.device_count()))
    return [*found, torch.device("cpu")]


def dtype(device: DeviceLike = None) -> torch.dtype:
    """The preferred compute dtype of a device: bf16 if it works there, else fp16, else fp32.

    "Works" is decided by running a small matmul + softmax in each dtype against float64 (once per device).
    On a CPU, bf16 is preferred only where the CPU computes it natively (AVX512-BF16 or AMX).

    Example:
        >>> model.to(torchport.device(), torchport.dtype())
    """
    backend, index = resolve(device)
    return backend.preferred_dtype(index)


def synchronize(device: DeviceLike = None) -> None:
    """Wait for all work queued on a device (default: :func:`device`'s choice) to finish.

    Example:
        >>> torchport.synchronize()
    """
    backend, index = resolve(device)
    backend.synchronize(index)


def seed(n: int) -> int:
    """Seed Python's ``random``, NumPy (if installed), torch's CPU generator and every available device.

    Returns the seed, for logging.

    Example:
        >>> torchport.seed(0)
        0
    """
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {n!r}")
    random.seed(n)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(n % 2**32)  # NumPy's legacy seeding takes 32 bits
    torch.manual_seed(n)
    for name in _available_types():
        get_backend(name).manual_seed_all(n)
    return n


def generator(seed: int, device: DeviceLike = None) -> torch.Generator:
    """A new random generator for a device, seeded; pass it as ``generator=`` to random ops.

    Example:
        >>> g = torchport.generator(0)
        >>> torch.randn(4, device=torchport.device(), generator=g)
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    backend, index = resolve(device)
    return backend.generator(seed, index)


def describe(device: DeviceLike = None, probe: bool = True) -> dict[str, Any]:
    """Everything torchport knows about one device, as plain data (see :func:`torchport.info`)."""
    backend, index = resolve(device)
    entry: dict[str, Any] = {
        "device": str(backend.device(index)),
        "type": backend.name,
        "name": backend.device_name(index),
        "properties": backend.properties(index),
        "memory": _memory_entry(backend, index),
        "dist_backend": backend.dist_backend,
        "visible_devices_variable": backend.visible_devices_variable,
        "visible_devices": _env(backend.visible_devices_variable) if backend.visible_devices_variable else None,
        "versions": backend.versions(),
    }
    probe = probe and _settings.get().probe
    if probe:
        entry["dtype_probes"] = [p.to_dict() for p in backend.dtype_probes(index).values()]
    entry["preferred_dtype"] = str(backend.preferred_dtype(index, probe)).removeprefix("torch.")
    return entry


def _memory_entry(backend: Backend, index: int) -> dict[str, Any]:
    info = backend.mem_get_info(index)
    stats = backend.memory_stats(index)
    return {"free": info[0] if info else None, "total": info[1] if info else None, **stats}
