"""Long dashboard actions (doctor, a kernel benchmark, a verification) run in a worker thread that reports its
progress and stops at its next check once the page cancels it.

The page's Cancel button cancels the asyncio task that awaits the thread (gradio's ``cancels=``); :func:`run_job`
turns that into :meth:`Job.cancel`, and the work raises :class:`Cancelled` at its next :meth:`Job.check`. Work
that has no check (one library call) finishes in the background and its result is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from ..memory import empty_cache

__all__ = ["Cancelled", "Job", "check_module_calls", "done", "escape_markdown", "failed", "run_job",
           "wire_action"]

T = TypeVar("T")
Progress = Callable[..., Any]


class Cancelled(Exception):
    """The page cancelled the action; raised by :meth:`Job.check` in the worker thread."""


class Job:
    """One long action: what it reports, and whether it was cancelled.

    ``progress`` is gradio's ``gr.Progress`` (or any ``progress(value, desc=...)`` callable, or None); ``value`` is
    a fraction in [0, 1], a ``(done, total)`` pair (``total`` None when unknown) or None.

    Example:
        >>> job = Job()
        >>> job.report(0.5, "half way"); job.check()
        >>> job.cancel(); job.cancelled
        True
    """

    def __init__(self, progress: Progress | None = None) -> None:
        self._progress = progress
        self._stop = threading.Event()
        self.thread: int | None = None  # ident of the worker thread, set by run_job

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._stop.is_set()

    def cancel(self) -> None:
        """Ask the work to stop at its next :meth:`check`."""
        self._stop.set()

    def check(self) -> None:
        """Raise :class:`Cancelled` once the action was cancelled."""
        if self._stop.is_set():
            raise Cancelled("cancelled from the page")

    def report(self, value: float | tuple[int, int | None] | None, message: str) -> None:
        """Show progress in the page (and stop here if cancelled)."""
        self.check()
        if self._progress is not None:
            self._progress(value, desc=message)


async def run_job(work: Callable[..., T], *args: Any, progress: Progress | None = None) -> T:
    """Run ``work(job, *args)`` in a worker thread and return its result; cancelling the awaiting task cancels
    the job. Device memory cached by the work is returned to the device when it ends.

    Example:
        >>> async def handler(progress=gr.Progress()):
        ...     return await run_job(lambda job: slow(job), progress=progress)
    """
    job = Job(progress)

    def target() -> T:
        job.thread = threading.get_ident()
        try:
            return work(job, *args)
        finally:
            # the work's tensors are gone: hand their cached blocks back, so the Devices tab shows the device as free
            empty_cache()

    try:
        return await asyncio.to_thread(target)
    except asyncio.CancelledError:
        job.cancel()
        raise


@contextlib.contextmanager
def check_module_calls(job: Job, message: str) -> Iterator[None]:
    """While the block runs, every ``nn.Module`` call on the job's thread reports progress and stops there once the
    job is cancelled: a model that runs for minutes can be stopped between two of its modules.

    Example:
        >>> with check_module_calls(job, "module calls"):
        ...     report = torchport.verify.compare(model, x, device="npu")
    """
    calls = 0
    thread = threading.get_ident()

    def hook(module: torch.nn.Module, args: Any) -> None:
        nonlocal calls
        if threading.get_ident() != thread:
            return  # a module called by another request
        calls += 1
        if calls % 16 == 1 or job.cancelled:
            job.report((calls, None), message)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def wire_action(triggers: list[Any], start: Any, stop: Any, fn: Callable[..., Any], inputs: list[Any],
                outputs: list[Any]) -> Any:
    """Run the handler ``fn`` on ``triggers`` (gradio event triggers) with ``start`` disabled and ``stop`` (a Cancel
    button, disabled in between) enabled while it runs; ``stop`` cancels it. Returns the handler's event.

    Example:
        >>> wire_action([run.click], run, cancel, on_run, [device], [table])
    """
    import gradio as gr

    def running(active: bool) -> Callable[[], tuple[Any, Any]]:
        return lambda: (gr.Button(interactive=not active), gr.Button(interactive=active))

    buttons = [start, stop]
    # one long action at a time in the whole app: a verification beside a benchmark would skew its timings
    event = gr.on(triggers, running(True), outputs=buttons, queue=False, show_progress="hidden").then(
        fn, inputs=inputs, outputs=outputs, concurrency_limit=1, concurrency_id="device-work")
    # gradio 6 runs .then() listeners after a success only, so the buttons come back on a failure too
    for after in (event.then, event.failure):
        after(running(False), outputs=buttons, queue=False, show_progress="hidden")
    stop.click(running(False), outputs=buttons, cancels=[event], queue=False, show_progress="hidden")
    return event


def done(text: str) -> Any:
    """A result for a tab's message area (a ``gr.Markdown``): ``text`` as it is.

    Example:
        >>> return done("### All 26 checks passed"), table
    """
    import gradio as gr

    return gr.Markdown(text, elem_classes=[])


def failed(message: str) -> Any:
    """An error for a tab's message area: the message in a red box that stays until the next run (a toast would
    fade), while the server goes on.

    Example:
        >>> return failed("TARGET='x:y': no module named 'x'"), None
    """
    import gradio as gr

    return gr.Markdown(f"**Error**: {escape_markdown(message)}", elem_classes=["tp-error"])


def escape_markdown(text: str) -> str:
    """Plain text that Markdown shows as written (no emphasis, links, headings or HTML read into it).

    Example:
        >>> escape_markdown("a_b*c")
        'a\\_b\\*c'
    """
    for char in "\\`*_[]<>#|":
        text = text.replace(char, "\\" + char)
    return text
