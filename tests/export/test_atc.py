"""The ATC command and script: golden text for given options, the opset range, soc_version from the NPU or refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import export_targets as targets  # noqa: E402
from torchport import export  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"


def test_script_for_a_dynamic_batch_cnn_equals_the_golden_text(tmp_path: Path) -> None:
    model, x = targets.cnn()
    path = tmp_path / "cnn.onnx"
    export.onnx(model, x, path, opset=13, dynamic_batch=True)
    script = export.write_atc_script(path, soc_version="Ascend910B1", batch_sizes=[1, 2, 4, 8],
                                     precision_mode="allow_fp32_to_fp16")
    assert script == str(tmp_path / "cnn_atc.sh")
    assert Path(script).read_text() == (GOLDEN / "cnn_atc.sh").read_text()
    assert os.access(script, os.X_OK)


def test_script_for_two_inputs_equals_the_golden_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "llama.onnx"
    path.write_bytes(b"")
    monkeypatch.setattr("torchport.export.atc.graph_inputs",
                        lambda p: [("input_ids", (-1, 12)), ("attention_mask", (-1, 12))])
    script = export.write_atc_script(path, soc_version="Ascend310P3", batch_sizes=[1, 4, 8],
                                     precision_mode="force_fp16")
    assert Path(script).read_text() == (GOLDEN / "llama_atc.sh").read_text()


def test_static_and_dynamic_dims_commands() -> None:
    static = export.atc_command("m.onnx", soc_version="Ascend910B3", inputs=[("x", (1, 3, 8, 8))])
    assert static == ["atc", "--model=m.onnx", "--framework=5", "--output=m", "--soc_version=Ascend910B3",
                      "--input_shape=x:1,3,8,8"]
    dims = export.atc_command("m.onnx", soc_version="Ascend910B3", inputs=[("ids", (-1, -1))],
                              dynamic_dims=[[1, 16], [4, 128]])
    assert dims[-2:] == ["--dynamic_dims=1,16;4,128", "--input_format=ND"]  # ATC needs both together
    with pytest.raises(ValueError, match="besides the batch"):
        export.atc_command("m.onnx", soc_version="Ascend910B3", inputs=[("ids", (-1, -1))])
    with pytest.raises(ValueError, match="batch is fixed"):
        export.atc_command("m.onnx", soc_version="Ascend910B3", inputs=[("x", (1, 3))], batch_sizes=[1, 2])
    with pytest.raises(ValueError, match="valid: force_fp32"):
        export.atc_command("m.onnx", soc_version="Ascend910B3", inputs=[("x", (1, 3))], precision_mode="fp16")


@pytest.mark.parametrize("opset", [8, 19, 23])
def test_opsets_atc_cannot_read_are_refused(opset: int) -> None:
    with pytest.raises(ValueError, match=f"ATC reads ONNX opsets 9 to 18; opset {opset} is outside"):
        export.check_opset(opset)


@pytest.mark.parametrize("opset", [9, 11, 15, 16, 17, 18])
def test_opsets_atc_reads_are_accepted(opset: int) -> None:
    export.check_opset(opset)


def test_soc_version_from_the_npu(npu) -> None:
    assert export.soc_version(device=npu) == "Ascend910B3"  # the chip simulated by default
    assert export.soc_version("Ascend310P3", device=npu) == "Ascend310P3"
    assert export.soc_version("Ascend910B4-1", device=npu) == "Ascend910B4-1"


def test_soc_version_unknown_on_a_cpu() -> None:
    with pytest.raises(ValueError, match=r"cpu is not an Ascend NPU; pass --soc-version .*Ascend910B1.*Ascend310P3"):
        export.soc_version(device="cpu")
    with pytest.raises(ValueError, match="not an Ascend chip name"):
        export.soc_version("910B", device="cpu")
