"""The Verify tab's functions: a module:factory target compared on a device, its rows and the first divergence."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from torchport.ui import verify
from torchport.ui.jobs import Cancelled, Job
from torchport.verify import ModelError, TargetError

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "verify_target.py") + ":factory"

DIVERGING = '''
import torch
from torch import nn


class OffOnDevices(nn.Module):
    def forward(self, x):
        return x + (0.5 if x.device.type != "cpu" else 0.0)   # wrong everywhere but on the CPU


def factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), OffOnDevices(), nn.Linear(8, 2))
    return model, torch.randn(3, 8)
'''


def _target(tmp_path: Path, source: str, name: str = "target.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return f"{path}:factory"


def test_a_matching_target_has_a_row_per_module_and_says_so(npu: torch.device) -> None:
    progress = []
    report = verify.run(Job(lambda value, desc: progress.append(desc)), EXAMPLE, "npu:0")
    assert report.ok and report.device == "npu:0" and report.reference == "cpu"
    rows = verify.layer_rows(report)
    assert len(rows) == len(report.layers) and rows[0][:3] == ["0", "features.0", "Conv2d"]
    assert {row[-1] for row in rows} == {"ok"}
    assert verify.summary(report).startswith("### Matches the reference\nall ")
    assert progress[0].startswith("importing") and any("module calls" in line for line in progress)


def test_the_first_divergent_layer_is_named(tmp_path: Path, npu: torch.device) -> None:
    report = verify.run(Job(), _target(tmp_path, DIVERGING), "npu:0", backward=True)
    assert report.first_divergence == "2"
    statuses = [row[-1] for row in verify.layer_rows(report)]
    assert statuses[:3] == ["ok", "ok", "FIRST"] and "FAIL" in statuses[3:]
    assert any(row[1].endswith("(gradient)") for row in verify.layer_rows(report))
    assert verify.summary(report).startswith("### First divergence: `2` (OffOnDevices)\nfirst divergence: 2 "
                                             "(OffOnDevices), relative error ")


def test_the_model_can_be_cast_first(npu: torch.device) -> None:
    report = verify.run(Job(), EXAMPLE, "npu:0", "bfloat16")
    assert report.dtype == "bfloat16" and report.ok
    with pytest.raises(ValueError, match="dtype 'int8' is not one of: unchanged, float32"):
        verify.run(Job(), EXAMPLE, "npu:0", "int8")


@pytest.mark.parametrize(("source", "message"), [
    ("def factory(:\n", r"could not be imported: SyntaxError: .*target\.py, line 1"),
    ("import no_such_package_here\ndef factory(): pass\n", "could not be imported: ModuleNotFoundError: No module "
                                                           "named 'no_such_package_here'"),
    ("def factory():\n    raise RuntimeError('no weights at /x')\n", "calling the factory raised RuntimeError: no "
                                                                      "weights at /x"),
    ("def factory():\n    return 1, 2\n", r"must return \(model, inputs\).*returned a tuple of 2: \(int, int\)"),
    ("def other(): pass\n", "'factory' does not exist in .*; its functions and classes: other"),
])
def test_a_target_that_cannot_be_used_is_an_error_naming_why(tmp_path: Path, source: str, message: str) -> None:
    with pytest.raises(TargetError, match=message):
        verify.run(Job(), _target(tmp_path, source), "cpu")


def test_targets_that_do_not_exist_are_errors() -> None:
    with pytest.raises(TargetError, match="not package.module:factory"):
        verify.run(Job(), "just_a_name", "cpu")
    with pytest.raises(TargetError, match="no module named 'no_such_module_xyz'"):
        verify.run(Job(), "no_such_module_xyz:factory", "cpu")
    with pytest.raises(TargetError, match="does not exist"):
        verify.run(Job(), "missing/file.py:factory", "cpu")


def test_a_model_that_raises_names_the_module(tmp_path: Path) -> None:
    source = DIVERGING.replace('return x + (0.5 if x.device.type != "cpu" else 0.0)', 'raise ValueError("bad")')
    with pytest.raises(ModelError, match="bad"):
        verify.run(Job(), _target(tmp_path, source), "cpu")


def test_a_cancel_stops_between_two_module_calls(npu: torch.device) -> None:
    job = Job(lambda value, desc: job.cancel() if "module calls" in desc else None)
    with pytest.raises((Cancelled, ModelError)):  # compare names the module it stopped in
        verify.run(job, EXAMPLE, "npu:0")
    assert job.cancelled
    assert not torch.nn.modules.module._global_forward_pre_hooks
