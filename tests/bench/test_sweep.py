"""torchport.bench.sweep: batch sizes applied by keyword or by tiling, failures recorded, table and plot."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torchport.bench import batch_inputs, sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Recording(nn.Module):
    """Remembers the inputs of each call; out of memory past ``limit`` rows, like a device that is full."""

    def __init__(self, limit: int = 1 << 30) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.limit = limit
        self.seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"simulated: {x.shape[0]} rows do not fit")
        self.seen.append((x.detach().cpu(), None if positions is None else positions.detach().cpu()))
        return self.linear(x)


def test_factory_with_batch_size_keyword_is_called_per_size(device: torch.device) -> None:
    made: list[Recording] = []

    def factory(batch_size: int = 2) -> tuple[nn.Module, torch.Tensor]:
        made.append(Recording())
        return made[-1], torch.randn(batch_size, 4)

    result = sweep(factory, [1, 3], device=device, warmup=1, iters=2)
    assert result.ok and result.batching == "factory(batch_size=b)"
    assert [p.batch_size for p in result.points] == [1, 3]
    assert [m.seen[0][0].shape[0] for m in made] == [1, 3]
    assert all(p.result.iters == 2 and p.result.throughput > 0 for p in result.points)
    assert next(made[0].parameters()).device.type == device.type


def test_inputs_without_keyword_are_tiled_along_dim_0(device: torch.device) -> None:
    model = Recording()
    x = torch.arange(8, dtype=torch.float32).view(2, 4)
    positions = torch.arange(3)  # first dimension is not the batch: passed unchanged

    result = sweep(lambda: (model, {"x": x, "positions": positions}), [5], device=device, warmup=0, iters=1)
    assert result.batching == "the factory's inputs tiled along dim 0"
    seen_x, seen_positions = model.seen[-1]
    assert seen_x[:, 0].tolist() == [0, 4, 0, 4, 0]
    assert torch.equal(seen_positions, positions)


def test_batch_inputs_rule() -> None:
    inputs = (torch.zeros(2, 3), {"mask": torch.ones(2, 7), "scale": 0.5, "table": torch.ones(5)}, torch.tensor(1.0))
    tiled = batch_inputs(inputs, 3)
    assert tiled[0].shape == (3, 3) and tiled[1]["mask"].shape == (3, 7)
    assert tiled[1]["scale"] == 0.5 and tiled[1]["table"].shape == (5,) and tiled[2].dim() == 0
    assert batch_inputs(inputs, 1)[0].shape == (1, 3)
    with pytest.raises(ValueError, match="batch_size keyword"):
        batch_inputs({"n": 3}, 4)


def test_default_is_the_factorys_own_batch() -> None:
    result = sweep(lambda: (Recording(), torch.randn(6, 4)), device="cpu", warmup=0, iters=1)
    assert [p.batch_size for p in result.points] == [6] and result.batching == "as the factory made them"


def test_out_of_memory_is_recorded_and_the_sweep_goes_on(device: torch.device) -> None:
    model = Recording(limit=4)
    result = sweep(lambda: (model, torch.randn(2, 4)), [2, 8, 4], device=device, warmup=0, iters=1)
    assert not result.ok
    assert [(p.batch_size, p.error is None) for p in result.points] == [(2, True), (8, False), (4, True)]
    assert result.points[1].error.startswith("out of memory") and result.points[1].result is None
    data = json.loads(json.dumps(result.to_dict()))
    assert data["points"][1]["error"].startswith("out of memory") and data["points"][0]["median_ms"] > 0
    assert "out of memory" in str(result)


def test_dtype_casts_weights_and_floating_inputs(device: torch.device) -> None:
    model = Recording()
    result = sweep(lambda: (model, torch.randn(2, 4)), [2], device=device, dtype=torch.float64, warmup=0, iters=1)
    assert result.ok and result.dtype == "float64" and model.seen[-1][0].dtype == torch.float64


def test_bad_factory_and_batch_sizes() -> None:
    with pytest.raises(ValueError, match=r"must return \(model, inputs\).*returned a Tensor"):
        sweep(lambda: torch.ones(2), [1], device="cpu")
    with pytest.raises(ValueError, match=r"returned a tuple of 3"):
        sweep(lambda: (nn.Linear(4, 2), torch.ones(2, 4), None), [1], device="cpu")
    with pytest.raises(ValueError, match="batch size 0"):
        sweep(lambda: (nn.Linear(4, 2), torch.ones(2, 4)), [0], device="cpu")


def test_plot_writes_a_png(tmp_path: object) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    model = Recording(limit=8)
    result = sweep(lambda: (model, torch.randn(2, 4)), [1, 4, 16], device="cpu", warmup=0, iters=2)
    path = result.plot(tmp_path / "bench.png")
    assert open(path, "rb").read(8) == PNG_MAGIC
    assert matplotlib.image.imread(path).shape[1] > 100
