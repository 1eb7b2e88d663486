import json
import random

import numpy
import pytest
import torch

import torchport
from torchport.backends import get_backend


def test_device_honours_torchport_device(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPORT_DEVICE", device.type)
    assert torchport.device() == device
    assert torchport.device(prefer="cpu") == device  # the variable forces, prefer only prefers
    assert torchport.device(force_cpu=True) == torch.device("cpu")


def test_device_prefers_then_detects(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHPORT_DEVICE", raising=False)
    assert torchport.device(prefer=device.type) == device
    assert torchport.device(prefer=str(device)) == device
    assert torchport.device(prefer=torch.device(device.type)) == device
    assert torchport.device().type in {d.type for d in torchport.devices()}
    assert torchport.device(prefer="xpu") == torchport.device()  # absent preferred type: detection decides


def test_missing_index_names_what_exists(npu: torch.device) -> None:
    count = get_backend("npu").device_count()
    with pytest.raises(ValueError) as err:
        torchport.device(f"npu:{count + 2}")
    message = str(err.value)
    assert f"npu:{count + 2}" in message and f"{count} npu device" in message and "npu:0" in message


@pytest.mark.parametrize(
    ("value", "error", "fragment"),
    [
        ("gpu", ValueError, "TORCHPORT_DEVICE='gpu' is not a device type; registered: npu, cuda, xpu, mps, cpu"),
        ("cuda:x", ValueError, "write a device type or type:index"),
    ],
)
def test_bad_torchport_device(monkeypatch: pytest.MonkeyPatch, value: str, error: type, fragment: str) -> None:
    monkeypatch.setenv("TORCHPORT_DEVICE", value)
    with pytest.raises(error) as err:
        torchport.device()
    assert fragment in str(err.value)


def test_forced_absent_device_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    absent = next((n for n in ("xpu", "mps", "cuda") if not get_backend(n).is_available()), None)
    if absent is None:
        pytest.skip("every device type is present")
    monkeypatch.setenv("TORCHPORT_DEVICE", absent)
    with pytest.raises(RuntimeError, match=f"asked for {absent}, but no {absent} device is available: .*Available"):
        torchport.device()


def test_absent_npu_names_the_simulated_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_backend("npu")
    monkeypatch.setattr(backend, "is_available", lambda: False)
    monkeypatch.setattr(backend, "unavailable_reason", lambda: "torch_npu is not installed")
    with pytest.raises(RuntimeError) as err:
        torchport.device("npu:0")
    message = str(err.value)
    assert "device='npu:0' asked for npu, but no npu device is available: torch_npu is not installed" in message
    assert "set TORCHPORT_SIMULATE=npu" in message


def test_absent_device_that_cannot_be_simulated_has_no_simulation_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_backend("xpu")
    monkeypatch.setattr(backend, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="asked for xpu") as err:
        torchport.device("xpu:0")
    assert "TORCHPORT_SIMULATE" not in str(err.value)


def test_devices_lists_accelerators_then_cpu(device: torch.device) -> None:
    found = torchport.devices()
    assert found[-1] == torch.device("cpu") and device in found


def test_dtype_and_synchronize(device: torch.device) -> None:
    assert torchport.dtype(device) in (torch.bfloat16, torch.float16, torch.float32)
    torchport.synchronize(device)


def test_seed_reaches_python_numpy_torch_and_device(device: torch.device) -> None:
    def draw() -> tuple:
        return random.random(), numpy.random.rand(), torch.rand(3), torch.rand(3, device=device).cpu()

    torchport.seed(123)
    first = draw()
    torchport.seed(123)
    second = draw()
    assert first[:2] == second[:2] and torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    with pytest.raises(ValueError, match="seed must be an integer"):
        torchport.seed(-1)


def test_generator(device: torch.device) -> None:
    a = torch.randn(8, device=device, generator=torchport.generator(5, device)).cpu()
    b = torch.randn(8, device=device, generator=torchport.generator(5, device)).cpu()
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="seed must be an integer"):
        torchport.generator("5", device)  # type: ignore[arg-type]


def test_info_and_memory_are_plain_data(device: torch.device) -> None:
    info = torchport.info()
    json.dumps(info)
    entry = next(d for d in info["devices"] if d["device"] == str(device))
    assert entry["dist_backend"] and entry["preferred_dtype"] in ("bfloat16", "float16", "float32")
    assert {p["dtype"] for p in entry["dtype_probes"]} == {"float32", "bfloat16", "float16"}
    assert info["torch"]["version"] == torch.__version__ and info["host"]["total"] > 0
    mem = torchport.memory()
    json.dumps(mem)
    assert str(device) in mem["devices"] and mem["host"]["total"] > 0
    torchport.empty_cache()


def test_info_without_probes_runs_no_kernel(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    backend = get_backend(device.type)
    monkeypatch.setattr("torchport.backends.base.probe", lambda *a: pytest.fail("probe ran"))
    monkeypatch.setattr(backend, "_probes", {})
    entry = next(d for d in torchport.info(probe=False)["devices"] if d["device"] == str(device))
    assert "dtype_probes" not in entry
