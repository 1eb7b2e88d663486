"""Inference calls, where no gradient can be asked for, run a kernel's forward without building an autograd node
(``kernels/_autograd.apply``): the outputs are those of a recording call, and nothing is recorded."""

from __future__ import annotations

import pytest
import torch

from torchport.kernels import _autograd
from torchport.kernels.glu import swiglu_reference
from torchport.kernels.layer_norm import layer_norm_reference
from torchport.kernels import lowbit_matmul
from torchport.kernels.lowbit_matmul import lowbit_linear
from torchport.kernels.rms_norm import rms_norm_reference
from torchport.kernels.rope import rope_reference
from torchport.kernels.triton import glu, norm, rope
from torchport.quant.formats import get_format


class _Scale(torch.autograd.Function):
    contexts: list[str] = []

    @staticmethod
    def forward(ctx, x, factor):
        _Scale.contexts.append((type(ctx).__name__, ctx.needs_input_grad[0]))
        ctx.save_for_backward(x)
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx, dy):
        return dy * ctx.factor, None


def test_apply_records_only_where_a_gradient_can_be_asked_for():
    _Scale.contexts.clear()
    x = torch.randn(3)
    assert _autograd.apply(_Scale, x, 2.0).grad_fn is None  # no argument requires a gradient
    leaf = x.clone().requires_grad_()
    with torch.no_grad():
        y = _autograd.apply(_Scale, leaf, 2.0)
    assert y.grad_fn is None and not y.requires_grad
    y = _autograd.apply(_Scale, leaf, 2.0)
    y.sum().backward()
    assert torch.equal(leaf.grad, torch.full((3,), 2.0))
    assert _Scale.contexts[:2] == [("_Discard", False), ("_Discard", False)]
    assert _Scale.contexts[2][0] != "_Discard" and _Scale.contexts[2][1]


def _ops(device: torch.device) -> dict[str, tuple]:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q, k = randn(2, 4, 3, 16), randn(2, 2, 3, 16)
    cos, sin = randn(3, 16), randn(3, 16)
    fmt = get_format("int4")
    codes = {name: t.to(device) for name, t in fmt.quantize(torch.randn(24, 256, generator=gen), 128).items()}
    return {  # the Triton kernels' entry points; the low-bit layer through its public function (the Triton
        # kernels on CUDA, the reference on the CPU: the autograd Function sits above the registry there)
        "rms_norm": (lambda x, w: norm.rms_norm(x, w, 1e-6, 0.0, False, rms_norm_reference), randn(5, 48), randn(48)),
        "layer_norm": (lambda x, w, b: norm.layer_norm(x, w, b, 1e-5, layer_norm_reference), randn(5, 48), randn(48),
                       randn(48)),
        "rope": (lambda q, k: rope.rope(q, k, cos, sin, rope_reference), q, k),
        "swiglu": (lambda g, u: glu.glu(g, u, False, False, swiglu_reference), randn(5, 40), randn(5, 40)),
        "lowbit_matmul": (lambda x: lowbit_linear(x, codes, "int4", 128, None, dequantize=fmt.dequantize),
                          randn(3, 256)),
    }


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "rope", "swiglu", "lowbit_matmul"])
@pytest.mark.parametrize("impl", ["triton"], indirect=True)
def test_triton_kernels_give_recorded_outputs_without_recording(op, device, impl, monkeypatch):
    fn, *inputs = _ops(device)[op]
    recorded = fn(*(t.detach().requires_grad_() for t in inputs))
    function = {"rms_norm": norm._NormFunction, "layer_norm": norm._NormFunction, "rope": rope._RopeFunction,
                "swiglu": glu._GluFunction, "lowbit_matmul": lowbit_matmul._LowbitLinear}[op]

    def refuse(*args):
        raise AssertionError(f"{function.__name__}.apply called under no_grad")

    monkeypatch.setattr(function, "apply", refuse)
    with torch.no_grad():
        bare = fn(*(t.detach().requires_grad_() for t in inputs))
    recorded = recorded if isinstance(recorded, tuple) else (recorded,)
    bare = bare if isinstance(bare, tuple) else (bare,)
    for r, b in zip(recorded, bare, strict=True):
        assert r.grad_fn is not None and b.grad_fn is None
        torch.testing.assert_close(b, r.detach(), rtol=0, atol=0)
