import time

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
