"""The Verify tab: :func:`torchport.verify.compare` on a ``module:factory`` target and a device, with the per-layer
error plot (:meth:`Report.plot`), the rows, and the first divergent layer."""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import torch

from ..device import devices
from ..verify import ModelError, Report, StructureError, TargetError, compare, load_target, unpack
from .jobs import Job, check_module_calls, done, failed, run_job, wire_action

__all__ = ["AS_MADE", "DTYPES", "HEADERS", "layer_rows", "run", "summary", "tab"]

AS_MADE = "unchanged"
DTYPES = (AS_MADE, "float32", "bfloat16", "float16")
HEADERS = ["#", "module", "type", "shape", "dtype", "max abs error", "relative error", "status"]


def run(job: Job, target: str, device: str, dtype: str = AS_MADE, backward: bool = False) -> Report:
    """Load ``target`` (``package.module:factory`` or ``path/to/file.py:factory``, relative to the working
    directory), build its model and inputs, and compare the model on ``device`` with the CPU in float64. Every
    module call reports progress, and a cancelled job stops at the next one.

    Raises:
        TargetError: the target is malformed, does not import, raises, or does not return ``(model, inputs)``.
        ModelError, StructureError: as :func:`torchport.verify.compare`.
        ValueError, RuntimeError: a device this machine lacks, an unknown dtype.

    Example:
        >>> run(Job(), "examples/verify_target.py:factory", "npu").first_divergence is None
        True
    """
    target = target.strip()
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of: {', '.join(DTYPES)}")
    job.report(None, f"importing {target}")
    try:
        factory = load_target(target)
    except TargetError:
        raise
    except BaseException as exc:  # the target's own code failed to import (SyntaxError, a missing package, exit)
        raise TargetError(f"TARGET={target!r} could not be imported: {_first_line(exc)}") from exc
    job.report(None, f"calling {target}")
    try:
        made = factory()
    except BaseException as exc:
        raise TargetError(f"TARGET={target!r}: calling the factory raised {_first_line(exc)}") from exc
    model, inputs = unpack(made, f"TARGET {target}")
    if dtype != AS_MADE:
        model = model.to(getattr(torch, dtype))  # compare rounds floating-point inputs to the model's dtype
    with check_module_calls(job, f"comparing on {device} and the CPU: module calls"):
        report = compare(model, inputs, device=device, backward=backward)
    job.check()
    return report


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    where = ""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" ({exc.filename}, line {exc.lineno})"
    return f"{type(exc).__name__}: {text[0] if text else ''}{where}"


def _format(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}" if math.isfinite(x) else str(x)


def layer_rows(report: Report) -> list[list[str]]:
    """One table row per module call (and per gradient): index, name, type, shape, dtype, errors, status
    (``FIRST`` marks the first divergence).

    Example:
        >>> layer_rows(report)[0][:3]
        ['0', 'features.0', 'Conv2d']
    """
    first = report.first_failing()
    rows = []
    for row in report.layers:
        status = "ok" if row.ok else "FIRST" if row is first else "FAIL"
        if row.note:
            status += f" ({row.note})"
        name = row.name + (f" {row.worst}" if row.worst else "") + (" (gradient)" if row.kind == "grad" else "")
        rows.append([str(row.index), name, row.type, "x".join(map(str, row.shape)) or "()", row.dtype,
                     _format(row.max_abs_error), _format(row.rel_error), status])
    return rows


def summary(report: Report) -> str:
    """Markdown: whether the target matches the reference, or the first divergent layer and its errors.

    Example:
        >>> summary(report)
        '### First divergence: `head.1` (GELU) ...'
    """
    row = report.first_failing()
    if row is None:
        return f"### Matches the reference\n{report.summary()}"
    return f"### First divergence: `{row.name}` ({row.type})\n{report.summary()}"


def _styled(rows: list[list[str]]) -> Any:
    import pandas as pd

    frame = pd.DataFrame(rows, columns=HEADERS)

    def colour(row: Any) -> list[str]:
        bad = not row["status"].startswith("ok")
        return ["color: #b91c1c; font-weight: 600" if bad else ""] * len(row)

    return frame.style.apply(colour, axis=1)


def tab(folder: str) -> None:
    """Build the Verify tab inside the current ``gr.Blocks``; plots and reports are written under ``folder``.

    Example:
        >>> with gr.Blocks() as app:
        ...     tab(tempfile.mkdtemp())
    """
    import gradio as gr

    present = [str(d) for d in devices()]
    gr.Markdown("Run a model on a device and on the CPU in float64 with the same weights and inputs, and compare "
                "every module's output (`torchport verify`). The target is a function returning `(model, inputs)`: "
                f"`package.module:function` or `path/to/file.py:function`, relative to `{os.getcwd()}`.")
    with gr.Row(equal_height=True):
        target = gr.Textbox(label="target", placeholder="examples/verify_target.py:factory", scale=3,
                            elem_id="verify-target")
        device = gr.Dropdown(present, value=present[0], label="device", scale=1)
        dtype = gr.Dropdown(list(DTYPES), value=AS_MADE, label="cast the model to", scale=1)
        backward = gr.Checkbox(label="also compare gradients", scale=1)
    with gr.Row():
        start = gr.Button("Verify", variant="primary", elem_id="verify-run", scale=0, min_width=160)
        stop = gr.Button("Cancel", interactive=False, scale=0, min_width=120)
    result = gr.Markdown(elem_id="verify-summary")
    plot = gr.Image(label="relative error per layer", type="filepath", interactive=False, elem_id="verify-plot",
                    buttons=["download", "fullscreen"])
    table = gr.Dataframe(headers=HEADERS, interactive=False, wrap=True, label="layers")
    download = gr.DownloadButton("Download the report (JSON)", visible=False)

    async def on_run(t: str, d: str, dt: str, b: bool, progress: Any = gr.Progress()) -> tuple[Any, ...]:
        if not t.strip():
            return failed("give a target: package.module:function or path/to/file.py:function, a function that "
                          "returns (model, inputs)"), None, None, gr.DownloadButton(visible=False)
        try:
            report = await run_job(run, t, d, dt, b, progress=progress)
        except (TargetError, ModelError, StructureError, ValueError, RuntimeError, TypeError) as exc:
            return failed(str(exc)), None, None, gr.DownloadButton(visible=False)
        where = tempfile.mkdtemp(prefix="verify-", dir=folder)
        try:
            image = report.plot(os.path.join(where, "verify.png"))
        except ImportError as exc:  # matplotlib missing: the table and summary still say everything
            gr.Warning(str(exc))
            image = None
        path = os.path.join(where, "verify-report.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(report.to_json() + "\n")
        return done(summary(report)), image, _styled(layer_rows(report)), gr.DownloadButton(value=path, visible=True)

    wire_action([start.click, target.submit], start, stop, on_run, [target, device, dtype, backward],
                [result, plot, table, download])
