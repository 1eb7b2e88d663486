"""Timing the steps of the caller's own loop (training or serving), without changing the loop."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from ..device import DeviceLike, resolve
from ..timer import EVENTS, HOST_CLOCK, clock, timing_event
from .timing import Result, is_simulated

__all__ = ["Monitor"]

# Pending event pairs are read once this many have piled up (those already complete), so a long loop neither
# waits on the device at each step nor keeps millions of events alive.
_RESOLVE_EVERY = 256


class Monitor:
    """Times each step of a loop: ``with monitor:`` (or ``with monitor.step(items=n):``) around the step's work.

    A step records a pair of events from :func:`torchport.timer.timing_event`. On devices with events they go on
    the current stream and the step does not wait for the device, so the loop keeps its pace; the times are read
    when they are complete and in :meth:`report`. On the CPU the host clock is read around the step, synchronised. The first ``warmup`` steps are not counted; peak memory
    counters are reset when the first counted step starts. Steps that raise are not counted.

    Args:
        device: the device whose work is timed (default: :func:`torchport.device`'s choice).
        warmup: steps to leave out at the start.
        items: work per step (samples, tokens) when :meth:`step` is not given a count.

    Example:
        >>> monitor = torchport.bench.Monitor(warmup=2)
        >>> for batch in loader:
        ...     with monitor.step(items=len(batch)):
        ...         train_step(batch)
        >>> print(monitor.report())
    """

    def __init__(self, device: DeviceLike = None, *, warmup: int = 1, items: float | None = None) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup={warmup!r} is not allowed; give an integer >= 0")
        self._backend, self._index = resolve(device)
        self.device = self._backend.device(self._index)
        self.warmup = warmup
        self.items = items
        self._uses_events = clock(timing_event(self._backend, self._index)) == EVENTS
        self.reset()

    def reset(self) -> None:
        """Forget every step (the next ``warmup`` steps are warm-up again)."""
        self.steps = 0  # completed steps, warm-up included
        self._times: list[float] = []
        self._items: list[float | None] = []
        self._pending: list[tuple[Any, Any, float | None]] = []
        self._open: _Step | None = None

    def step(self, items: float | None = None) -> _Step:
        """A context manager around one step; ``items`` is the step's work (default: the monitor's ``items``)."""
        count = self.items if items is None else items
        if count is not None and (isinstance(count, bool) or not isinstance(count, (int, float)) or not count > 0):
            raise ValueError(f"items={count!r} is not a count of work per step; give a number > 0, or None")
        return _Step(self, None if count is None else float(count))

    def __enter__(self) -> Monitor:
        step = self.step()
        step.__enter__()  # raises if a step is open, before the open step is forgotten
        self._default = step
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._default.__exit__(exc_type, exc, tb)

    def _resolve(self, wait: bool) -> None:
        if wait:
            self._backend.synchronize(self._index)
        done = 0
        for start, end, items in self._pending:
            if not wait and not end.query():
                break  # events on one stream complete in order
            self._times.append(float(start.elapsed_time(end)))
            self._items.append(items)
            done += 1
        del self._pending[:done]

    def report(self) -> Result:
        """The counted steps so far, as a :class:`Result` (``wall_ms`` is None: steps are not back to back).

        Raises:
            ValueError: no step has been counted yet.
        """
        self._resolve(wait=True)
        if not self._times:
            raise ValueError(f"no step measured yet: {self.steps} step(s) finished, and the first {self.warmup} "
                             "are warm-up")
        items = None if any(n is None for n in self._items) else tuple(self._items)
        peak = self._backend.memory_stats(self._index).get("peak_allocated")
        return Result(device=str(self.device), timer=EVENTS if self._uses_events else HOST_CLOCK,
                      times_ms=tuple(self._times), warmup=self.warmup, peak_memory=peak, wall_ms=None, items=items,
                      simulated=is_simulated(self._backend))

    def __repr__(self) -> str:
        return f"Monitor({self.device}, {self.steps} steps, warmup {self.warmup})"


class _Step:
    """One step of a :class:`Monitor`; reusable only once."""

    def __init__(self, monitor: Monitor, items: float | None) -> None:
        self._monitor, self._items = monitor, items
        self._start: Any = None

    def __enter__(self) -> _Step:
        monitor = self._monitor
        if monitor._open is not None:
            raise RuntimeError("Monitor steps cannot nest: the previous step has not finished")
        monitor._open = self
        if monitor.steps == monitor.warmup:  # the first counted step
            monitor._backend.synchronize(monitor._index)
            monitor._backend.reset_peak_memory_stats(monitor._index)
        self._start = timing_event(monitor._backend, monitor._index)
        self._start.record()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        monitor = self._monitor
        monitor._open = None
        if exc_type is not None:
            return
        counted = monitor.steps >= monitor.warmup
        monitor.steps += 1
        end = timing_event(monitor._backend, monitor._index)
        end.record()
        if counted:
            monitor._pending.append((self._start, end, self._items))
            if not monitor._uses_events or len(monitor._pending) >= _RESOLVE_EVERY:
                monitor._resolve(wait=False)  # host-clock times are complete at once
