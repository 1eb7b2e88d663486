"""`torchport doctor`: the checks of torchport.doctor and their rendering by the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from torchport.backends import DtypeProbe, get_backend
from torchport.cli.doctor import exit_code
from torchport.cli.main import main
from torchport.doctor import Check, run_checks


DEVICE_CHECKS = {"device", "dtypes", "matmul", "conv2d", "softmax", "autograd", "memory"}


def _torchport(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("TORCHPORT_")}
    return subprocess.run(
        [sys.executable, "-m", "torchport", *args],
        env={**clean, "COLUMNS": "200", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _by_name(checks: list[Check], device: str | None) -> dict[str, Check]:
    return {check.name: check for check in checks if check.device == device}


# -- the command line, in a fresh process -------------------------------------------------------------------------
def test_json_passes_and_holds_only_json() -> None:
    result = _torchport("doctor", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)  # fails if anything but the JSON document is on stdout
    assert report["ok"] is True
    cpu = {check["name"] for check in report["checks"] if check["device"] == "cpu"}
    assert DEVICE_CHECKS <= cpu
    assert report["info"]["selected"] in {check["device"] for check in report["checks"]}


def test_json_lists_the_simulated_npu_with_dtype_probes() -> None:
    # --device: where a GPU is present, the simulated NPU beside it breaks the GPU's backward (see below)
    result = _torchport("doctor", "--json", "--device", "npu:0", TORCHPORT_SIMULATE="npu")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    npu = {check["name"]: check for check in report["checks"] if check["device"] == "npu:0"}
    assert DEVICE_CHECKS <= set(npu)
    assert "npu:0" in next(c for c in report["checks"] if c["name"] == "accelerators")["data"]["devices"]
    probes = npu["dtypes"]["data"]["probes"]
    assert set(probes) == {"float32", "bfloat16", "float16"}
    assert probes["float32"]["works"] is True
    memory = npu["memory"]["data"]
    assert npu["memory"]["ok"] and memory["during"] - memory["before"] >= 16 * 2**20 - min(memory["before"], 8 * 2**20)


def test_table_shows_pass_and_a_summary() -> None:
    result = _torchport("doctor", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout and "FAIL" not in result.stdout
    assert "checks passed" in result.stdout.strip().splitlines()[-1]


def test_unknown_device_is_a_usage_error() -> None:
    result = _torchport("doctor", "--device", "nonsense")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("torchport doctor: error: ") and "nonsense" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_absent_device_index_names_what_exists() -> None:
    result = _torchport("doctor", "--device", "npu:3", TORCHPORT_SIMULATE="npu")
    assert result.returncode == 2
    assert "npu:3" in result.stderr and "npu:0" in result.stderr
    assert "Traceback" not in result.stderr


# -- the library, in this process ---------------------------------------------------------------------------------
def test_every_device_passes(device: torch.device) -> None:
    checks = run_checks(str(device))
    assert [c for c in checks if not c.ok] == []
    assert DEVICE_CHECKS <= set(_by_name(checks, str(device)))
    assert exit_code(checks) == 0


@pytest.mark.parametrize(("soc", "expected", "absent"), [
    ("Ascend910B3", ["float32, float16, bfloat16", "swiglu (npu_swiglu)", "attention (npu_fusion_attention)",
                     "not on this chip: none"], []),
    ("Ascend310P3", ["no bfloat16", "rms_norm (npu_rms_norm)", "swiglu -> reference (no npu_swiglu)",
                     "attention -> sdpa (no npu_fusion_attention)"], ["swiglu (npu_swiglu)"]),
])
def test_an_npu_chip_is_checked(npu: torch.device, soc: str, expected: list[str], absent: list[str]) -> None:
    from torchport.testing import is_simulating, simulated_chip

    if not is_simulating():
        pytest.skip("changes the simulated chip; this NPU is a real one")
    with simulated_chip(soc):
        chip = _by_name(run_checks("npu"), "npu:0")["chip"]
    assert chip.ok and chip.detail.startswith(f"{soc} (")
    assert all(text in chip.detail for text in expected) and not any(text in chip.detail for text in absent)
    assert chip.data["soc"] == soc and chip.data["device"] == "npu:0 (simulated)"
    assert "chip" not in _by_name(run_checks("cpu"), "cpu")  # a device without chip profiles has no such check


def _uninstall(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make package metadata say that the distributions ``names`` are not installed."""
    from torchport import doctor

    real = doctor.metadata.version

    def version(distribution: str) -> str:
        if distribution in names:
            raise doctor.metadata.PackageNotFoundError(distribution)
        return real(distribution)

    monkeypatch.setattr(doctor.metadata, "version", version)


def test_missing_optional_package_is_skipped_not_passed(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    _uninstall(monkeypatch, "transformers")
    checks = run_checks("cpu")
    transformers = _by_name(checks, None)["transformers"]
    assert transformers.skipped and transformers.status == "SKIP" and transformers.ok  # not a failure
    assert transformers.detail.startswith("not installed: pip install transformers (needed only for ")
    assert transformers.to_dict()["status"] == "SKIP"
    assert exit_code(checks) == 0

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["doctor", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("│ transformers "))
    assert "SKIP" in row and "PASS" not in row and "pip install transformers" in row
    assert "skipped, not installed: " in out.strip().splitlines()[-1] and "transformers" in out.splitlines()[-1]
    assert main(["doctor", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert next(c for c in report["checks"] if c["name"] == "transformers")["status"] == "SKIP"


def test_installed_packages_pass_and_a_missing_dependency_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    numpy = _by_name(run_checks("cpu"), None)["numpy"]
    assert numpy.status == "PASS" and numpy.detail == numpy.data["version"]
    _uninstall(monkeypatch, "numpy")
    checks = run_checks("cpu")
    numpy = _by_name(checks, None)["numpy"]
    assert numpy.status == "FAIL" and "torchport needs it: pip install numpy" in numpy.detail
    assert exit_code(checks) == 1


def test_broken_dtype_probe_fails_with_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(index: int) -> None:
        raise RuntimeError("probe kernel crashed\nsecond line of the message")

    monkeypatch.setattr(get_backend("cpu"), "dtype_probes", broken)
    checks = run_checks("cpu")
    dtypes = _by_name(checks, "cpu")["dtypes"]
    assert not dtypes.ok
    assert dtypes.detail == "RuntimeError: probe kernel crashed"
    assert _by_name(checks, "cpu")["matmul"].ok  # one broken check does not stop the others
    assert exit_code(checks) == 1


def test_reduced_precision_failing_is_reported_not_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_backend("cpu")
    probes = dict(backend.dtype_probes(0))
    probes[torch.bfloat16] = DtypeProbe(torch.bfloat16, False, None, None, "RuntimeError: bf16 unsupported")
    monkeypatch.setattr(backend, "dtype_probes", lambda index: probes)
    dtypes = _by_name(run_checks("cpu"), "cpu")["dtypes"]
    assert dtypes.ok and "bfloat16 does not work (RuntimeError: bf16 unsupported)" in dtypes.detail
    assert dtypes.data["preferred"] in ("float16", "float32")

    probes[torch.float32] = DtypeProbe(torch.float32, False, 0.5, 1.0, "max error 0.5 exceeds 0.001")
    dtypes = _by_name(run_checks("cpu"), "cpu")["dtypes"]
    assert not dtypes.ok and "float32 must work" in dtypes.detail


def test_allocation_not_counted_fails_the_memory_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(get_backend("cpu"), "memory_stats", lambda index: {"allocated": 0})
    memory = _by_name(run_checks("cpu"), "cpu")["memory"]
    assert not memory.ok and "grew by 0 bytes" in memory.detail


def test_invalid_setting_fails_the_settings_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPORT_PROBE", "maybe")
    settings = _by_name(run_checks("cpu"), None)["settings"]
    assert not settings.ok and "TORCHPORT_PROBE='maybe'" in settings.detail


def test_cli_exit_code_is_1_when_a_check_fails(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def broken(index: int) -> None:
        raise MemoryError("no memory left")

    monkeypatch.setattr(get_backend("cpu"), "memory_stats", broken)
    assert main(["doctor", "--device", "cpu", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    failed = [c for c in report["checks"] if not c["ok"]]
    assert [(c["name"], c["detail"]) for c in failed] == [("memory", "MemoryError: no memory left")]


def test_exit_code() -> None:
    assert exit_code([Check("a", None, True, "", {}), Check("b", "cpu", True, "", {})]) == 0
    assert exit_code([Check("a", None, True, "", {}), Check("b", "cpu", False, "broken", {})]) == 1


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("torchport ")
