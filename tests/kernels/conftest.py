"""The ``impl`` fixture: each kernel test runs once per implementation that can run on the device under test.

``reference`` runs everywhere; ``triton`` on CUDA, and on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``,
set by the top-level conftest on machines without a GPU); ``npu`` on the NPU (the simulated one in CI, whose fused
operators follow torch_npu's contracts).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def _interpreted_triton() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


@pytest.fixture(params=["reference", "triton", "npu"])
def impl(request: pytest.FixtureRequest, device: torch.device) -> str:
    """The implementation under test, skipped where it cannot run on ``device``."""
    name = request.param
    if name == "triton" and not (device.type == "cuda" or (device.type == "cpu" and _interpreted_triton())):
        pytest.skip(f"triton runs on cuda, or on cpu under TRITON_INTERPRET=1; not on {device.type} here")
    if name == "npu" and device.type != "npu":
        pytest.skip("the npu implementation runs on npu tensors only")
    return name


