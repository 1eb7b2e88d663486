"""Measure a port honestly: synchronised timing, percentiles, peak device memory, throughput.

Example:
    >>> result = torchport.bench.measure(lambda: model(x), device="npu", items=len(x))
    >>> print(result)                     # median, p20, p80 ms; items/s; peak memory
    >>> monitor = torchport.bench.Monitor()
    >>> for batch in loader:
    ...     with monitor:
    ...         train_step(batch)
    >>> print(monitor.report())
"""

from __future__ import annotations

from .monitor import Monitor
from .sweep import Sweep, SweepPoint, base_batch, batch_inputs, sweep
from .timing import WIDE_SPREAD, Result, measure, percentile

__all__ = ["WIDE_SPREAD", "Monitor", "Result", "Sweep", "SweepPoint", "base_batch", "batch_inputs", "measure",
           "percentile", "sweep"]
