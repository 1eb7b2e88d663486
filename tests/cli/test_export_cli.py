"""`torchport export`: report and exit codes, the ATC script, refused options; `torchport bench --onnx`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from torchport.cli.main import main  # noqa: E402

TARGETS = Path(__file__).resolve().parents[1] / "export" / "export_targets.py"


def test_export_with_atc_writes_the_script(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, report = tmp_path / "cnn.onnx", tmp_path / "report.json"
    code = main(["export", f"{TARGETS}:cnn", "--onnx", str(out), "--dynamic-batch", "--atc", "--soc-version",
                 "Ascend910B1", "--precision-mode", "allow_fp32_to_fp16", "--json-out", str(report)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "opset 15" in stdout and "max abs error" in stdout
    assert "atc is not on PATH" in stdout and "set_env.sh" in stdout
    script = (tmp_path / "cnn_atc.sh").read_text()
    assert "--soc_version=Ascend910B1" in script and "--dynamic_batch_size=1,2,4,8" in script
    data = json.loads(report.read_text())
    assert data["ok"] and data["opset"] == 15 and data["inputs"][0]["dynamic_batch"]


def test_over_tolerance_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["export", f"{TARGETS}:cnn", "--onnx", str(tmp_path / "m.onnx"), "--opset", "13", "--rtol", "0",
                 "--atol", "0"]) == 1
    assert "over tolerance" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--atc", "--opset", "19", "--soc-version", "Ascend910B1"], "ATC reads ONNX opsets 9 to 18; opset 19"),
    (["--atc", "--device", "cpu"], "pass --soc-version"),
    (["--atc", "--soc-version", "Ascend910B1", "--batch-sizes", "1,2"], "--batch-sizes needs --dynamic-batch"),
    (["--soc-version", "Ascend910B1"], "add --atc"),
    (["--opset", "13", "--target", "unsupported_op"], "aten::diff"),
    (["--input-names", "a,b"], "input_names has 2 name(s)"),
])
def test_usage_errors_exit_2_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str],
                                            message: str) -> None:
    out = tmp_path / "m.onnx"
    target = "cnn"
    if "--target" in args:
        target = args[args.index("--target") + 1]
        args = args[:args.index("--target")]
    assert main(["export", f"{TARGETS}:{target}", "--onnx", str(out), *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("torchport export: error: ") and message in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    if "--atc" in args:
        assert not out.exists()


def test_bench_times_onnxruntime_beside_eager(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", f"{TARGETS}:cnn", "--device", "cpu", "--onnx", "--opset", "13", "--warmup", "1",
                 "--iters", "2", "--json-out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "onnxruntime CPUExecutionProvider" in stdout
    data = json.loads(out.read_text())
    assert data["ok"]
    assert [p["batch_size"] for p in data["eager"]["points"]] == [1, 4, 8]
    assert [p["batch_size"] for p in data["onnxruntime"]["points"]] == [1, 4, 8]
    assert all(p["median_ms"] > 0 for p in data["onnxruntime"]["points"])
