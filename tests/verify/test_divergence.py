"""torchport.verify.compare: rows per module call, planted bugs found where they are, clear errors on bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torchport
from torchport.verify import ModelError, StructureError, compare


class OnNpuShift(nn.Module):
    """Adds ``shift`` to its input, but only to tensors on an npu: a device bug planted in one layer."""

    def __init__(self, shift: float) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift if x.device.type == "npu" else x


def blocks_model(shift: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(4)]
    blocks[2].append(OnNpuShift(shift))
    return nn.Sequential(nn.Linear(8, 16), *blocks, nn.Linear(16, 4))


def test_planted_bug_on_the_npu_is_named(npu: torch.device) -> None:
    x = torch.randn(4, 8)
    report = compare(blocks_model(shift=1e-2), x, device=npu)
    assert not report.ok
    assert report.first_divergence == "3.3"  # block 2 is module 3 of the outer Sequential; the shift is its 4th
    assert [row.name for row in report.layers if not row.ok][:2] == ["3.3", "3"]  # the block containing it fails next
    rows_before = report.layers[: report.first_failing().index]
    assert rows_before and all(row.ok for row in rows_before)

    assert compare(blocks_model(shift=0.0), x, device=npu).ok  # the same model without the bug passes


def test_healthy_model_passes_and_planted_bug_fires_only_on_the_npu(device: torch.device) -> None:
    report = compare(blocks_model(shift=1e-2), torch.randn(4, 8), device=device)
    assert report.ok is (device.type != "npu")
    assert report.device == str(device) and report.reference == "cpu" and report.reference_dtype == "float64"


class PerturbGelu(TorchDispatchMode):
    """Adds 1e-2 to the result of aten.gelu on npu tensors: a wrong kernel registered for one op on one device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.gelu.default and out.device.type == "npu":
            out = out + 1e-2
        return out


def test_wrong_kernel_for_one_op_names_the_module_that_calls_it(npu: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(3, 8)
    with PerturbGelu():
        broken = compare(model, x, device=npu)
    assert broken.first_divergence == "3"
    assert broken.first_failing().type == "GELU"
    assert compare(model, x, device=npu).ok


def test_every_dtype_passes_with_default_tolerances(device: torch.device, dtype: torch.dtype) -> None:
    model = blocks_model().to(dtype)
    report = compare(model, torch.randn(4, 8), device=device, backward=True)
    assert report.ok, str(report)
    assert report.dtype == str(dtype).removeprefix("torch.")
    assert all(row.dtype == report.dtype for row in report.layers)


def test_rows_are_in_execution_order_with_one_row_per_call(device: torch.device) -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(4, 4)
            self.out = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.shared(self.shared(x)))

    report = compare(Twice(), torch.randn(2, 4), device=device)
    assert [(row.name, row.type) for row in report.layers] == [
        ("shared", "Linear"), ("shared#2", "Linear"), ("out", "Linear"), ("(root)", "Twice")]
    assert [row.index for row in report.layers] == [0, 1, 2, 3]
    assert report.layers[0].shape == (2, 4)


class Structured(nn.Module):
    """Returns a dict holding a tuple, a None and a non-tensor: every kind of nesting compare walks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict:
        return {"pair": (self.a(x), self.b(x) * scale), "missing": None, "count": 2}


def test_nested_outputs_keyword_inputs_and_the_worst_tensor(device: torch.device) -> None:
    report = compare(Structured(), {"x": torch.randn(2, 4), "scale": 3.0}, device=device)
    assert report.ok
    root = report.layers[-1]
    assert root.name == "(root)" and root.tensors == 2 and root.worst in (".pair[0]", ".pair[1]")


def test_hugging_face_model_output(device: torch.device) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    report = compare(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, device=device)
    assert report.ok, str(report)
    names = [row.name for row in report.layers]
    assert "transformer.h.0.attn" in names and "lm_head" in names and names[-1] == "(root)"
    assert report.layers[-1].shape == (2, 8, 64)  # logits, the first tensor of the ModelOutput
    assert next(r for r in report.layers if r.name == "transformer.wte").dtype == "float32"


def test_dropout_is_off_and_the_callers_model_is_untouched(device: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    assert compare(model, x, device=device, backward=True).ok
    assert model.training and all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())


def test_inputs_already_on_the_device_and_integer_inputs_stay_integers(device: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 3))
    ids = torch.tensor([[1, 2, 3], [4, 5, 9]], device=device)
    report = compare(model, ids, device=device)
    assert report.ok and report.layers[0].name == "0" and report.layers[0].shape == (2, 3, 6)


class OnNpuGradShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad + 1e-2 if grad.device.type == "npu" else grad


class GradBug(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(OnNpuGradShift.apply(self.first(x)))


def test_backward_rows_find_a_bug_in_the_backward_only(npu: torch.device) -> None:
    torch.manual_seed(0)
    report = compare(GradBug(), torch.randn(5, 6), device=npu, backward=True)
    forward = [row for row in report.layers if row.kind == "output"]
    grads = [row for row in report.layers if row.kind == "grad"]
    assert all(row.ok for row in forward)
    assert {row.name for row in grads} == {"first.weight.grad", "first.bias.grad", "last.weight.grad",
                                           "last.bias.grad"}
    assert report.first_divergence.startswith("first.") and report.first_divergence.endswith(".grad")
    assert all(row.ok for row in grads if row.name.startswith("last."))


# -- bad input ----------------------------------------------------------------------------------------------------
class FailsOffReference(nn.Module):
    """Raises unless it runs in float64, as an op missing on a device would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float64:
            raise RuntimeError("kernel not implemented for this device\nsecond line")
        return x


def test_model_failing_on_the_target_names_the_layer_and_device(device: torch.device) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), FailsOffReference()))
    with pytest.raises(ModelError) as info:
        compare(model, torch.randn(2, 4), device=device)
    error = info.value
    assert error.module == "1.1" and error.module_type == "FailsOffReference"
    assert error.device == f"{device} (float32)"
    message = str(error)
    assert "'1.1' (FailsOffReference)" in message and str(device) in message
    assert "kernel not implemented" in message and "second line" not in message


class ShapeShifter(nn.Module):
    def forward(self, x: torch.Tensor) -> object:
        return x if x.dtype == torch.float64 else (x, x)


def test_outputs_with_different_structures(device: torch.device) -> None:
    model = nn.Sequential(nn.Linear(4, 4), ShapeShifter())
    with pytest.raises(StructureError, match=r"module '1' \(ShapeShifter\) returned differently structured") as info:
        compare(model, torch.randn(2, 4), device=device)
    assert f"{device} (float32)" in str(info.value) and "cpu (float64)" in str(info.value)


def test_absent_and_unknown_devices() -> None:
    with pytest.raises((ValueError, RuntimeError), match="npu:7"):
        compare(nn.Linear(2, 2), torch.randn(1, 2), device="npu:7")
    with pytest.raises(ValueError, match="'gpu' is not a device type; registered: "):
        compare(nn.Linear(2, 2), torch.randn(1, 2), device="gpu")
    with pytest.raises(TypeError, match="needs a torch.nn.Module, got function"):
        compare(lambda x: x, torch.randn(1, 2), device="cpu")
    with pytest.raises(ValueError, match="rtol=-1"):
        compare(nn.Linear(2, 2), torch.randn(1, 2), device="cpu", rtol=-1)
    with pytest.raises(ValueError, match="reference_dtype"):
        compare(nn.Linear(2, 2), torch.randn(1, 2), device="cpu", reference_dtype=torch.int64)


def test_non_finite_values_on_one_side_fail_and_serialise(device: torch.device) -> None:
    class NanOffReference(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.dtype == torch.float64 else x * float("nan")

    report = compare(nn.Sequential(nn.Linear(3, 3), NanOffReference()), torch.randn(2, 3), device=device)
    row = report.first_failing()
    assert row.name == "1" and math.isinf(row.rel_error) and "non-finite" in row.note
    data = json.loads(report.to_json())  # strict JSON: inf is written as a string
    assert data["layers"][1]["rel_error"] == "inf" and data["first_divergence"] == "1"


def test_tolerances_can_be_loosened(npu: torch.device) -> None:
    report = compare(blocks_model(shift=1e-2), torch.randn(4, 8), device=npu, rtol=0.5)
    assert report.ok and report.rtol == 0.5 and report.atol == torchport.verify.TOLERANCES[torch.float32][1]


def test_device_memory_holds_the_weights_and_a_few_activations(device: torch.device) -> None:
    from torchport.backends import get_backend

    backend = get_backend(device.type)
    if backend.memory_stats(device.index or 0)["peak_allocated"] is None:
        pytest.skip(f"{device} keeps no count of tensor bytes")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])
    x = torch.randn(512, 256)
    weights, activation = 16 * 256 * 257 * 4, 512 * 256 * 4
    backend.reset_peak_memory_stats(device.index or 0)
    base = backend.memory_stats(device.index or 0)["allocated"]
    assert compare(model, x, device=device).ok
    peak = backend.memory_stats(device.index or 0)["peak_allocated"] - base
    assert peak < weights + 6 * activation  # module outputs go to the host as they come, not kept on the device
