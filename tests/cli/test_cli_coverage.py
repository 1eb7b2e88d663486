"""`torchport coverage`: table, JSON, exit codes and one-line usage errors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from torchport.cli.main import main
from torchport.testing import unsupported_ops

TARGETS = textwrap.dedent('''
    import torch
    from torch import nn


    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)), torch.randn(3, 4)


    def not_a_pair():
        return nn.Linear(2, 2)
''')


@pytest.fixture
def targets(tmp_path: Path) -> Path:
    path = tmp_path / "coverage_targets.py"
    path.write_text(TARGETS)
    return path


def test_table_and_exit_zero_when_nothing_is_missing(targets: Path, capsys) -> None:
    assert main(["coverage", f"{targets}:mlp", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "operators on cpu" in out and "aten::addmm" in out and "aten::gelu_backward" in out and "0 missing" in out


def test_json_forward_only(targets: Path, capsys) -> None:
    assert main(["coverage", f"{targets}:mlp", "--device", "cpu", "--json", "--no-backward", "--input", "5x4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "cpu" and data["backward"] is False
    assert {row["phase"] for row in data["rows"]} == {"forward"}
    assert {"op": "aten::addmm", "phase": "forward", "calls": 2, "status": "native", "note": ""} in data["rows"]


def test_exit_one_and_the_missing_operator_in_the_json(targets: Path, capsys, npu: torch.device) -> None:
    if not hasattr(torch.npu, "_torchport_simulated"):
        pytest.skip("a real NPU is present; operators can be declared missing on the simulated one only")
    with unsupported_ops({"aten::gelu_backward"}):
        assert main(["coverage", f"{targets}:mlp", "--device", "npu", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["missing"] == 1
    assert [row["op"] for row in data["rows"] if row["status"] == "missing"] == ["aten::gelu_backward"]


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "gpu"], "device='gpu' is not a device type"),
    (["--device", "cpu", "--input", "2xq"], "--input '2xq' is neither an existing file nor a shape"),
])
def test_usage_errors_are_one_line(targets: Path, capsys, args: list[str], message: str) -> None:
    assert main(["coverage", f"{targets}:mlp", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("torchport coverage: error:") and message in err and "\n" not in err


def test_a_target_that_is_not_a_factory_is_a_usage_error(targets: Path, capsys) -> None:
    assert main(["coverage", f"{targets}:not_a_pair", "--device", "cpu"]) == 2
    assert "must return (model, inputs)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # --device is required
        main(["coverage", f"{targets}:mlp"])
    assert exited.value.code == 2
