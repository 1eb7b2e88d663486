"""The verify Report: table, JSON and PNG plot."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from torchport.verify import LayerRow, Report, compare

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def report_with(rows: list[tuple[str, float, bool]]) -> Report:
    layers = [LayerRow(index=i, name=name, type="Linear", kind="output", shape=(2, 3), dtype="float32",
                       max_abs_error=rel, rel_error=rel, ok=ok) for i, (name, rel, ok) in enumerate(rows)]
    return Report(device="npu:0", dtype="float32", reference="cpu", reference_dtype="float64", rtol=1e-4,
                  atol=1e-6, backward=False, layers=layers)


def assert_png(path: object) -> None:
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_first_divergence_is_the_first_failing_row() -> None:
    report = report_with([("a", 1e-7, True), ("b", 0.5, False), ("c", 0.0, True), ("d", float("inf"), False)])
    assert not report.ok and report.first_divergence == "b" and report.first_failing().index == 1
    assert report_with([("a", 0.0, True)]).first_divergence is None
    assert report_with([]).ok and "no module output" in report_with([]).summary()


def test_table_marks_the_first_divergence() -> None:
    text = str(report_with([("encoder.0", 1e-7, True), ("encoder.1", 0.5, False), ("(root)", 0.5, False)]))
    lines = text.splitlines()
    assert "npu:0 (float32) against cpu (float64)" in text
    assert any("encoder.1" in line and "FIRST" in line for line in lines)
    assert any("(root)" in line and "FAIL" in line for line in lines)
    assert lines[-1].startswith("first divergence: encoder.1 (Linear), relative error 5.00e-01 > rtol 0.0001")


def test_json_round_trips() -> None:
    report = report_with([("a", 1e-7, True), ("b", float("nan"), False)])
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["first_divergence"] == "b"
    assert data["layers"][0] == {**data["layers"][0], "name": "a", "shape": [2, 3], "rel_error": 1e-7, "ok": True}
    assert data["layers"][1]["rel_error"] == "nan"
    assert report.to_dict()["rtol"] == 1e-4


def test_plot_writes_a_png(tmp_path: object) -> None:
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    report = compare(model, torch.randn(3, 4), device="cpu", backward=True)
    path = report.plot(tmp_path / "ok.png")
    assert_png(path)

    failing = report_with([("a", 0.0, True), ("b", 2e-3, False), ("c", float("inf"), False)])
    assert_png(failing.plot(str(tmp_path / "failing.png")))


def test_plot_without_matplotlib_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report_with([("a", 0.0, True)]).plot(tmp_path / "x.png")
