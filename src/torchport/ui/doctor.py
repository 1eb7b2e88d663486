"""The Doctor tab: :func:`torchport.doctor.run_checks` as a table, with each failure and its explanation on top."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..device import devices
from ..doctor import Check, run_checks
from .jobs import Job, done, escape_markdown, failed, run_job, wire_action

__all__ = ["ALL_DEVICES", "HEADERS", "check_rows", "run", "summary", "tab"]

ALL_DEVICES = "every device"
HEADERS = ["check", "device", "status", "detail"]


def run(job: Job, device: str = ALL_DEVICES) -> list[Check]:
    """The checks of :func:`torchport.doctor.run_checks` for one device, or for every device.

    Raises:
        ValueError, RuntimeError: ``device`` is not a device of this machine (the message lists what there is).

    Example:
        >>> all(check.ok for check in run(Job(), "cpu"))
        True
    """
    job.report(None, f"running the checks on {device}")
    checks = run_checks(None if device == ALL_DEVICES else device)
    job.check()
    return checks


def check_rows(checks: Sequence[Check]) -> list[list[str]]:
    """One table row per check: name, device (``-`` for the machine), PASS, FAIL or SKIP (nothing to check: an
    optional package that is not installed), the detail.

    Example:
        >>> check_rows(run_checks("cpu"))[0]
        ['torch', '-', 'PASS', 'torch 2.13.0+cpu, built with no accelerator toolkit']
    """
    return [[check.name, check.device or "-", check.status, check.detail] for check in checks]


def summary(checks: Sequence[Check]) -> str:
    """Markdown: how many checks passed or were skipped, and each failure with its explanation (what was found, what
    to do).

    Example:
        >>> summary(run_checks("cpu"))
        '### All 16 checks passed; 3 skipped, not installed: torch\\_npu, liger\\_kernel, cann'
    """
    failed = [check for check in checks if not check.ok]
    skipped = [check.name for check in checks if check.skipped]
    skips = f"; {len(skipped)} skipped, not installed: {escape_markdown(', '.join(skipped))}" if skipped else ""
    if not failed:
        return f"### All {len(checks) - len(skipped)} checks passed{skips}"
    lines = [f"### {len(failed)} of {len(checks)} checks failed{skips}"]
    for check in failed:
        where = f" on `{check.device}`" if check.device else ""
        lines.append(f"- **{check.name}**{where}: {escape_markdown(check.detail)}")
    return "\n".join(lines)


def _styled(rows: list[list[str]]) -> Any:
    import pandas as pd

    frame = pd.DataFrame(rows, columns=HEADERS)

    def colour(row: Any) -> list[str]:
        style = {"FAIL": "color: #b91c1c; font-weight: 600", "SKIP": "color: #a16207"}.get(row["status"], "")
        return [style if column in ("check", "status") else "" for column in row.index]

    return frame.style.apply(colour, axis=1)


def tab() -> None:
    """Build the Doctor tab inside the current ``gr.Blocks``.

    Example:
        >>> with gr.Blocks() as app:
        ...     tab()
    """
    import gradio as gr

    gr.Markdown("The checks of `torchport doctor`: torch build, settings, each device (dtype probes, matmul, conv, "
                "softmax and an autograd step against the CPU, a memory round trip) and optional packages.")
    with gr.Row():
        device = gr.Dropdown([ALL_DEVICES, *(str(d) for d in devices())], value=ALL_DEVICES, label="device",
                             scale=0, min_width=260)
    with gr.Row():
        start = gr.Button("Run checks", variant="primary", elem_id="doctor-run", scale=0, min_width=160)
        stop = gr.Button("Cancel", interactive=False, scale=0, min_width=120)
    result = gr.Markdown(elem_id="doctor-summary")
    table = gr.Dataframe(headers=HEADERS, interactive=False, wrap=True, elem_id="doctor-table",
                         column_widths=["12%", "10%", "8%", "70%"], label="checks")

    async def on_run(choice: str, progress: Any = gr.Progress()) -> tuple[Any, Any]:
        try:
            checks = await run_job(run, choice, progress=progress)
        except (ValueError, RuntimeError) as exc:  # a device that went away since the page was built
            return failed(str(exc)), None
        return done(summary(checks)), _styled(check_rows(checks))

    wire_action([start.click], start, stop, on_run, [device], [result, table])
