"""Honest timing of a callable: device events where the device has them, else a synchronised host clock."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..device import DeviceLike, resolve
from ..timer import EVENTS, HOST_CLOCK, clock, timing_event  # noqa: F401 - EVENTS, HOST_CLOCK: named here too

__all__ = ["WIDE_SPREAD", "Result", "device_label", "is_simulated", "measure", "percentile"]

# p80/p20 above which a median is flagged as unreliable. At 1.5 the middle 60% of the calls spans half the median or
# more, and medians of repeated runs move by as much as the speed-ups people read benchmarks for: five runs of a
# 256x256 matmul on this project's 2-core shared CPU machine gave p80/p20 of 1.31 to 1.77 and medians of 0.27 to
# 0.33 ms (22% apart). A device timed with events on a quiet machine stays within a few percent.
WIDE_SPREAD = 1.5


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) with linear interpolation between the closest ranks (NumPy's default).

    Example:
        >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
        2.5
    """
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def is_simulated(backend: Any) -> bool:
    """Whether a backend is a simulated device (``TORCHPORT_SIMULATE``): its timings are the host's, not a device's.

    Example:
        >>> is_simulated(get_backend("cpu"))
        False
    """
    return bool(backend.versions().get("simulated"))


def device_label(device: str, simulated: bool) -> str:
    """How tables and plots name a device: ``"npu:0 (simulated)"`` for a simulated one.

    Example:
        >>> device_label("npu:0", True)
        'npu:0 (simulated)'
    """
    return f"{device} (simulated)" if simulated else device


@dataclasses.dataclass(frozen=True)
class Result:
    """Times of the measured calls (or steps), in milliseconds, and what they cost in memory.

    ``timer`` says how they were taken (:data:`EVENTS` or :data:`HOST_CLOCK`). ``peak_memory`` is the peak of bytes
    held by tensors on the device while the calls ran, from the device allocator's counters; it is None on devices
    whose allocator keeps no count (the CPU: PyTorch does not count host tensor bytes, and the process's resident
    set is not tensor memory). ``wall_ms`` is the synchronised host time of all measured calls divided by their
    number (None for :class:`Monitor`, whose steps are spread over the caller's loop). ``items`` is the work per
    call (samples, tokens...), for ``throughput``. ``simulated`` says that the device is a simulated one, whose
    times are the host's. ``wide_spread`` says that p80/p20 exceeds :data:`WIDE_SPREAD`: the median is unreliable.
    """

    device: str
    timer: str
    times_ms: tuple[float, ...]
    warmup: int
    peak_memory: int | None = None
    wall_ms: float | None = None
    items: tuple[float, ...] | None = None
    simulated: bool = False

    @property
    def label(self) -> str:
        """The device as tables name it: ``"npu:0 (simulated)"`` for a simulated device."""
        return device_label(self.device, self.simulated)

    @property
    def spread(self) -> float:
        """p80 / p20 of the times: 1.0 when every call took as long; inf when p20 is 0 and p80 is not."""
        low, high = self.p20_ms, self.p80_ms
        if low <= 0:
            return 1.0 if high <= 0 else math.inf
        return high / low

    @property
    def wide_spread(self) -> bool:
        """Whether p80/p20 exceeds :data:`WIDE_SPREAD`, so that the median may not be repeatable."""
        return self.spread > WIDE_SPREAD

    @property
    def iters(self) -> int:
        return len(self.times_ms)

    @property
    def median_ms(self) -> float:
        return percentile(self.times_ms, 50)

    @property
    def p20_ms(self) -> float:
        return percentile(self.times_ms, 20)

    @property
    def p80_ms(self) -> float:
        return percentile(self.times_ms, 80)

    @property
    def throughput(self) -> float | None:
        """Items per second: the median over calls of items / time; None when no item count was given."""
        if self.items is None:
            return None
        return percentile([n / (ms / 1e3) if ms > 0 else math.inf for n, ms in zip(self.items, self.times_ms)], 50)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, JSON-serialisable.

        Example:
            >>> json.dumps(measure(step, device="cpu").to_dict())
        """
        throughput = self.throughput
        return {
            "device": self.device, "timer": self.timer, "iters": self.iters, "warmup": self.warmup,
            "median_ms": self.median_ms, "p20_ms": self.p20_ms, "p80_ms": self.p80_ms,
            "min_ms": min(self.times_ms), "max_ms": max(self.times_ms), "wall_ms": self.wall_ms,
            "peak_memory": self.peak_memory,
            "throughput": throughput if throughput is None or math.isfinite(throughput) else None,
            "simulated": self.simulated, "spread": self.spread if math.isfinite(self.spread) else None,
            "wide_spread": self.wide_spread, "times_ms": list(self.times_ms),
        }

    def __str__(self) -> str:
        text = (f"{self.median_ms:.3f} ms median (p20 {self.p20_ms:.3f}, p80 {self.p80_ms:.3f}) over {self.iters} "
                f"calls on {self.label}, {self.timer}")
        if self.throughput is not None:
            text += f"; {self.throughput:,.1f} items/s"
        if self.peak_memory is not None:
            text += f"; peak memory {self.peak_memory / 2**20:,.1f} MiB"
        if self.wide_spread:
            text += (f"; warning: p80/p20 is {self.spread:.1f} (above {WIDE_SPREAD}), the median is unreliable: time "
                     "more calls, warm up longer, or use a quieter machine")
        return text


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed; give an integer >= {minimum}")
    return value


def _check_items(items: Any) -> float | None:
    if items is None:
        return None
    if isinstance(items, bool) or not isinstance(items, (int, float)) or not items > 0:
        raise ValueError(f"items={items!r} is not a count of work per call; give a number > 0, or None")
    return float(items)


def measure(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 20, device: DeviceLike = None,
            items: float | None = None) -> Result:
    """Call ``fn()`` ``warmup`` times, then time ``iters`` calls one by one.

    Each call is timed with a pair of events from :func:`torchport.timer.timing_event` around it: device events
    recorded on the device's current stream, read after a final synchronize, or on devices without events (the
    CPU) the host clock, the device synchronised before and after each call. The device is synchronised before the first timed call and after the last, so queued work is never
    left out. Work ``fn`` queues on other streams is seen by the synchronisations (``wall_ms``) but not by events
    on the current stream. Peak memory counters are reset after the warm-up.

    Args:
        fn: the work to time, with no arguments (wrap arguments in a lambda or ``functools.partial``).
        warmup: untimed calls first (compilation, caching allocator, autotuning).
        iters: timed calls.
        device: the device whose work is timed (default: :func:`torchport.device`'s choice).
        items: work per call (samples, tokens) for the throughput in items per second.

    Example:
        >>> result = torchport.bench.measure(lambda: model(x), device="npu", items=x.shape[0])
        >>> result.median_ms, result.throughput
    """
    if not callable(fn):
        raise TypeError(f"measure needs a callable with no arguments, got {type(fn).__name__}")
    warmup, iters, per_call = _check_count("warmup", warmup, 0), _check_count("iters", iters, 1), _check_items(items)
    backend, index = resolve(device)
    for _ in range(warmup):
        fn()
    backend.synchronize(index)
    backend.reset_peak_memory_stats(index)
    starts = [timing_event(backend, index) for _ in range(iters)]  # made before the loop: none is made while timing
    ends = [timing_event(backend, index) for _ in range(iters)]
    wall_start = time.perf_counter()
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    backend.synchronize(index)
    wall = time.perf_counter() - wall_start
    times = [float(start.elapsed_time(end)) for start, end in zip(starts, ends)]
    peak = backend.memory_stats(index).get("peak_allocated")
    return Result(device=str(backend.device(index)), timer=clock(starts[0]),
                  times_ms=tuple(times), warmup=warmup, peak_memory=peak, wall_ms=wall * 1e3 / iters,
                  items=None if per_call is None else (per_call,) * iters, simulated=is_simulated(backend))
