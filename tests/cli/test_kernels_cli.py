"""`torchport kernels`: every row says why no faster implementation runs, from what the registry knows."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator

import pytest
import torch

import torchport
from torchport.cli.main import main
from torchport.kernels import list_kernels, registry
from torchport.testing import npu_fused_ops


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    registry.refresh()
    yield
    registry.refresh()


def _rows(device: torch.device) -> dict[str, dict]:
    return {row["op"]: row for row in torchport.kernels.table([device])}


def test_every_row_of_the_command_has_a_reason(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["kernels", "--json", "--device", "cpu"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["op"] for row in rows} == set(list_kernels())
    assert all(row["notes"] for row in rows), [row for row in rows if not row["notes"]]
    by_op = {row["op"]: row for row in rows}
    assert by_op["rms_norm"]["notes"] == ["reference is the only implementation for cpu", "triton runs on cuda only",
                                          "npu runs on npu only"]
    assert by_op["fused_linear_cross_entropy"]["implementation"] == "chunked"
    assert by_op["fused_linear_cross_entropy"]["notes"][0] == "chunked is already the fastest implementation for cpu"
    monkeypatch.setenv("COLUMNS", "250")  # one line per row
    assert main(["kernels", "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    line = next(line for line in table.splitlines() if "rms_norm" in line)
    assert "only implementation for cpu" in line


def test_the_fastest_implementation_says_so(npu: torch.device, fresh_registry: None) -> None:
    row = _rows(npu)["rms_norm"]
    assert row["implementation"] == "npu"
    assert row["notes"][0] == "npu is already the fastest implementation for npu"


def test_a_missing_vendor_operator_is_the_reason(npu: torch.device, fresh_registry: None) -> None:
    with npu_fused_ops.only(["npu_swiglu"]):
        registry.refresh()
        row = _rows(npu)["rms_norm"]
    assert row["implementation"] == "reference"
    assert row["notes"][0] == "npu: the npu software stack has no fused operator npu_rms_norm"


def test_a_forced_implementation_says_who_forced_it(npu: torch.device, fresh_registry: None) -> None:
    with torchport.settings.override(kernels="reference"):
        row = _rows(npu)["rms_norm"]
    assert row["implementation"] == "reference"
    assert row["notes"][:2] == ["forced by TORCHPORT_KERNELS=reference", "auto mode would use npu"]
    with torchport.settings.override(kernels="rope=reference"):
        rows = _rows(npu)
    assert rows["rope"]["notes"][0] == "forced by TORCHPORT_KERNELS (rope=reference)"
    assert not any(note.startswith("forced") for note in rows["rms_norm"]["notes"])


def test_triton_missing_is_the_reason_on_a_gpu(monkeypatch: pytest.MonkeyPatch, fresh_registry: None) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "triton" else real(name, *args))
    row = _rows(torch.device("cuda", 0))["rms_norm"]  # the table reads the registry only: no GPU is needed
    assert row["implementation"] == "reference"
    assert row["notes"] == ["triton: Triton is not installed (pip install triton)", "npu runs on npu only"]
    with torchport.settings.override(kernels="triton"):
        with pytest.raises(registry.KernelError, match="cannot run on cuda: Triton is not installed"):
            registry.select("rms_norm", torch.device("cuda", 0))
