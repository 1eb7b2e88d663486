"""Results say when their p20-p80 spread makes the median unreliable, and when the device is simulated."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import torchport.testing
from torchport.bench import WIDE_SPREAD, Monitor, Result, measure, sweep
from torchport.bench.timing import HOST_CLOCK


def _result(times: list[float], simulated: bool = False) -> Result:
    return Result(device="npu:0", timer=HOST_CLOCK, times_ms=tuple(times), warmup=0, simulated=simulated)


def test_a_wide_spread_is_flagged_in_the_result_its_text_and_its_data() -> None:
    wide = _result([1.0] * 5 + [100.0] * 5)
    assert wide.spread == pytest.approx(100.0) and wide.wide_spread
    assert "warning: p80/p20 is 100.0" in str(wide) and "unreliable" in str(wide)
    data = json.loads(json.dumps(wide.to_dict()))
    assert data["wide_spread"] is True and data["spread"] == pytest.approx(100.0)

    narrow = _result([1.0, 1.01, 1.02, 1.03, 1.04])
    assert not narrow.wide_spread and narrow.spread < WIDE_SPREAD
    assert "warning" not in str(narrow) and narrow.to_dict()["wide_spread"] is False
    assert not _result([1.0, 1.0, 1.0]).wide_spread  # every call took as long


def test_the_threshold_is_p80_over_p20() -> None:
    below = _result([1.0, 1.0, WIDE_SPREAD - 0.01, WIDE_SPREAD - 0.01])
    above = _result([1.0, 1.0, WIDE_SPREAD + 0.2, WIDE_SPREAD + 0.2])
    assert below.p80_ms / below.p20_ms < WIDE_SPREAD and not below.wide_spread
    assert above.p80_ms / above.p20_ms > WIDE_SPREAD and above.wide_spread
    assert _result([0.0, 0.0, 0.0, 1.0, 1.0]).wide_spread  # p20 of 0: an infinite spread, and JSON still works
    assert json.loads(json.dumps(_result([0.0, 0.0, 0.0, 1.0, 1.0]).to_dict()))["spread"] is None


def _alternating(short_s: float, long_s: float):  # noqa: ANN202 - a test helper
    durations = itertools.cycle([short_s, long_s])
    return lambda: time.sleep(next(durations))


def test_measure_flags_calls_of_very_different_lengths() -> None:
    result = measure(_alternating(0.001, 0.03), warmup=0, iters=10, device="cpu")
    assert result.wide_spread and result.spread > 10
    assert "warning: p80/p20" in str(result)


def test_the_simulated_npu_is_named_so(npu: torch.device) -> None:
    simulated = torchport.testing.is_simulating()
    x = torch.ones(8, device=npu)
    result = measure(lambda: x + 1, warmup=0, iters=2, device=npu)
    assert result.simulated is simulated and result.to_dict()["simulated"] is simulated
    assert (f"on {npu} (simulated)," in str(result)) is simulated
    monitor = Monitor(npu, warmup=0)
    with monitor:
        x + 1
    assert monitor.report().simulated is simulated
    cpu = measure(lambda: None, warmup=0, iters=1, device="cpu")
    assert not cpu.simulated and "(simulated)" not in str(cpu)


class _Uneven(nn.Module):
    """Calls of alternating length at batch sizes above 1 (a noisy machine, made on purpose), of 20 ms at batch 1
    (sub-millisecond calls can be noisy on a busy machine: the test wants one batch size flagged, not two)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.sleep = _alternating(0.001, 0.03)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            self.sleep()
        else:
            time.sleep(0.02)
        return self.linear(x)


def test_sweep_names_the_batch_sizes_with_a_wide_spread() -> None:
    model = _Uneven()
    result = sweep(lambda: (model, torch.randn(1, 4)), [1, 2], device="cpu", warmup=0, iters=10)
    assert result.wide_spread == [2]
    assert result.to_dict()["wide_spread"] == [2] and result.to_dict()["points"][1]["wide_spread"] is True
    text = str(result)
    assert "p80/p20" in text.splitlines()[2]  # a column of the table
    assert "wide" in next(line for line in text.splitlines() if line.strip().startswith("│     2"))
    assert f"warning: p80/p20 above {WIDE_SPREAD} at batch size 2:" in " ".join(text.split())


def test_sweep_table_and_plot_say_the_device_is_simulated(npu: torch.device, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if not torchport.testing.is_simulating():
        pytest.skip("a real NPU is not simulated")
    result = sweep(lambda: (nn.Linear(4, 2), torch.randn(2, 4)), [2], device=npu, warmup=0, iters=2)
    assert result.simulated and result.to_dict()["simulated"] is True and result.device == str(npu)
    assert f"torchport bench: {npu} (simulated)" in str(result)
    pytest.importorskip("matplotlib")
    from torchport.bench import plot

    figures = []
    real = plot.new_figure
    monkeypatch.setattr(plot, "new_figure", lambda *size: figures.append(real(*size)) or figures[-1])
    result.plot(tmp_path / "bench.png")
    figure = figures[0]
    assert figure._suptitle.get_text() == f"torchport bench: {npu} (simulated)"
    assert figure.axes[0].get_legend_handles_labels()[1] == [f"{npu} (simulated)"]
