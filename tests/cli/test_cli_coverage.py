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


# -- an Ascend chip (--soc) ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("soc", "fused", "not_fused", "bf16"), [
    ("Ascend910B3", ["npu_swiglu", "npu_cross_entropy_loss", "npu_fusion_attention"], [], "bfloat16 yes"),
    ("Ascend310P3", ["npu_rms_norm", "npu_weight_quant_batchmatmul"], ["swiglu", "cross_entropy"], "bfloat16 no"),
    ("Ascend910A", ["npu_rms_norm", "npu_rotary_mul"], ["swiglu", "lowbit_matmul"], "bfloat16 no"),
])
def test_a_chip_report_without_a_model(capsys, soc: str, fused: list[str], not_fused: list[str], bf16: str) -> None:
    assert main(["coverage", "--device", "npu", "--soc", soc]) == 0
    out = capsys.readouterr().out
    assert f"torchport kernels on {soc}" in out and bf16 in out and "TORCH_NPU_FALLBACK_CPU_DISABLE" in out
    assert main(["coverage", "--device", "npu", "--soc", soc, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "npu" and data["chip"]["soc"] == soc
    rows = {row["kernel"]: row for row in data["chip"]["kernels"]}
    assert {row["operator"] for row in rows.values() if row["fused"]} >= set(fused)
    assert all(not rows[kernel]["fused"] and rows[kernel]["implementation"] == "reference" for kernel in not_fused)
    assert data["chip"]["dtypes"]["bfloat16"] is (bf16 == "bfloat16 yes")


def test_a_model_in_bfloat16_on_a_chip_without_it_exits_one(targets: Path, capsys) -> None:
    args = ["coverage", f"{targets}:mlp", "--device", "npu", "--dtype", "bfloat16", "--json"]
    assert main([*args, "--soc", "Ascend310P3"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["chip"]["soc"] == "Ascend310P3" and "bfloat16" in data["dtypes"]
    missing = [row for row in data["rows"] if row["status"] == "missing"]
    assert {"aten::addmm", "aten::gelu"} <= {row["op"] for row in missing}
    assert {row["note"] for row in missing} == {"computes in bfloat16, which Ascend310P3 lacks"}
    assert main([*args, "--soc", "Ascend910B1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["missing"] == 0 and data["chip"]["family"] == "A2"
    assert main(["coverage", f"{targets}:mlp", "--device", "npu", "--soc", "Ascend910A"]) == 0  # fp32: runs
    assert "torchport kernels on Ascend910A" in capsys.readouterr().out


def test_the_simulated_chip_is_the_default(capsys, npu: torch.device) -> None:
    from torchport.testing import is_simulating, simulated_chip

    if not is_simulating():
        pytest.skip("changes the simulated chip; this NPU is a real one")
    with simulated_chip("Ascend310P3"):
        assert main(["coverage", "--device", "npu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["chip"]
    assert (data["soc"], data["device"]) == ("Ascend310P3", "npu:0 (simulated)")


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "npu", "--soc", "Ascend999"], "'Ascend999' is not an Ascend chip torchport knows; known: Ascend910A"),
    (["--device", "cpu", "--soc", "Ascend310P3"], "--soc names an Ascend chip, which only --device npu has"),
    (["--device", "cpu"], "TARGET is required with --device cpu"),
])
def test_chip_usage_errors_are_one_line(capsys, args: list[str], message: str) -> None:
    assert main(["coverage", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("torchport coverage: error:") and message in err and "\n" not in err


def test_soc_with_a_target_on_another_device_is_a_usage_error(targets: Path, capsys) -> None:
    assert main(["coverage", f"{targets}:mlp", "--device", "cpu", "--soc", "Ascend910B3"]) == 2
    assert "only --device npu has" in capsys.readouterr().err


def test_planning_for_a_chip_on_a_machine_with_no_npu(run_python) -> None:
    # a fresh process without TORCHPORT_SIMULATE: no NPU, no torch_npu, only torchport's snapshots
    result = run_python("-m", "torchport", "coverage", "--device", "npu", "--soc", "Ascend310P3", "--json",
                        cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    chip = json.loads(result.stdout)["chip"]
    assert chip["device"] is None and chip["aten"]["host_fallback"] is True
    assert chip["aten"]["source"].startswith("snapshot torch_npu_ops-") and "own kernels" in chip["aten"]["source"]
    assert {row["kernel"]: row["implementation"] for row in chip["kernels"]}["swiglu"] == "reference"
    result = run_python("-m", "torchport", "coverage", "--device", "npu", cwd=Path(__file__).parents[2])
    assert result.returncode == 2 and "no Ascend NPU here to report on: name a chip (--soc)" in result.stderr
