from __future__ import annotations

import pytest
import torch

import torchport
from torchport.kernels.glu import geglu_reference, swiglu_reference

from kernel_cases import call, call_backward, check_close, gradients, leaf, on_chip

SHAPES = [(1, 1), (3, 5, 123), (2, 7, 4097), (2, 65537)]
REFERENCES = {"swiglu": swiglu_reference, "geglu": geglu_reference}


def _case(op, shape, device, dtype):
    gen = torch.Generator().manual_seed(2)
    gate, up, dout = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    ref, ref_grads = gradients(REFERENCES[op], [gate.clone().requires_grad_(), up.clone().requires_grad_()], [dout])
    return [leaf(gate, device, dtype), leaf(up, device, dtype)], dout.to(device, dtype), ref, ref_grads


def _skip_missing(op, impl):
    if op == "geglu" and impl == "npu":
        pytest.skip("geglu has no npu implementation")


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_backward_against_float64(op, shape, device, dtype, impl):
    _skip_missing(op, impl)
    inputs, dout, ref, (ref_dgate, ref_dup) = _case(op, shape, device, dtype)
    out, (dgate, dup) = gradients(lambda g, u: call(op, impl, g, u, False), inputs, [dout])
    assert out.dtype == dtype
    check_close("out", out, ref, dtype)
    check_close("dgate", dgate, ref_dgate, dtype)
    check_close("dup", dup, ref_dup, dtype)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_compiled_graph_backward_from_inputs(op, shape, device, dtype, impl):
    """The implementation's backward for ``torch.ops.torchport.<op>``: new gradients, the inputs left as they are."""
    _skip_missing(op, impl)
    inputs, dout, _, (ref_dgate, ref_dup) = _case(op, shape, device, dtype)
    gate, up = (t.detach() for t in inputs)
    before = (gate.clone(), up.clone())
    dgate, dup = call_backward(op, impl, (dout,), (True, True), gate, up)
    check_close("dgate", dgate, ref_dgate, dtype)
    check_close("dup", dup, ref_dup, dtype)
    assert torch.equal(gate, before[0]) and torch.equal(up, before[1])


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in_place"])
def test_halves_of_a_fused_projection(op, in_place, device, dtype, impl):
    """gate and up as the two halves of one [.., 2n] tensor: strided rows, used where they lie."""
    _skip_missing(op, impl)
    inputs, dout, ref, (ref_dgate, ref_dup) = _case(op, (3, 4, 50), device, dtype)
    fused = leaf(torch.cat([t.detach() for t in inputs], dim=-1), device, dtype)
    out = call(op, impl, *(fused * 1).chunk(2, dim=-1), in_place)  # an intermediate, as after a projection
    out.backward(dout)
    check_close("out", out, ref, dtype)
    dgate, dup = fused.grad.chunk(2, dim=-1)
    check_close("dgate", dgate, ref_dgate, dtype)
    check_close("dup", dup, ref_dup, dtype)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_zero_size(op, device, impl):
    _skip_missing(op, impl)
    gate = torch.empty(0, 7, device=device, requires_grad=True)
    up = torch.empty(0, 7, device=device, requires_grad=True)
    out = call(op, impl, gate, up, False)
    out.sum().backward()
    assert out.shape == (0, 7) and gate.grad.shape == (0, 7)


def test_in_place_misuse_fails_loudly(device, impl):
    """A node that saved ``gate`` before the in-place backward overwrote it raises instead of using the gradient."""
    if impl != "triton":
        pytest.skip("the in-place backward is the Triton kernel's")
    x = torch.randn(4, 8, device=device, requires_grad=True)
    gate = x * 1.0
    other = gate * x  # MulBackward saves gate
    out = call("swiglu", impl, gate, torch.randn(4, 8, device=device), True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + other.sum()).backward()


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
@pytest.mark.parametrize("rows,forced,torchs", [(16, False, True), (17, False, False), (2, True, False)],
                         ids=["16 rows", "17 rows", "forced"])
def test_host_bound_calls_take_torchs_operators(monkeypatch, op, rows, forced, torchs):
    """On an accelerator in auto mode, inputs of at most 2^17 elements (16 rows of 8192) go to torch's activation
    and product, whose C++ autograd nodes cost the host less than the Triton path; a forced ``triton`` runs as
    forced."""
    pytest.importorskip("triton")
    from torchport.kernels import glu as module
    from torchport.kernels import registry
    from torchport.kernels.triton import glu

    ran = []
    monkeypatch.setattr(module.F, "silu", lambda g: ran.append(("torch", "silu")) or g)
    monkeypatch.setattr(module.F, "gelu", lambda g, approximate: ran.append(("torch", approximate)) or g)
    monkeypatch.setattr(glu, "glu", lambda gate, up, gelu, *rest: ran.append(("triton", gelu)) or gate)
    if forced:
        monkeypatch.setenv("TORCHPORT_KERNELS", f"{op}=triton")
    gate = torch.empty(rows, 8192, device="meta", dtype=torch.bfloat16)  # an accelerator's tensor, never computed
    out = registry.implementation(op, "triton").fn(gate, torch.empty_like(gate), False)
    assert out.shape == gate.shape
    assert ran == ([("torch", "silu" if op == "swiglu" else "tanh")] if torchs else [("triton", op == "geglu")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host-bound route is taken on an accelerator")
@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_host_bound_call_on_cuda_against_float64(monkeypatch, op):
    """A decode-sized call outside a graph runs torch's operators (autograd's C++ nodes) and stays within bf16's
    tolerance of the float64 reference; captured in a CUDA graph, the same call runs the Triton kernel."""
    from torchport.kernels.triton import glu

    inputs, dout, ref, (ref_dgate, ref_dup) = _case(op, (3, 123), torch.device("cuda"), torch.bfloat16)
    launched = []
    kernel = glu.glu
    monkeypatch.setattr(glu, "glu", lambda *args: launched.append(args[2]) or kernel(*args))
    out = getattr(torchport.kernels, op)(*inputs)
    assert type(out.grad_fn).__name__ == "MulBackward0" and launched == []
    dgate, dup = torch.autograd.grad(out, inputs, dout)
    check_close("out", out, ref, torch.bfloat16)
    check_close("dgate", dgate, ref_dgate, torch.bfloat16)
    check_close("dup", dup, ref_dup, torch.bfloat16)
    gate, up = (t.detach() for t in inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # the kernel's first launch may compile it inside the capture
    with torch.cuda.graph(graph):
        captured = getattr(torchport.kernels, op)(gate, up)
    graph.replay()
    torch.cuda.synchronize()
    assert launched == [op == "geglu"]
    check_close("captured", captured, ref, torch.bfloat16)


def test_modules_and_bad_input(device):
    gate, up = torch.randn(2, 9, device=device), torch.randn(2, 9, device=device)
    check_close("swiglu", torchport.kernels.SwiGLU()(gate, up), swiglu_reference(gate.cpu().double(),
                                                                                 up.cpu().double()), torch.float32)
    check_close("geglu", torchport.kernels.GeGLU()(gate, up), geglu_reference(gate.cpu().double(),
                                                                               up.cpu().double()), torch.float32)
    with pytest.raises(ValueError, match=r"same shape, got \[2, 9\] and \[2, 8\]"):
        torchport.kernels.swiglu(gate, up[:, :8])
    with pytest.raises(TypeError, match=r"one dtype, got gate torch.float32, up torch.float16"):
        torchport.kernels.geglu(gate, up.half())
    with pytest.raises(TypeError, match="gate has dtype torch.int64"):
        torchport.kernels.swiglu(gate.long(), up)


def test_npu_swiglu_of_any_shape(npu):
    """torch_npu.npu_swiglu takes a contiguous, non-empty input of 1 to 8 dims: a scalar or 9-D pair goes as rows,
    an empty one needs no kernel."""
    from torchport.testing import npu_fused_ops

    with on_chip("Ascend910B3"):
        for shape in [(), (1, 1, 1, 1, 1, 1, 1, 2, 6)]:
            gate, up = torch.randn(shape), torch.randn(shape)
            calls = npu_fused_ops.calls["npu_swiglu"]
            out = torchport.kernels.swiglu(gate.to(npu), up.to(npu))
            assert out.shape == shape and npu_fused_ops.calls["npu_swiglu"] == calls + 1
            check_close("out", out, swiglu_reference(gate.double(), up.double()), torch.float32)
        calls = npu_fused_ops.calls["npu_swiglu"]
        empty = torch.empty(0, 4).to(npu)
        assert torchport.kernels.swiglu(empty, empty).shape == (0, 4) and npu_fused_ops.calls["npu_swiglu"] == calls
        with pytest.raises(RuntimeError, match="contiguous, non-empty"):
            npu_fused_ops.npu_swiglu(torch.empty(0, 8).to(npu))
