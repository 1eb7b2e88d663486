"""Tests are written once and run per device: cpu, the simulated npu (or a real one), and cuda when present."""

from __future__ import annotations

import pytest
import torch

from torchport.backends import get_backend
from torchport.testing import simulate_npu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _device_types() -> list[str]:
    types = ["cpu", "npu"]  # npu: the real one when present, else the simulated one
    types += [name for name in ("cuda", "xpu", "mps") if get_backend(name).is_available()]
    return types


def _use(kind: str) -> torch.device:
    backend = get_backend(kind)
    if not backend.is_available():
        simulate_npu()  # only "npu" can be missing here
        backend = get_backend(kind)
    return backend.device(0)


@pytest.fixture(params=_device_types())
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device type this machine can test, with index 0."""
    return _use(request.param)


@pytest.fixture
def npu() -> torch.device:
    """The NPU: a real one when torch_npu finds one, else the simulated one."""
    return _use("npu")


@pytest.fixture(params=list(DTYPES), ids=list(DTYPES))
def dtype(request: pytest.FixtureRequest, device: torch.device) -> torch.dtype:
    """fp32, bf16, fp16 on the device under test; skipped where the device lacks the dtype (by probe)."""
    chosen = DTYPES[request.param]
    backend = get_backend(device.type)
    if not backend.dtype_works(chosen, device.index or 0):
        pytest.skip(f"{chosen} does not work on {device} (dtype probe)")
    return chosen
