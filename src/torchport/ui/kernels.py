"""The Kernels tab: the registry's op x device x implementation table (:func:`torchport.kernels.table`), and a
short benchmark of one op on one device, each implementation forced in turn (``TORCHPORT_KERNELS=op=name``) and
timed with :func:`torchport.bench.measure`, shown as bars against the reference."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _settings
from ..bench import WIDE_SPREAD, Result, measure
from ..device import devices, resolve
from .jobs import Job, done, failed, run_job, wire_action

__all__ = ["DTYPES", "HEADERS", "SIZES", "TIMING_HEADERS", "Benchmark", "Timing", "bar_frame", "benchmark",
           "benchmarkable_ops", "describe_size", "registry_rows", "summary", "tab", "timing_rows"]

HEADERS = ["op", "device", "implementation", "candidates (by priority)", "why not faster"]
DTYPES = ("bfloat16", "float16", "float32")
SIZES = ("small", "medium", "large")
WARMUP, ITERS = 2, 10


def registry_rows(devices: Sequence[torch.device] | None = None) -> list[list[str]]:
    """The rows of :func:`torchport.kernels.table` as text cells (columns :data:`HEADERS`).

    Example:
        >>> registry_rows([torch.device("cpu")])[0][:3]
        ['cross_entropy', 'cpu', 'reference']
    """
    from ..kernels import table

    return [[row["op"], row["device"], row["implementation"], ", ".join(row["candidates"]),
             "; ".join(row["notes"]) or "-"] for row in table(devices)]


# -- inputs: the ops' specs (kernels/<op>.py) --------------------------------------------------------------------------
def _specs() -> dict[str, Any]:
    from ..kernels.registry import list_specs

    return list_specs()


def benchmarkable_ops() -> list[str]:
    """The registered ops this tab can make inputs for: every op with a spec.

    Example:
        >>> "rms_norm" in benchmarkable_ops()
        True
    """
    from ..kernels import list_kernels

    return [op for op in list_kernels() if op in _specs()]


def describe_size(op: str, size: str) -> str:
    """The shape a size of ``op`` stands for.

    Example:
        >>> describe_size("rms_norm", "medium")
        'rows × hidden 4096×4096'
    """
    return _specs()[op].describe(size)


# -- the benchmark --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Timing:
    """One implementation's result: its timing, or why it could not run (``error``)."""

    implementation: str
    result: Result | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A benchmark of ``op`` on ``device``: one :class:`Timing` per implementation serving the device, the reference
    last, and ``auto``, the implementation torchport picks there by itself."""

    op: str
    device: str
    dtype: str
    shape: str
    backward: bool
    auto: str
    timings: list[Timing]

    def reference_ms(self) -> float | None:
        """The reference's median milliseconds, None when it did not run."""
        ref = next((t for t in self.timings if t.implementation == "reference" and t.result), None)
        return None if ref is None else ref.result.median_ms


def _step(op: str, args: tuple[Any, ...], backward: bool, gen: torch.Generator) -> Callable[[], Any]:
    spec = _specs()[op]
    if not backward:
        def forward() -> Any:
            with torch.no_grad():
                return spec.call(*args)
        return forward
    leaves = [arg.requires_grad_() for arg in args[:spec.differentiable]]
    outputs = spec.call(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outputs]

    def forward_backward() -> None:
        for leaf in leaves:
            leaf.grad = None
        out = spec.call(*args)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), grads)

    return forward_backward


def _check_memory(host: tuple[torch.Tensor, ...], dtype: torch.dtype, backward: bool, backend: Any, index: int,
                  what: str) -> None:
    # Inputs, outputs, the reference's float32 intermediates and (backward) gradients: about 3x the inputs forward
    # and 6x with the backward. Refusing beats an out-of-memory kill of the dashboard (the CPU's memory is the host's).
    size = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in host)
    need = size * (6 if backward else 3)
    info = backend.mem_get_info(index)
    if info is not None and need > info[0]:
        raise ValueError(f"{what} needs about {need / 2**30:.1f} GiB on {backend.device(index)}, which has "
                         f"{info[0] / 2**30:.1f} GiB free; choose a smaller size")


def benchmark(job: Job, op: str, device: str, dtype: str = "float32", size: str = "small", backward: bool = False,
              *, warmup: int = WARMUP, iters: int = ITERS) -> Benchmark:
    """Time ``op`` on ``device`` with each implementation that serves the device (forced in turn with
    ``TORCHPORT_KERNELS``, the reference last) on the same inputs: ``warmup`` untimed calls, then ``iters`` timed ones with :func:`torchport.bench.measure`. An
    implementation that cannot run here is listed with the reason.

    Raises:
        ValueError: an unknown op, size or dtype, a device this machine lacks, or a dtype that does not work on the
            device (by its probe).

    Example:
        >>> result = benchmark(Job(), "rms_norm", "cpu", "float32", "small")
        >>> [t.implementation for t in result.timings]
        ['reference']
    """
    from ..kernels.registry import KernelError, implementation, list_kernels, select

    if op not in _specs():
        raise ValueError(f"the dashboard has no benchmark inputs for op {op!r}; it has: {', '.join(_specs())}")
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {', '.join(SIZES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    backend, index = resolve(device, source="device")
    dev = backend.device(index)
    torch_dtype = getattr(torch, dtype)
    if not backend.dtype_works(torch_dtype, index):
        raise ValueError(f"{dtype} does not work on {dev} (its dtype probe failed); choose another dtype")
    names = [name for name in list_kernels()[op] if implementation(op, name).serves(dev.type)]
    names = [name for name in names if name != "reference"] + ["reference"]
    auto = select(op, dev, quiet=True).name
    job.report((0, len(names)), f"{op}: making {describe_size(op, size)} inputs on {dev}")
    spec = _specs()[op]
    with torch.device("meta"):  # shapes only: a size that does not fit is refused before anything is made
        _check_memory(spec.inputs(size), torch_dtype, backward, backend, index,
                      f"{op} {size} ({describe_size(op, size)})")
    gen = torch.Generator().manual_seed(0)
    host = spec.inputs(size, gen)
    args = tuple(t.to(dev, torch_dtype) if t.is_floating_point() else t.to(dev) for t in host)
    timings = []
    for count, name in enumerate(names):
        job.report((count, len(names)), f"{op}: timing {name} on {dev}")
        try:
            with _settings.override(kernels=f"{op}={name}"):
                step = _step(op, tuple(a.detach() for a in args), backward, gen)
                # a cancel is seen within one call (the check costs ~0.1 us of host time per call)
                timed = measure(lambda: (job.check(), step()), warmup=warmup, iters=iters, device=dev)
                timings.append(Timing(name, timed))
        except KernelError as exc:
            timings.append(Timing(name, error=str(exc)))
        except torch.OutOfMemoryError as exc:
            timings.append(Timing(name, error=f"out of memory: {str(exc).splitlines()[0]}"))
    job.report((len(names), len(names)), f"{op}: done")
    return Benchmark(op, str(dev), dtype, describe_size(op, size), backward, auto, timings)


def timing_rows(result: Benchmark) -> list[list[str]]:
    """One row per implementation (columns :data:`TIMING_HEADERS`): median, p20 and p80 ms, speed against the
    reference, peak memory, and how it was timed (or why it cannot run).

    Example:
        >>> timing_rows(benchmark(Job(), "swiglu", "cpu"))[0][0]
        'reference (auto)'
    """
    ref = result.reference_ms()
    rows = []
    for timing in result.timings:
        label = timing.implementation + (" (auto)" if timing.implementation == result.auto else "")
        r = timing.result
        if r is None:
            rows.append([label, "-", "-", "-", "-", "-", f"cannot run: {timing.error}"])
            continue
        speed = "-" if ref is None or r.median_ms <= 0 else f"{ref / r.median_ms:.2f}x"
        peak = "not counted" if r.peak_memory is None else f"{r.peak_memory / 2**20:,.1f} MiB"
        timer = r.timer + (f"; p80/p20 {r.spread:.1f}, median unreliable" if r.wide_spread else "")
        rows.append([label, f"{r.median_ms:.3f}", f"{r.p20_ms:.3f}", f"{r.p80_ms:.3f}", speed, peak, timer])
    return rows


TIMING_HEADERS = ["implementation", "median ms", "p20 ms", "p80 ms", "speed vs reference", "peak memory",
                  "timed with"]


def bar_frame(result: Benchmark) -> Any:
    """The bar chart's data: median milliseconds per implementation that ran (a pandas DataFrame).

    Example:
        >>> bar_frame(benchmark(Job(), "rms_norm", "cpu")).columns.tolist()
        ['implementation', 'median ms', 'kind']
    """
    import pandas as pd

    records = [{"implementation": t.implementation + (" (auto)" if t.implementation == result.auto else ""),
                "median ms": t.result.median_ms,
                "kind": "reference" if t.implementation == "reference" else "fused kernel"}
               for t in result.timings if t.result is not None]
    return pd.DataFrame(records, columns=["implementation", "median ms", "kind"])


def summary(result: Benchmark) -> str:
    """Markdown: what was timed, and the fastest implementation against the reference.

    Example:
        >>> summary(benchmark(Job(), "rms_norm", "npu:0"))
        '**rms_norm** on `npu:0`, float32, rows × hidden 1024×1024, forward; ... Fastest: **npu**, 1.40x ...'
    """
    passes = "forward + backward" if result.backward else "forward"
    ran = [t for t in result.timings if t.result is not None]
    device = ran[0].result.label if ran else result.device
    head = (f"**{result.op}** on `{device}`, {result.dtype}, {result.shape}, {passes}; {WARMUP} warm-up and "
            f"{ITERS} timed calls per implementation. torchport picks **{result.auto}** here.")
    ref = result.reference_ms()
    if len(ran) > 1 and ref is not None:
        best = min(ran, key=lambda t: t.result.median_ms)
        head += f" Fastest: **{best.implementation}**, {ref / best.result.median_ms:.2f}x the reference's speed."
    wide = [t.implementation for t in ran if t.result.wide_spread]
    if wide:
        head += (f" Warning: p80/p20 above {WIDE_SPREAD} for {', '.join(wide)}: those medians are unreliable; "
                 "benchmark again on a quieter machine.")
    if ran and ran[0].result.simulated:
        head += " The device is simulated: its times are the host's, not a device's."
    return head


def tab() -> None:
    """Build the Kernels tab inside the current ``gr.Blocks``.

    Example:
        >>> with gr.Blocks() as app:
        ...     tab()
    """
    import gradio as gr

    present = [str(d) for d in devices()]
    ops = benchmarkable_ops()
    gr.Markdown("Which implementation each fused kernel uses on each device of this machine, and why a faster one "
                "is not used (`torchport kernels`). `TORCHPORT_KERNELS` forces a choice.")
    def problem() -> str:
        try:
            registry_rows()
        except (ValueError, RuntimeError) as exc:  # an invalid TORCHPORT_KERNELS: say so, keep the page
            return f"**The registry cannot be shown**: {exc}"
        return ""

    def rows() -> list[list[str]]:
        try:
            return registry_rows()
        except (ValueError, RuntimeError):
            return []

    gr.Markdown(problem)
    gr.Dataframe(headers=HEADERS, value=rows, interactive=False, wrap=True, label="registry", elem_id="kernels-table",
                 column_widths=["18%", "8%", "12%", "18%", "44%"])
    gr.Markdown("### Benchmark one op\nEach implementation that serves the device is forced in turn and timed on "
                "the same inputs; the bars compare them with the plain-PyTorch reference.")
    with gr.Row():
        op = gr.Dropdown(ops, value=ops[0] if ops else None, label="op")
        device = gr.Dropdown(present, value=present[0], label="device")
        dtype = gr.Dropdown(list(DTYPES), value="float32", label="dtype")
        size = gr.Radio(list(SIZES), value="small", label="size")
        passes = gr.Radio(["forward", "forward + backward"], value="forward", label="pass")
    shape = gr.Markdown(describe_size(ops[0], "small") if ops else "")
    with gr.Row():
        start = gr.Button("Benchmark", variant="primary", elem_id="kernels-run", scale=0, min_width=160)
        stop = gr.Button("Cancel", interactive=False, scale=0, min_width=120)
    result_md = gr.Markdown(elem_id="kernels-summary")
    bars = gr.BarPlot(x="implementation", y="median ms", color="kind", y_title="ms",
                      label="median time per call (lower is faster)", elem_id="kernels-bars",
                      color_map={"reference": "#9ca3af", "fused kernel": "#ea580c"})
    timings = gr.Dataframe(headers=TIMING_HEADERS, interactive=False, wrap=True, label="timings")

    for control in (op, size):
        control.change(lambda o, s: describe_size(o, s) if o else "", inputs=[op, size], outputs=shape,
                       queue=False, show_progress="hidden")

    async def on_run(o: str, d: str, t: str, s: str, p: str, progress: Any = gr.Progress()) -> tuple[Any, ...]:
        try:
            result = await run_job(benchmark, o, d, t, s, p != "forward", progress=progress)
        except (ValueError, TypeError, RuntimeError) as exc:  # a dtype the device lacks, an op that refuses it
            return failed(str(exc)), None, None
        return done(summary(result)), bar_frame(result), timing_rows(result)

    wire_action([start.click], start, stop, on_run, [op, device, dtype, size, passes], [result_md, bars, timings])
