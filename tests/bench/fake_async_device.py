"""A model of an asynchronous device for timing tests: queued work finishes later than the call that queued it.

``launch(ms)`` returns at once and makes the device busy for ``ms`` more milliseconds after the work already
queued; ``synchronize`` sleeps until the device is idle. Events complete when the device reaches them, as on CUDA:
``elapsed_time`` of an event the device has not reached raises, as CUDA's "not ready" does. Installed on a real
backend with :func:`install`, it makes any timing that forgets to synchronise come out short or fail.
"""

from __future__ import annotations

import time

import pytest

from torchport.backends import get_backend


class AsyncDevice:
    def __init__(self) -> None:
        self.busy_until = time.perf_counter()

    def launch(self, ms: float) -> None:
        self.busy_until = max(time.perf_counter(), self.busy_until) + ms / 1e3

    def synchronize(self, index: int | None = None) -> None:
        remaining = self.busy_until - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: AsyncDevice) -> None:
        self.device = device
        self.time: float | None = None

    def record(self, stream: object = None) -> None:
        self.time = max(time.perf_counter(), self.device.busy_until)  # reached after the work queued before it

    def query(self) -> bool:
        return self.time is not None and time.perf_counter() >= self.time

    def synchronize(self) -> None:
        if self.time is not None:
            time.sleep(max(0.0, self.time - time.perf_counter()))

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("event not completed: the device has not reached it (synchronize first)")
        return (end.time - self.time) * 1e3


def install(monkeypatch: pytest.MonkeyPatch, device_type: str, with_events: bool) -> AsyncDevice:
    """Make ``device_type``'s backend asynchronous (for this test only); with or without device events."""
    device = AsyncDevice()
    backend = get_backend(device_type)
    monkeypatch.setattr(backend, "synchronize", device.synchronize)
    monkeypatch.setattr(backend, "event", device.event if with_events else (lambda enable_timing=False: None))
    return device
