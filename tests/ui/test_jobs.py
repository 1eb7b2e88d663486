"""Long actions: progress, cancellation from the page, and the message area's text."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from torchport.ui.jobs import Cancelled, Job, check_module_calls, escape_markdown, run_job


def test_job_reports_progress_and_stops_once_cancelled() -> None:
    seen = []
    job = Job(lambda value, desc: seen.append((value, desc)))
    job.report(0.5, "half")
    job.report((2, None), "two")
    assert seen == [(0.5, "half"), ((2, None), "two")]
    job.cancel()
    assert job.cancelled
    with pytest.raises(Cancelled, match="cancelled from the page"):
        job.report(1.0, "never shown")
    assert len(seen) == 2


def test_run_job_returns_the_result_from_a_worker_thread() -> None:
    def work(job: Job, x: int) -> tuple[int, bool]:
        return x * 2, job.thread == threading.get_ident() != threading.main_thread().ident

    assert asyncio.run(run_job(work, 21)) == (42, True)


def test_cancelling_the_task_cancels_the_job() -> None:
    started, jobs = threading.Event(), []

    def work(job: Job) -> None:
        jobs.append(job)
        started.set()
        while True:
            job.check()
            threading.Event().wait(0.01)

    async def main() -> None:
        task = asyncio.ensure_future(run_job(work))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert jobs[0].cancelled


def test_module_calls_report_and_stop_a_running_model() -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)])
    seen = []
    job = Job(lambda value, desc: seen.append(value))
    with check_module_calls(job, "calls"):
        model(torch.ones(1, 4))
    assert seen[0] == (1, None) and seen[-1] == (33, None)  # every 16th call
    job = Job(lambda value, desc: job.cancel() if value[0] > 5 else None)
    with pytest.raises(Cancelled), check_module_calls(job, "calls"):
        for _ in range(10):
            model(torch.ones(1, 4))
    assert not torch.nn.modules.module._global_forward_pre_hooks  # the hook is gone


def test_module_calls_of_other_threads_are_not_stopped() -> None:
    job = Job()
    job.cancel()
    model = torch.nn.Linear(2, 2)
    outputs = []
    with check_module_calls(job, "calls"):
        other = threading.Thread(target=lambda: outputs.append(model(torch.ones(1, 2))))
        other.start()
        other.join()
        assert len(outputs) == 1
        with pytest.raises(Cancelled):
            model(torch.ones(1, 2))


def test_escape_markdown_shows_text_as_written() -> None:
    assert escape_markdown("a_b *c* [x](y) <b> `z` #1 |") == "a\\_b \\*c\\* \\[x\\](y) \\<b\\> \\`z\\` \\#1 \\|"


def test_device_memory_cached_by_a_job_is_given_back(npu: torch.device) -> None:
    from torchport.backends import get_backend

    backend = get_backend("npu")

    def work(job: Job) -> int:
        held = torch.empty(4 * 2**20, dtype=torch.uint8, device=npu)
        return held.numel()

    before = backend.memory_stats(0)["reserved"]
    assert asyncio.run(run_job(work)) == 4 * 2**20
    assert backend.memory_stats(0)["reserved"] <= before
