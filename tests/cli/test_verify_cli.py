"""`torchport verify`: exit codes, table, JSON, plot, --input, and one-line usage errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchport.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = f"{ROOT / 'examples' / 'verify_target.py'}:factory"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TARGETS = textwrap.dedent('''
    import torch
    from torch import nn


    class OnNpuShift(nn.Module):
        def forward(self, x):
            return x + 1e-2 if x.device.type == "npu" else x


    class FailsOffReference(nn.Module):
        def forward(self, x):
            if x.dtype != torch.float64:
                raise RuntimeError("operator not implemented on this device")
            return x


    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(3, 4)

        def forward(self, x, y):
            return self.a(x) + self.b(y)


    def mlp(shift=False, fail=False):
        torch.manual_seed(0)
        layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16)]
        if shift:
            layers.append(OnNpuShift())
        if fail:
            layers.append(FailsOffReference())
        return nn.Sequential(*layers, nn.Linear(16, 2)), torch.randn(4, 8)


    def planted():
        return mlp(shift=True)


    def failing():
        return mlp(fail=True)


    def two_inputs():
        torch.manual_seed(0)
        return TwoInputs(), (torch.randn(2, 8), torch.randn(2, 3))


    def not_a_pair():
        return nn.Linear(2, 2)


    NOT_CALLABLE = 3
''')


@pytest.fixture
def targets(tmp_path: Path) -> Path:
    path = tmp_path / "targets.py"
    path.write_text(TARGETS)
    return path


def _torchport(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("TORCHPORT_")}
    return subprocess.run([sys.executable, "-m", "torchport", *args], env={**clean, "COLUMNS": "200", **env},
                          capture_output=True, text=True, timeout=120)


def test_example_passes_with_json_and_plot(device: torch.device, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    out_json, out_png = tmp_path / "report.json", tmp_path / "report.png"
    code = main(["verify", EXAMPLE, "--device", str(device), "--json-out", str(out_json), "--plot", str(out_png)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all 15 rows within tolerance" in out
    report = json.loads(out_json.read_text())
    assert report["ok"] is True and report["device"] == str(device) and len(report["layers"]) == 15
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_divergence_exits_1_with_the_table(npu: torch.device, targets: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    out_json = tmp_path / "report.json"
    assert main(["verify", f"{targets}:planted", "--device", "npu", "--json-out", str(out_json)]) == 1
    out = capsys.readouterr().out
    assert "FIRST" in out and "first divergence: 3 (OnNpuShift)" in out
    assert json.loads(out_json.read_text())["first_divergence"] == "3"
    assert main(["verify", f"{targets}:planted", "--device", "cpu"]) == 0  # the bug is on the npu only


def test_divergence_in_a_fresh_process(targets: Path) -> None:
    result = _torchport("verify", f"{targets}:planted", "--device", "npu", TORCHPORT_SIMULATE="npu")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "first divergence: 3 (OnNpuShift)" in result.stdout and "Traceback" not in result.stderr


def test_npu_absent_names_the_simulated_npu(targets: Path) -> None:
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed: the NPU is not missing")
    result = _torchport("verify", f"{targets}:planted", "--device", "npu")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("torchport verify: error: --device='npu' asked for npu")
    assert "torch_npu is not installed" in result.stderr and "set TORCHPORT_SIMULATE=npu" in result.stderr


def test_model_failing_on_the_device_names_the_layer(device: torch.device, targets: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", f"{targets}:failing", "--device", str(device)]) == 1
    err = capsys.readouterr().err
    assert f"failed on {device} (float32) in module '3' (FailsOffReference)" in err
    assert "operator not implemented" in err


def test_input_shape_replaces_the_factory_inputs(targets: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    assert main(["verify", f"{targets}:mlp", "--device", "cpu", "--input", "3x8", "--json-out", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["layers"][-1]["shape"] == [3, 2]


def test_input_files(targets: Path, tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    x, y = torch.randn(5, 8), torch.randn(5, 3)
    torch.save((x, y), tmp_path / "args.pt")
    safetensors.save_file({"x": x, "y": y}, str(tmp_path / "kwargs.safetensors"))
    safetensors.save_file({"0": x, "1": y}, str(tmp_path / "args.safetensors"))
    for name in ("args.pt", "kwargs.safetensors", "args.safetensors"):
        out_json = tmp_path / f"{name}.json"
        code = main(["verify", f"{targets}:two_inputs", "--device", "cpu", "--input", str(tmp_path / name),
                     "--json-out", str(out_json)])
        assert code == 0, name
        assert json.loads(out_json.read_text())["layers"][0]["shape"] == [5, 4], name


def test_dtype_option(targets: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    assert main(["verify", f"{targets}:mlp", "--device", "cpu", "--dtype", "bfloat16",
                 "--json-out", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert report["dtype"] == "bfloat16" and report["rtol"] == 0.1


@pytest.mark.parametrize("args, message", [
    (["no_colon"], "is not package.module:factory"),
    (["no_such_module_xyz:factory"], "no module named 'no_such_module_xyz'"),
    (["{targets}:missing"], "'missing' does not exist in"),
    (["{targets}:NOT_CALLABLE"], "'NOT_CALLABLE' is not callable"),
    (["{targets}:not_a_pair"], "must return (model, inputs)"),
    (["{targets}:mlp", "--device", "npu:5"], "npu:5"),
    (["{targets}:mlp", "--device", "gpu"], "'gpu' is not a device type"),
    (["{targets}:mlp", "--input", "2xfoo"], "neither an existing file nor a shape"),
    (["{targets}:mlp", "--input", "{targets}"], "give a .pt, .pth or .safetensors file"),
    (["{targets}:mlp", "--plot", "/no/such/folder/x.png"], "does not exist"),
    (["{targets}:mlp", "--rtol", "-1"], "rtol=-1"),
])
def test_usage_errors_exit_2_with_one_line(targets: Path, npu: torch.device, capsys: pytest.CaptureFixture,
                                           args: list[str], message: str) -> None:
    args = [arg.format(targets=targets) for arg in args]
    assert main(["verify", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("torchport verify: error: ") and message in captured.err
    assert len(captured.err.strip().splitlines()) == 1
