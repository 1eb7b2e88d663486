"""The verify plot names its x axis after the modules: every row when they fit, else every k-th row and the first
divergence, long names shortened to their end, and no two labels overlapping in the saved PNG."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from torchport.verify import LayerRow, Report, compare
from torchport.verify import plot as verify_plot

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PARTS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.down_proj")


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list:
    """The figures the plot draws, kept after it saves them."""
    made = []

    def recording(width: float, height: float):
        figure = real(width, height)
        made.append(figure)
        return figure

    real = verify_plot.new_figure
    monkeypatch.setattr(verify_plot, "new_figure", recording)
    return made


def llama_like_report(rows: int, first_failing: int) -> Report:
    layers = []
    for i in range(rows):
        rel = 1e-6 if i < first_failing else 1e-2
        layers.append(LayerRow(index=i, name=f"model.layers.{i // len(PARTS)}.{PARTS[i % len(PARTS)]}",
                               type="Linear", kind="output", shape=(2, 3), dtype="float32", max_abs_error=rel,
                               rel_error=rel, ok=rel < 1e-4))
    return Report(device="npu:0", dtype="bfloat16", reference="cpu", reference_dtype="float64", rtol=1e-4,
                  atol=1e-6, backward=False, layers=layers)


def tick_labels(figure) -> list[tuple[float, str]]:
    ax = figure.axes[0]
    return [(tick, label.get_text()) for tick, label in zip(ax.get_xticks(), ax.get_xticklabels())]


def test_tick_labels_are_the_module_names(tmp_path, figures) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Linear(4, 8), act=nn.ReLU(), head=nn.Linear(8, 2)))
    report = compare(model, torch.randn(3, 4), device="cpu", backward=True)
    path = report.plot(tmp_path / "verify.png")
    assert open(path, "rb").read()[:8] == PNG_MAGIC
    (figure,) = figures
    assert tick_labels(figure) == [(row.index, row.name) for row in report.layers]
    assert [name for _, name in tick_labels(figure)][:4] == ["embed", "act", "head", "(root)"]
    assert {"head.weight.grad", "embed.bias.grad"} <= {name for _, name in tick_labels(figure)}


def test_failing_names_are_red_and_the_first_divergence_bold(tmp_path, figures) -> None:
    report = llama_like_report(10, first_failing=6)
    report.plot(tmp_path / "verify.png")
    labels = figures[0].axes[0].get_xticklabels()
    assert [label.get_text() for label in labels] == [_short_or_same(row.name) for row in report.layers]
    assert labels[6].get_color() == "tab:red" and labels[6].get_fontweight() == "bold"
    assert labels[7].get_color() == "tab:red" and labels[7].get_fontweight() == "normal"
    assert labels[5].get_color() != "tab:red"


def _short_or_same(name: str) -> str:
    return name if len(name) <= 28 else verify_plot._short(name)


def test_many_rows_are_thinned_shortened_and_legible(tmp_path, figures) -> None:
    report = llama_like_report(250, first_failing=133)
    report.plot(tmp_path / "verify.png")
    (figure,) = figures
    labels = tick_labels(figure)
    assert 30 <= len(labels) <= 60
    by_index = {row.index: row.name for row in report.layers}
    for tick, text in labels:
        name = by_index[int(tick)]
        assert len(text) <= 28
        assert text == name or (text.startswith("…") and name.endswith(text[1:]))
    assert any(int(tick) == 133 for tick, _ in labels)  # the first divergence is always named
    ax = figure.axes[0]  # every row keeps a tick (matplotlib drops the minor ones under a major one)
    assert set(ax.get_xticks(minor=True)) | set(ax.get_xticks()) == set(range(250))
    renderer = figure.canvas.get_renderer()
    boxes = sorted((label.get_window_extent(renderer) for label in figure.axes[0].get_xticklabels()),
                   key=lambda box: box.x0)
    assert all(left.x1 <= right.x0 for left, right in zip(boxes, boxes[1:])), "tick labels overlap"
    assert all(box.y0 >= 0 for box in boxes), "tick labels cut off at the bottom of the figure"


def test_short_keeps_the_end_from_a_dot() -> None:
    assert verify_plot._short("model.layers.11.self_attn.q_proj") == "…layers.11.self_attn.q_proj"
    assert verify_plot._short("encoder.0") == "encoder.0"
    long_part = "a" * 40
    assert verify_plot._short(long_part) == "…" + "a" * 27
