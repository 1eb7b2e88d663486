import time

import pytest

import torch

import torchport


def test_timer_counts_work_inside(device: torch.device) -> None:
    x = torch.randn(128, 128, device=device)
    with torchport.Timer(device) as t:
        for _ in range(4):
            x = x @ x / 128
        time.sleep(0.02)  # host time inside the block is counted too: events are recorded around it
    assert t.ms is not None and t.ms >= 15
    assert "ms" in repr(t) and str(device) in repr(t)


def test_timer_is_reusable(device: torch.device) -> None:
    t = torchport.Timer(device)
    with t:
        pass
    first = t.ms
    with t:
        time.sleep(0.01)
    assert first is not None and t.ms >= 5


def test_one_place_chooses_events_or_the_host_clock(device: torch.device) -> None:
    from torchport.backends import get_backend
    from torchport.timer import EVENTS, HOST_CLOCK, HostEvent, clock, timing_event

    backend = get_backend(device.type)
    start, end = timing_event(backend, device.index), timing_event(backend, device.index)
    has_events = backend.event(enable_timing=True) is not None
    assert isinstance(start, HostEvent) is not has_events
    assert clock(start) == (EVENTS if has_events else HOST_CLOCK)
    start.record()
    time.sleep(0.01)
    end.record()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 5


def test_a_host_event_waits_for_the_device_and_needs_both_records() -> None:
    from torchport.timer import HostEvent

    class Backend:
        synchronized = 0

        def synchronize(self, index):
            Backend.synchronized += 1

    start, end = HostEvent(Backend(), None), HostEvent(Backend(), None)
    start.record()
    assert Backend.synchronized == 1
    with pytest.raises(RuntimeError, match="both events must be recorded"):
        start.elapsed_time(end)
