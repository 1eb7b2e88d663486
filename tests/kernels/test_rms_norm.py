from __future__ import annotations

import pytest
import torch

import torchport
from torchport.kernels.rms_norm import rms_norm_reference

from kernel_cases import call, call_backward, check_close, gradients, leaf, on_chip

SHAPES = [(1, 1), (3, 5, 123), (2, 7, 4097), (3, 9001), (2, 65537)]  # 9001: the one-kernel backward reading w per tile


def _case(shape, device, dtype, offset=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 0.5
    w = torch.randn(shape[-1], generator=gen, dtype=torch.float64)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    ref, (ref_dx, ref_dw) = gradients(lambda a, b: rms_norm_reference(a, b, 1e-6, offset),
                                      [x.clone().requires_grad_(), w.clone().requires_grad_()], [dy])
    return (leaf(x, device, dtype), leaf(w, device, dtype), dy.to(device, dtype)), (ref, ref_dx, ref_dw)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_forward_backward_against_float64(shape, offset, device, dtype, impl):
    (x, w, dy), (ref, ref_dx, ref_dw) = _case(shape, device, dtype, offset)
    y, (dx, dw) = gradients(lambda a, b: call("rms_norm", impl, a, b, 1e-6, offset, False), [x, w], [dy])
    assert y.dtype == dtype and y.device == x.device
    check_close("y", y, ref, dtype)
    check_close("dx", dx, ref_dx, dtype)
    check_close("dw", dw, ref_dw, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_compiled_graph_backward_from_inputs(shape, offset, device, dtype, impl):
    """The implementation's backward for ``torch.ops.torchport.rms_norm`` (no statistics saved by the forward)."""
    (x, w, dy), (_, ref_dx, ref_dw) = _case(shape, device, dtype, offset)
    dx, dw = call_backward("rms_norm", impl, (dy,), (True, True), x.detach(), w.detach(), 1e-6, offset)
    check_close("dx", dx, ref_dx, dtype)
    check_close("dw", dw, ref_dw, dtype)
    assert dw.dtype == w.dtype
    # the weight's gradient only when asked; an expanded upstream gradient (what .sum() sends) and a transposed x
    up = torch.full((), 0.75, dtype=torch.float64)
    _, (ref_dx, _) = gradients(lambda a, b: rms_norm_reference(a, b, 1e-6, offset),
                               [x.detach().double().requires_grad_(), w.detach().double().requires_grad_()],
                               [up.expand(shape)])
    x_t = x.detach().transpose(0, -1).contiguous().transpose(0, -1)
    dx, dw = call_backward("rms_norm", impl, (up.to(device, dtype).expand(shape),), (True, False), x_t, w.detach(),
                           1e-6, offset)
    assert dw is None
    check_close("dx", dx, ref_dx, dtype)


def test_non_contiguous_input(device, dtype, impl):
    (x, w, dy), (ref, ref_dx, ref_dw) = _case((6, 4, 33), device, dtype)
    # the same values, laid out transposed: x_t.transpose(0, 1) is x, but not contiguous
    x_t = leaf(x.detach().transpose(0, 1).contiguous(), device, dtype)
    y, (dx_t, dw) = gradients(lambda a, b: call("rms_norm", impl, a.transpose(0, 1), b, 1e-6, 0.0, False),
                              [x_t, w], [dy])
    check_close("y", y, ref, dtype)
    check_close("dx", dx_t.transpose(0, 1), ref_dx, dtype)
    check_close("dw", dw, ref_dw, dtype)


def test_strided_weight(device, dtype, impl):
    (x, w, dy), (ref, ref_dx, ref_dw) = _case((3, 40), device, dtype)
    wide = leaf(torch.stack([w.detach(), torch.zeros_like(w)], dim=1).reshape(-1), device, dtype)  # w at even slots
    y, (dx, dwide) = gradients(lambda a, b: call("rms_norm", impl, a, b[::2], 1e-6, 0.0, False), [x, wide], [dy])
    check_close("y", y, ref, dtype)
    check_close("dw", dwide[::2], ref_dw, dtype)
    assert torch.count_nonzero(dwide[1::2].cpu()) == 0


def test_in_place_gradient_matches(device, dtype, impl):
    (x, w, dy), (_, ref_dx, ref_dw) = _case((3, 5, 64), device, dtype)
    y = call("rms_norm", impl, x, w, 1e-6, 0.0, True)
    y.backward(dy.clone())
    check_close("dx", x.grad, ref_dx, dtype)
    check_close("dw", w.grad, ref_dw, dtype)


@pytest.mark.parametrize("shape", [(0, 33), (3, 0)], ids=["zero_rows", "zero_hidden"])
def test_zero_size(shape, device, impl):
    x = torch.empty(shape, device=device, requires_grad=True)
    w = torch.ones(shape[-1], device=device, requires_grad=True)
    y = call("rms_norm", impl, x, w, 1e-6, 0.0, False)
    y.sum().backward()
    assert y.shape == shape
    assert x.grad.shape == shape
    assert torch.equal(w.grad.cpu(), torch.zeros(shape[-1]))


def test_public_function_and_module(device):
    x = torch.randn(4, 7, 96, device=device)
    norm = torchport.kernels.RMSNorm(96, eps=1e-5, offset=1.0, device=device)
    assert torch.equal(norm.weight.cpu(), torch.zeros(96))  # Gemma form: weights start at 0, scale 1 + w
    out = norm(x)
    ref = rms_norm_reference(x.cpu().double(), norm.weight.detach().cpu().double(), 1e-5, 1.0)
    check_close("module", out.cpu(), ref, torch.float32)
    assert torchport.kernels.rms_norm(x, norm.weight.detach(), 1e-5, 1.0).shape == x.shape


def test_bad_input_names_shapes_and_dtypes(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match=r"weight must have shape \[hidden\] = \[8\].*\[2, 8\].*\[7\]"):
        torchport.kernels.rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match=r"\[8, 1\]"):
        torchport.kernels.rms_norm(x, torch.ones(8, 1, device=device))
    with pytest.raises(TypeError, match="x has dtype torch.int64; allowed: float32, bfloat16, float16"):
        torchport.kernels.rms_norm(torch.ones(2, 8, dtype=torch.long, device=device), torch.ones(8, device=device))
    with pytest.raises(TypeError, match="weight must be a tensor"):
        torchport.kernels.rms_norm(x, [1.0] * 8)


def test_tensors_on_different_devices(npu):
    with pytest.raises(ValueError, match=r"one device, got x on npu:0, weight on cpu"):
        torchport.kernels.rms_norm(torch.randn(2, 8, device=npu), torch.ones(8))


def test_npu_takes_any_number_of_dims(npu):
    """torch_npu.npu_rms_norm takes 2 to 8 dims: a 1-D or 9-D input goes to it as rows (and it refuses them as
    they are)."""
    from torchport.testing import npu_fused_ops

    w = torch.randn(16)
    for shape in [(16,), (1, 1, 1, 1, 1, 1, 1, 2, 16)]:
        x = torch.randn(shape)
        calls = npu_fused_ops.calls["npu_rms_norm"]
        y = torchport.kernels.rms_norm(x.to(npu), w.to(npu))
        assert npu_fused_ops.calls["npu_rms_norm"] == calls + 1 and y.shape == shape
        check_close("y", y, rms_norm_reference(x.double(), w.double(), 1e-6), torch.float32)
        with pytest.raises(RuntimeError, match="self must have 2 to 8 dims"):
            npu_fused_ops.npu_rms_norm(x.to(npu), w.to(npu))


def test_npu_rows_of_fewer_than_32_bytes_take_the_reference_on_a_310p(npu):
    from torchport.testing import npu_fused_ops

    x, w = torch.randn(3, 8, dtype=torch.float16), torch.randn(8, dtype=torch.float16)
    with on_chip("Ascend310P3"):
        calls = npu_fused_ops.calls["npu_rms_norm"]
        with pytest.warns(RuntimeWarning, match=r"npu_rms_norm on Ascend310P3 takes rows of at least 32 bytes, not "
                                                r"8 x torch.float16"):
            y = torchport.kernels.rms_norm(x.to(npu), w.to(npu))
        assert npu_fused_ops.calls["npu_rms_norm"] == calls
        check_close("y", y, rms_norm_reference(x.double(), w.double(), 1e-6), torch.float16)
        torchport.kernels.rms_norm(torch.randn(3, 16, dtype=torch.float16).to(npu), torch.ones(16).half().to(npu))
        assert npu_fused_ops.calls["npu_rms_norm"] == calls + 1  # 32 bytes: fused


@pytest.mark.parametrize(("rows", "offset", "weight_dtype", "fused"),
                         [(2, 0.0, torch.bfloat16, True), (16, 0.0, torch.bfloat16, True),
                          (17, 0.0, torch.bfloat16, False), (2, 1.0, torch.bfloat16, False),
                          (2, 0.0, torch.float32, False)],
                         ids=["decode", "16 rows", "17 rows", "gemma", "mixed dtypes"])
def test_host_bound_calls_take_torchs_fused_operator(monkeypatch, rows, offset, weight_dtype, fused):
    """On an accelerator in auto mode, inputs of at most 2^17 elements (16 rows of 8192) go to ``F.rms_norm``, whose
    C++ autograd node costs the host less than the Triton path; Gemma's offset and mixed dtypes stay on Triton."""
    pytest.importorskip("triton")
    import importlib

    from torchport.kernels import registry
    from torchport.kernels.triton import norm

    module = importlib.import_module("torchport.kernels.rms_norm")  # the package's name is the function
    ran = []
    monkeypatch.setattr(module.F, "rms_norm", lambda x, shape, w, eps: ran.append(("fused", shape, eps)) or x)
    monkeypatch.setattr(norm, "rms_norm", lambda x, *rest: ran.append(("triton",)) or x)
    x = torch.empty(rows, 8192, device="meta", dtype=torch.bfloat16)  # an accelerator's tensor, never computed
    w = torch.empty(8192, device="meta", dtype=weight_dtype)
    registry.implementation("rms_norm", "triton").fn(x, w, 1e-5, offset)
    assert ran == ([("fused", (8192,), 1e-5)] if fused else [("triton",)])
    ran.clear()
    monkeypatch.setenv("TORCHPORT_KERNELS", "rms_norm=triton")  # forced: runs as forced
    registry.implementation("rms_norm", "triton").fn(x, w, 1e-5, offset)
    assert ran == [("triton",)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's fused RMSNorm kernel runs on CUDA")
def test_host_bound_call_on_cuda_matches_the_triton_kernel():
    (x, w, dy), (ref, ref_dx, ref_dw) = _case((3, 123), torch.device("cuda"), torch.bfloat16)
    y = torchport.kernels.rms_norm(x, w)
    assert type(y.grad_fn).__name__.startswith("FusedRmsNorm")
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    check_close("y", y, ref, torch.bfloat16)
    check_close("dx", dx, ref_dx, torch.bfloat16)
    check_close("dw", dw, ref_dw, torch.bfloat16)
