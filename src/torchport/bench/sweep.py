"""Latency, throughput and peak memory of a model over batch sizes (what ``torchport bench`` runs).

How a batch size is applied, in this order:

1. the factory takes a ``batch_size`` keyword: it is called once per batch size, ``factory(batch_size=b)``;
2. otherwise it is called once, and its inputs are tiled along dim 0: every tensor whose first dimension equals
   the base batch (the first dimension of the first tensor in the inputs) is repeated and cut to ``b`` rows;
   other tensors and non-tensors are passed unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..device import DeviceLike, resolve
from ..verify.structure import call_model, leaves, map_tensors
from ..verify.target import TargetError, unpack
from .timing import WIDE_SPREAD, Result, device_label, is_simulated, measure

__all__ = ["Sweep", "SweepPoint", "base_batch", "batch_inputs", "sweep"]

logger = logging.getLogger("torchport")


def base_batch(inputs: Any) -> int | None:
    """The first dimension of the first tensor with one, or None.

    Example:
        >>> base_batch({"input_ids": torch.zeros(4, 16, dtype=torch.long)})
        4
    """
    return next((leaf.shape[0] for _, leaf in leaves(inputs) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0),
                None)


def batch_inputs(inputs: Any, batch_size: int) -> Any:
    """Tile every tensor whose first dimension is the base batch along dim 0 and cut it to ``batch_size`` rows.

    Example:
        >>> batch_inputs(torch.arange(2).view(2, 1), 5).flatten().tolist()
        [0, 1, 0, 1, 0]
    """
    base = base_batch(inputs)
    if base is None or base == 0:
        raise TargetError("the inputs hold no tensor with a batch dimension to tile; give the factory a "
                         "batch_size keyword instead")

    def tile(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != base:
            return t
        copies = -(-batch_size // base)
        return t.repeat(copies, *([1] * (t.dim() - 1)))[:batch_size]

    return map_tensors(tile, inputs)


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """One batch size: its timing, or why it could not run (``"out of memory"``, an error)."""

    batch_size: int
    result: Result | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "error": self.error,
                **(self.result.to_dict() if self.result is not None else {})}


@dataclasses.dataclass
class Sweep:
    """The points of a batch-size sweep, in the order measured; ``simulated``: the device is a simulated one."""

    device: str
    dtype: str | None
    batching: str
    points: list[SweepPoint]
    simulated: bool = False

    @property
    def ok(self) -> bool:
        """Whether every batch size ran."""
        return all(point.error is None for point in self.points)

    @property
    def label(self) -> str:
        """The device as the table and the plot name it: ``"npu:0 (simulated)"`` for a simulated device."""
        return device_label(self.device, self.simulated)

    @property
    def wide_spread(self) -> list[int]:
        """The batch sizes whose p80/p20 exceeds :data:`~torchport.bench.timing.WIDE_SPREAD` (unreliable medians).

        Example:
            >>> sweep(factory, [1, 8]).wide_spread
            []
        """
        return [p.batch_size for p in self.points if p.result is not None and p.result.wide_spread]

    def to_dict(self) -> dict[str, Any]:
        """Plain data, JSON-serialisable.

        Example:
            >>> Path("bench.json").write_text(json.dumps(sweep(factory, [1, 8]).to_dict()))
        """
        return {"ok": self.ok, "device": self.device, "simulated": self.simulated, "dtype": self.dtype,
                "batching": self.batching, "wide_spread": self.wide_spread,
                "points": [point.to_dict() for point in self.points]}

    def table(self) -> Any:
        """A ``rich.table.Table``: one line per batch size."""
        from rich.table import Table
        from rich.text import Text

        timer = next((p.result.timer for p in self.points if p.result is not None), "")
        table = Table(title=f"torchport bench: {self.label}" + (f" ({self.dtype})" if self.dtype else "")
                            + (f", {timer}" if timer else ""))
        for column in ("batch", "median ms", "p20 ms", "p80 ms", "p80/p20", "items/s", "peak memory"):
            table.add_column(column, justify="right")
        for point in self.points:
            r = point.result
            if r is None:
                table.add_row(str(point.batch_size), Text(point.error or "", style="bold red"), "", "", "", "", "")
                continue
            memory = "n/a" if r.peak_memory is None else f"{r.peak_memory / 2**20:,.1f} MiB"
            spread = Text(f"{r.spread:.2f} wide", style="bold yellow") if r.wide_spread else Text(f"{r.spread:.2f}")
            table.add_row(str(point.batch_size), f"{r.median_ms:.3f}", f"{r.p20_ms:.3f}", f"{r.p80_ms:.3f}", spread,
                          f"{r.throughput:,.1f}" if r.throughput is not None else "", memory)
        return table

    def print(self, console: Any = None) -> None:
        """Print :meth:`table` and a note on how batch sizes were made on a rich Console (default: stdout)."""
        from rich.console import Console
        from rich.text import Text

        console = console or Console()
        console.print(self.table())
        note = f"batch sizes: {self.batching}"
        if any(p.result is not None and p.result.peak_memory is None for p in self.points):
            note += "; peak memory n/a: this device keeps no count of tensor bytes"
        if self.simulated:
            note += "; the device is simulated (TORCHPORT_SIMULATE): its times are the host's, not a device's"
        console.print(Text(note), soft_wrap=True)
        if self.wide_spread:
            sizes = ", ".join(map(str, self.wide_spread))
            console.print(Text(f"warning: p80/p20 above {WIDE_SPREAD} at batch size {sizes}: those medians are "
                               "unreliable; time more calls (--iters), warm up longer (--warmup), or use a quieter "
                               "machine", style="yellow"), soft_wrap=True)

    def plot(self, path: str | os.PathLike[str], compare: Sweep | None = None) -> str:
        """Write a PNG: throughput and peak memory against batch size, with ``compare``'s throughput beside it
        (for example the same model in onnxruntime). Needs matplotlib. Returns the path.

        Example:
            >>> sweep(factory, [1, 4, 16], device="npu").plot("bench.png")
        """
        from .plot import plot_sweep

        return plot_sweep(self, path, compare)

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        self.print(Console(file=buffer, width=120, color_system=None, highlight=False))
        return buffer.getvalue()


def _takes_batch_size(factory: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    parameter = parameters.get("batch_size")
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def sweep(factory: Callable[..., Any], batch_sizes: Sequence[int] | None = None, *, device: DeviceLike = None,
          dtype: torch.dtype | None = None, warmup: int = 3, iters: int = 10, progress: bool = False,
          source: str | None = None) -> Sweep:
    """Measure ``model(inputs)`` (in ``eval()`` and ``no_grad``) at each batch size; throughput in samples/s.

    ``factory`` returns ``(model, inputs)``; a batch size is applied as the module docstring says (a
    ``batch_size`` keyword, else inputs tiled along dim 0). ``batch_sizes=None`` measures the factory's own batch.
    A batch size that runs out of memory or raises is recorded with its error, and the sweep goes on.

    Args:
        dtype: cast the model's floating-point weights and inputs to this dtype (default: as the factory made them).
        progress: show a progress bar on stderr.
        source: how to name the factory in error messages (default: its ``__qualname__``).

    Example:
        >>> result = torchport.bench.sweep(factory, [1, 8, 32], device="npu")
        >>> print(result); result.plot("bench.png")
    """
    source = source or f"{getattr(factory, '__qualname__', repr(factory))}()"
    backend, index = resolve(device)
    target = backend.device(index)
    sizes = list(batch_sizes) if batch_sizes is not None else None
    for size in sizes or []:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"batch size {size!r} is not allowed; give integers >= 1")
    keyword = _takes_batch_size(factory)
    batching = "factory(batch_size=b)" if keyword else "the factory's inputs tiled along dim 0"
    shared = None if keyword and sizes else unpack(factory(), source)
    tile = not keyword
    if sizes is None:
        size = base_batch(shared[1])
        if size is None:
            raise TargetError(f"{source} returned inputs without a batch dimension; give batch sizes to measure")
        sizes, batching, tile = [size], "as the factory made them", False
    if tile:
        batch_inputs(shared[1], 1)  # fails now, with its reason, when the inputs have nothing to tile

    points: list[SweepPoint] = []
    bar = _progress(progress, len(sizes))
    with bar:
        task = bar.add_task("bench", total=len(sizes))
        for size in sizes:
            bar.update(task, description=f"batch {size}")
            if keyword and shared is None:
                model, inputs = unpack(factory(batch_size=size), f"{source.removesuffix('()')}(batch_size={size})")
            else:
                model, inputs = shared[0], batch_inputs(shared[1], size) if tile else shared[1]
            points.append(_measure_point(model, inputs, size, target, dtype, warmup, iters))
            bar.advance(task)
            del model, inputs
    return Sweep(device=str(target), dtype=None if dtype is None else str(dtype).removeprefix("torch."),
                 batching=batching, points=points, simulated=is_simulated(backend))


def _measure_point(model: torch.nn.Module, inputs: Any, size: int, device: torch.device, dtype: torch.dtype | None,
                   warmup: int, iters: int) -> SweepPoint:
    def placed(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, dtype) if dtype is not None and t.is_floating_point() else t.to(device)

    backend = resolve(device)[0]
    try:
        model.to(device) if dtype is None else model.to(device, dtype)
        model.eval()
        on_device = map_tensors(placed, inputs)

        def run() -> None:
            with torch.no_grad():
                call_model(model, on_device)

        result = measure(run, warmup=warmup, iters=iters, device=device, items=size)
    except torch.OutOfMemoryError as exc:
        logger.warning("bench: batch size %d ran out of memory on %s", size, device)
        backend.empty_cache()
        return SweepPoint(size, error=f"out of memory: {_first_line(exc)}")
    except Exception as exc:  # the sweep goes on; the table shows what failed
        logger.warning("bench: batch size %d failed on %s: %s", size, device, exc)
        return SweepPoint(size, error=f"{type(exc).__name__}: {_first_line(exc)}")
    return SweepPoint(size, result=result)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


class _NoProgress:
    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def add_task(self, description: str, total: int) -> int:
        return 0

    def update(self, task: int, **fields: Any) -> None:
        pass

    def advance(self, task: int) -> None:
        pass


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return _NoProgress()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=not console.is_terminal)

