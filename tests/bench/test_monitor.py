"""torchport.bench.Monitor: steps of the caller's loop, timed without changing the loop."""

from __future__ import annotations

import pytest
import torch

from torchport.bench import Monitor
from torchport.bench import monitor as monitor_module
from torchport.bench.timing import EVENTS, HOST_CLOCK

from fake_async_device import install

WORK_MS = 4.0


@pytest.mark.parametrize("with_events", [True, False], ids=["events", "host-clock"])
def test_steps_count_queued_work_and_skip_warmup(monkeypatch: pytest.MonkeyPatch, device: torch.device,
                                                 with_events: bool) -> None:
    fake = install(monkeypatch, device.type, with_events)
    monitor = Monitor(device, warmup=2)
    for _ in range(6):
        with monitor:
            fake.launch(WORK_MS)
    result = monitor.report()
    assert monitor.steps == 6 and result.iters == 4 and result.warmup == 2
    assert result.timer == (EVENTS if with_events else HOST_CLOCK)
    assert result.median_ms >= WORK_MS - 1e-6
    assert result.wall_ms is None and result.throughput is None


def test_items_per_step_give_throughput(device: torch.device) -> None:
    monitor = Monitor(device, warmup=0, items=8)
    x = torch.randn(64, 64, device=device)
    for size in (8, 8, 4):  # the last batch is smaller, as in a real loader
        with monitor.step(items=size):
            x = x @ x / 64
    result = monitor.report()
    assert result.items == (8.0, 8.0, 4.0)
    assert result.throughput > 0 and result.device == str(device)


def test_long_loops_read_completed_events_as_they_go(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    install(monkeypatch, device.type, with_events=True)
    monkeypatch.setattr(monitor_module, "_RESOLVE_EVERY", 8)
    monitor = Monitor(device, warmup=0)
    for _ in range(30):
        with monitor:
            pass
    assert len(monitor._pending) < 8  # completed pairs were read while the loop ran
    assert monitor.report().iters == 30


def test_failed_steps_are_not_counted_and_steps_cannot_nest() -> None:
    monitor = Monitor("cpu", warmup=0)
    with pytest.raises(KeyError):
        with monitor:
            raise KeyError("bad batch")
    with pytest.raises(ValueError, match="no step measured yet"):
        monitor.report()
    with monitor:
        with pytest.raises(RuntimeError, match="cannot nest"):
            with monitor.step():
                pass
    assert monitor.report().iters == 1
    monitor.reset()
    assert monitor.steps == 0
    with pytest.raises(ValueError, match="items=-1"):
        monitor.step(items=-1)
    with pytest.raises(ValueError, match="warmup=-2"):
        Monitor("cpu", warmup=-2)
