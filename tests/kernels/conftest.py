"""The ``impl`` fixture: each kernel test runs once per implementation that can run on the device under test.

The implementations are the registry's. ``reference`` runs everywhere; ``triton`` on CUDA, and on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, set by the top-level conftest on machines without a GPU); ``npu`` on
the NPU (the simulated one in CI, whose fused operators follow torch_npu's contracts). A test module of one op's
module (``test_glu.py`` for ``kernels/glu.py``) runs only the implementations its ops have.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from torchport.kernels import registry


def _interpreted_triton() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def _implementations_of_module(test_module: str) -> set[str] | None:
    """The implementation names of the ops declared in the kernels module that ``test_module`` tests, or None when
    it tests no op module."""
    module = test_module.rpartition(".")[2].removeprefix("test_")
    ops = [name for name, spec in registry.list_specs().items() if spec.call.__module__.endswith(f".{module}")]
    if not ops:
        return None
    return {impl for op in ops for impl in registry.list_kernels()[op]}


@pytest.fixture(params=sorted({name for names in registry.list_kernels().values() for name in names}))
def impl(request: pytest.FixtureRequest, device: torch.device) -> str:
    """The implementation under test, skipped where it cannot run on ``device``."""
    name = request.param
    names = _implementations_of_module(request.module.__name__)
    if names is not None and name not in names:
        pytest.skip(f"the ops of {request.module.__name__} have no {name} implementation")
    if name == "triton" and not (device.type == "cuda" or (device.type == "cpu" and _interpreted_triton())):
        pytest.skip(f"triton runs on cuda, or on cpu under TRITON_INTERPRET=1; not on {device.type} here")
    if name == "npu" and device.type != "npu":
        pytest.skip("the npu implementation runs on npu tensors only")
    return name
