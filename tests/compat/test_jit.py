"""TorchScript under the shim: scripting and tracing compile for real, and the shim's replacements of torch's
built-in functions compile as the operators they stand for."""

import pytest
import torch
from torch.jit import _builtins

import torchport.compat as compat


def scaled(x: torch.Tensor) -> torch.Tensor:
    # torch.tensor and torch.zeros_like are among the factories the shim replaces to redirect device="cuda"
    return x * torch.tensor(2.0) + torch.zeros_like(x)


def moved(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    # annotated with torch's own device class, before the shim replaces torch.device on a host target
    return x.to(device) + torch.zeros(1, device=torch.device("cpu")).to(device)


def test_script_accepts_device_annotations_made_before_the_patch(shim: torch.device) -> None:
    scripted = torch.jit.script(moved)
    out = scripted(torch.ones(2), torch.device(shim.type))
    assert out.device.type == shim.type
    torch.testing.assert_close(out.cpu(), torch.ones(2))


def test_script_compiles_calls_to_replaced_factories(shim: torch.device) -> None:
    assert torch.zeros_like is not torch.zeros_like.__wrapped__  # the shim did replace it
    scripted = torch.jit.script(scaled)
    assert isinstance(scripted, torch.jit.ScriptFunction)  # compiled, not passed through
    assert "aten::zeros_like" in str(scripted.graph) and "aten::tensor" in str(scripted.graph)
    x = torch.arange(3.0, device="cuda")
    assert x.device.type == shim.type
    torch.testing.assert_close(scripted(x).cpu(), torch.tensor([0.0, 2.0, 4.0]))


def test_trace_records_the_redirected_device(shim: torch.device) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).cuda()
    example = torch.ones(4, 3).cuda()
    traced = torch.jit.trace(model, example)
    assert isinstance(traced, torch.jit.ScriptModule)
    out = traced(example)
    assert out.device.type == shim.type
    torch.testing.assert_close(out.cpu(), model(example).cpu())


def test_unpatch_takes_the_replacements_out_of_torchscripts_table(device: torch.device) -> None:
    if device.type == "cuda":
        pytest.skip("on CUDA the shim has nothing to redirect")
    compat.patch(device)
    replacement = torch.zeros_like
    assert _builtins._find_builtin(replacement) == "aten::zeros_like"
    compat.unpatch()
    assert _builtins._find_builtin(replacement) is None
    assert torch.zeros_like is not replacement
    torch.testing.assert_close(torch.jit.script(scaled)(torch.ones(2)), torch.full((2,), 2.0))
