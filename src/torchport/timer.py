"""Honest timing of device work: device events where the device has them, else a synchronised host clock.

:func:`timing_event` is the one place that chooses: it asks the device's backend for an event, and on devices
without events (the CPU) gives a :class:`HostEvent`, which synchronises the device and reads the host clock when it
is recorded. :class:`Timer`, :func:`torchport.bench.measure` and :class:`torchport.bench.Monitor` time with it.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

import torch

from .device import DeviceLike, resolve

__all__ = ["EVENTS", "HOST_CLOCK", "HostEvent", "Timer", "clock", "timing_event"]

#: How times were taken: the device's events, or the host clock after synchronising the device.
EVENTS = "device events"
HOST_CLOCK = "host clock, synchronised"


class HostEvent:
    """An event for devices without events, with the same methods: :meth:`record` waits for the device's queued
    work, then reads the host clock."""

    def __init__(self, backend: Any, index: int | None) -> None:
        self._backend, self._index = backend, index
        self.time: float | None = None

    def record(self) -> None:
        self._backend.synchronize(self._index)
        self.time = time.perf_counter()

    def query(self) -> bool:
        return True  # complete when recorded: record waited for the device

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end``."""
        if self.time is None or end.time is None:
            raise RuntimeError("HostEvent.elapsed_time: both events must be recorded first")
        return (end.time - self.time) * 1e3


def timing_event(backend: Any, index: int | None) -> Any:
    """An event for timing work on ``backend``'s device ``index``: the device's own (recorded on its current
    stream), or a :class:`HostEvent` where the backend has no events. :func:`clock` names which.

    Example:
        >>> start, end = timing_event(backend, 0), timing_event(backend, 0)
        >>> start.record(); work(); end.record(); end.synchronize()
        >>> start.elapsed_time(end)   # milliseconds
    """
    event = backend.event(enable_timing=True)
    return HostEvent(backend, index) if event is None else event


def clock(event: Any) -> str:
    """How an event from :func:`timing_event` times: :data:`EVENTS` or :data:`HOST_CLOCK`."""
    return HOST_CLOCK if isinstance(event, HostEvent) else EVENTS


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
        self._start: Any = None

    def __enter__(self) -> Timer:
        self.ms = None
        self._start = timing_event(self._backend, self._index)
        self._start.record()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        end = timing_event(self._backend, self._index)
        end.record()
        end.synchronize()
        self.ms = float(self._start.elapsed_time(end))

    def __repr__(self) -> str:
        shown = "running" if self.ms is None else f"{self.ms:.3f} ms"
        return f"Timer({self.device}, {shown})"
