"""Honest timing of device work: device events where the device has them, else a synchronised host clock."""

from __future__ import annotations

import time
from types import TracebackType

import torch

from .device import DeviceLike, resolve

__all__ = ["Timer"]


class Timer:
    """Context manager that times the device work queued inside it, in milliseconds.

    Device events are recorded on the device's current stream at entry and exit, and the exit waits for the end
    event, so asynchronous work is counted. Devices without events (the CPU) use the host clock, synchronised.
    Timers on different devices can nest; each one times its own device.

    Args:
        device: the device whose work is timed (default: :func:`torchport.device`'s choice).

    Example:
        >>> with torchport.Timer() as t:
        ...     y = model(x)
        >>> print(f"{t.ms:.2f} ms")
    """

    def __init__(self, device: DeviceLike = None) -> None:
        self._backend, self._index = resolve(device)
        self.device: torch.device = self._backend.device(self._index)
        self.ms: float | None = None
        self._start = self._end = None
        self._t0 = 0.0

    def __enter__(self) -> Timer:
        self.ms = None
        self._start = self._backend.event(enable_timing=True)
        if self._start is not None:
            self._end = self._backend.event(enable_timing=True)
            self._start.record()
        else:
            self._backend.synchronize(self._index)
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._start is not None:
            self._end.record()
            self._end.synchronize()
            self.ms = float(self._start.elapsed_time(self._end))
        else:
            self._backend.synchronize(self._index)
            self.ms = (time.perf_counter() - self._t0) * 1e3

    def __repr__(self) -> str:
        shown = "running" if self.ms is None else f"{self.ms:.3f} ms"
        return f"Timer({self.device}, {shown})"
