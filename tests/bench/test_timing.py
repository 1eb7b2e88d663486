"""torchport.bench.measure: synchronised timing, percentiles, peak memory, throughput."""

from __future__ import annotations

import time

import pytest
import torch

from torchport.backends import get_backend
from torchport.bench import measure, percentile
from torchport.bench.timing import EVENTS, HOST_CLOCK

from fake_async_device import install

WORK_MS = 5.0


@pytest.mark.parametrize("with_events", [True, False], ids=["events", "host-clock"])
def test_asynchronous_work_is_counted(monkeypatch: pytest.MonkeyPatch, device: torch.device,
                                      with_events: bool) -> None:
    fake = install(monkeypatch, device.type, with_events)

    def step() -> None:
        fake.launch(WORK_MS)  # returns at once; the device is busy for WORK_MS after it

    fake.synchronize()
    start = time.perf_counter()
    step()
    fake.synchronize()
    synchronised_wall_ms = (time.perf_counter() - start) * 1e3
    assert synchronised_wall_ms >= WORK_MS

    result = measure(step, warmup=2, iters=6, device=device)
    assert result.timer == (EVENTS if with_events else HOST_CLOCK)
    # Not less than the synchronised wall time of one call: WORK_MS is its floor (sleeps never end early)
    assert result.median_ms >= WORK_MS - 1e-6
    assert result.p20_ms >= WORK_MS - 1e-6
    assert result.wall_ms >= WORK_MS - 1e-6
    assert len(result.times_ms) == result.iters == 6 and result.warmup == 2


def test_real_work_is_timed(device: torch.device) -> None:
    x = torch.randn(256, 256, device=device)
    result = measure(lambda: (x @ x, time.sleep(0.002)), warmup=1, iters=5, device=device, items=256)
    assert result.median_ms >= 2.0
    assert result.p20_ms <= result.median_ms <= result.p80_ms
    assert result.throughput == pytest.approx(256 / (result.median_ms / 1e3))
    assert result.device == str(device)
    data = result.to_dict()
    assert data["median_ms"] == result.median_ms and data["iters"] == 5 and len(data["times_ms"]) == 5
    assert "ms median" in str(result) and "items/s" in str(result)


def test_peak_memory_counts_the_timed_calls_only(device: torch.device) -> None:
    backend = get_backend(device.type)
    calls = []

    def step() -> None:
        size = 64 if not calls else 8  # the warm-up call allocates 64 MiB, the timed ones 8 MiB
        calls.append(size)
        torch.empty(size * 2**20, dtype=torch.uint8, device=device).fill_(1)

    before = backend.memory_stats(device.index or 0)["allocated"]  # tensors other tests left alive count too
    result = measure(step, warmup=1, iters=3, device=device)
    if backend.memory_stats(device.index or 0)["peak_allocated"] is None:
        assert result.peak_memory is None  # no tensor-byte count on this device, and none is made up
        return
    assert before + 8 * 2**20 <= result.peak_memory < before + 64 * 2**20


def test_percentile_matches_linear_interpolation() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 20) == pytest.approx(1.8)
    assert percentile(values, 80) == pytest.approx(4.2)
    assert percentile([7.0], 20) == 7.0
    numpy = pytest.importorskip("numpy")
    data = [0.3, 9.1, 2.2, 4.8, 4.9, 1.0, 7.7]
    for q in (0, 20, 50, 80, 100):
        assert percentile(data, q) == pytest.approx(float(numpy.percentile(data, q)))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="iters=0"):
        measure(lambda: None, iters=0, device="cpu")
    with pytest.raises(ValueError, match="warmup=-1"):
        measure(lambda: None, warmup=-1, device="cpu")
    with pytest.raises(ValueError, match="items=0"):
        measure(lambda: None, items=0, device="cpu")
    with pytest.raises(TypeError, match="callable"):
        measure(42, device="cpu")
    with pytest.raises((ValueError, RuntimeError), match="npu:9"):
        measure(lambda: None, device="npu:9")
