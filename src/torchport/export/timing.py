"""Time an exported model in onnxruntime over batch sizes, beside eager PyTorch (``torchport bench --onnx``)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any


from ..bench.sweep import Sweep, SweepPoint, batch_inputs
from ..bench.timing import measure
from ..device import DeviceLike, resolve
from ..verify.target import unpack
from .exporter import graph_feeds, onnx

__all__ = ["sweep_onnx"]


def sweep_onnx(factory: Callable[..., Any], batch_sizes: Sequence[int] = (1, 4, 8), *, device: DeviceLike = None,
               opset: int = 18, dtype: str = "fp32", warmup: int = 3, iters: int = 10,
               source: str | None = None) -> tuple[Sweep, Any]:
    """Export the factory's model with a dynamic batch to a temporary ONNX file, then time ``session.run`` in
    onnxruntime on ``device``'s execution provider at each batch size (inputs tiled along dim 0, as
    :func:`torchport.bench.sweep` does). Returns the sweep and the :class:`ExportReport` of the file.

    Peak memory is n/a: onnxruntime's allocations are not seen by PyTorch's counters.

    Example:
        >>> ort_sweep, report = torchport.export.sweep_onnx(factory, [1, 4, 8], device="cpu")
        >>> print(ort_sweep)
    """
    from .runtime import session

    source = source or f"{getattr(factory, '__qualname__', repr(factory))}()"
    sizes = list(batch_sizes)
    takes_batch = "batch_size" in _parameters(factory)
    model, inputs = unpack(factory(batch_size=min(sizes)) if takes_batch else factory(), source)
    backend, index = resolve(device)
    target = backend.device(index)
    with tempfile.TemporaryDirectory(prefix="torchport-bench-") as folder:
        path = os.path.join(folder, "model.onnx")
        report = onnx(model, inputs, path, opset=opset, dynamic_batch=True, dtype=dtype, device=target)
        sess = session(path, target)
        names = [item.name for item in report.inputs]
        points = []
        for size in sizes:
            try:
                feeds = graph_feeds(model, batch_inputs(inputs, size), names, dtype)
                result = measure(lambda: sess.run(None, feeds), warmup=warmup, iters=iters, device=target, items=size)
                points.append(SweepPoint(size, result=dataclasses.replace(result, peak_memory=None)))
            except Exception as exc:  # the sweep goes on; the table shows what failed
                points.append(SweepPoint(size, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
    provider = sess.get_providers()[0]
    return Sweep(device=f"{target}, onnxruntime {provider}", dtype=str(report.dtype),
                 batching="the factory's inputs tiled along dim 0", points=points), report


def _parameters(factory: Callable[..., Any]) -> Any:
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
