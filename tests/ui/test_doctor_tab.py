"""The Doctor tab's functions: the checks of torchport.doctor, their rows, and the failures explained on top."""

from __future__ import annotations

import pytest
import torch

from torchport.doctor import Check
from torchport.ui import doctor
from torchport.ui.jobs import Cancelled, Job


def test_run_on_one_device_passes_and_fills_the_table(npu: torch.device) -> None:
    checks = doctor.run(Job(), "npu:0")
    assert checks and all(check.ok for check in checks)
    rows = doctor.check_rows(checks)
    assert all(len(row) == len(doctor.HEADERS) for row in rows)
    assert {row[1] for row in rows} == {"-", "npu:0"}  # machine checks have no device
    assert {row[2] for row in rows} <= {"PASS", "SKIP"}
    skipped = [check for check in checks if check.skipped]
    assert [row[2] for row in rows if row[2] == "SKIP"] == ["SKIP"] * len(skipped)
    assert doctor.summary(checks).startswith(f"### All {len(checks) - len(skipped)} checks passed")


def test_a_missing_optional_package_is_skip_not_pass() -> None:
    checks = [Check("torch", None, True, "torch 2.13"),
              Check("liger_kernel", None, True, "not installed: pip install liger-kernel", skipped=True)]
    assert [row[2] for row in doctor.check_rows(checks)] == ["PASS", "SKIP"]
    assert doctor.summary(checks) == "### All 1 checks passed; 1 skipped, not installed: liger\\_kernel"


def test_every_device_is_the_default(npu: torch.device) -> None:
    checked = {check.device for check in doctor.run(Job())}
    assert {"npu:0", "cpu"} <= checked


def test_failures_are_listed_first_with_their_explanation() -> None:
    checks = [Check("torch", None, True, "torch 2.13"),
              Check("dtypes", "npu:0", False, "bfloat16 failed: max error 3e-1 exceeds 3e-2 [see *probe*]"),
              Check("settings", None, False, "TORCHPORT_DEVICE='npu:3' asked for <a device> it lacks")]
    text = doctor.summary(checks)
    lines = text.splitlines()
    assert lines[0] == "### 2 of 3 checks failed"
    assert lines[1].startswith("- **dtypes** on `npu:0`: bfloat16 failed")
    assert "\\[see \\*probe\\*\\]" in lines[1]  # the detail shows as written, not as Markdown
    assert lines[2] == "- **settings**: TORCHPORT\\_DEVICE='npu:3' asked for \\<a device\\> it lacks"
    assert doctor.check_rows(checks)[1][2] == "FAIL"


def test_a_device_this_machine_lacks_is_an_error_naming_what_there_is() -> None:
    with pytest.raises((ValueError, RuntimeError), match="xpu"):
        doctor.run(Job(), "xpu:0")


def test_a_cancelled_run_stops() -> None:
    job = Job()
    job.cancel()
    with pytest.raises(Cancelled):
        doctor.run(job, "cpu")
