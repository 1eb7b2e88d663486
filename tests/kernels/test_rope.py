from __future__ import annotations

import pytest
import torch

import torchport
from torchport.kernels.rope import rope_reference

from kernel_cases import call, check_close, gradients, leaf, on_chip

# (batch, q heads, kv heads, seq, head_dim). The Triton kernel splits the heads over programs when there are few
# runs of positions: one head each for the short ones; 2x128 positions split 7 heads in two programs whose second
# holds the last q head and both k heads; 600 positions are not split. No q heads, or no k heads: the split runs over
# the other tensor's heads alone.
SHAPES = [(1, 0, 2, 3, 8), (2, 3, 0, 5, 6), (1, 1, 1, 1, 2), (2, 3, 1, 5, 6), (2, 5, 2, 7, 128), (1, 4, 4, 3, 80), (2, 5, 2, 128, 16), (1, 2, 1, 600, 8)]


def _cos_sin(batch, seq, dim, gen):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    pos = torch.randint(0, 4096, (batch, seq), generator=gen).double()  # e.g. packed sequences
    freqs = pos[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _case(shape, device, dtype, transposed):
    batch, hq, hk, seq, dim = shape
    gen = torch.Generator().manual_seed(3)
    if transposed:  # as after a projection: [batch, seq, heads, dim] viewed as [batch, heads, seq, dim]
        q = torch.randn(batch, seq, hq, dim, generator=gen, dtype=torch.float64).transpose(1, 2)
    else:
        q = torch.randn(batch, hq, seq, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, hk, seq, dim, generator=gen, dtype=torch.float64)
    cos, sin = _cos_sin(batch, seq, dim, gen)
    dq, dk = torch.randn(q.shape, generator=gen, dtype=torch.float64), torch.randn(k.shape, generator=gen, dtype=torch.float64)
    ref, ref_grads = gradients(lambda a, b: rope_reference(a, b, cos, sin),
                               [q.clone().requires_grad_(), k.clone().requires_grad_()], [dq, dk])
    q_in = q.to(device, dtype)
    q_in = (q_in.transpose(1, 2).contiguous().transpose(1, 2) if transposed else q_in).detach().requires_grad_()
    inputs = [q_in, leaf(k, device, dtype), cos.to(device, dtype), sin.to(device, dtype)]
    return inputs, [dq.to(device, dtype), dk.to(device, dtype)], ref, ref_grads


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("transposed", [False, True], ids=["bhsd", "bshd_view"])
def test_forward_backward_against_float64(shape, transposed, device, dtype, impl):
    (q, k, cos, sin), grads, (ref_q, ref_k), (ref_dq, ref_dk) = _case(shape, device, dtype, transposed)
    (out_q, out_k), (dq, dk) = gradients(lambda a, b: call("rope", impl, a, b, cos, sin), [q, k], grads)
    check_close("q", out_q, ref_q, dtype)
    check_close("k", out_k, ref_k, dtype)
    check_close("dq", dq, ref_dq, dtype)
    check_close("dk", dk, ref_dk, dtype)
    if impl == "triton":
        assert out_q.stride() == q.stride()  # the output keeps the input's layout


def test_broadcast_cos_and_zero_length(device, impl):
    q, k = torch.randn(3, 2, 5, 8, device=device), torch.randn(3, 1, 5, 8, device=device)
    cos, sin = (t.to(device, torch.float32) for t in _cos_sin(1, 5, 8, torch.Generator().manual_seed(0)))
    out_q, out_k = call("rope", impl, q, k, cos, sin)  # cos/sin batch 1, broadcast over the batch
    ref_q, ref_k = rope_reference(q.cpu().double(), k.cpu().double(), cos.cpu().double(), sin.cpu().double())
    check_close("q", out_q, ref_q, torch.float32)
    check_close("k", out_k, ref_k, torch.float32)
    empty = torch.empty(3, 2, 0, 8, device=device, requires_grad=True)
    out, _ = call("rope", impl, empty, empty.detach()[:, :1], cos[:, :0], sin[:, :0])
    out.sum().backward()
    assert out.shape == (3, 2, 0, 8) and empty.grad.shape == (3, 2, 0, 8)


def test_public_api_accepts_two_dim_cos_and_checks_shapes(device):
    q, k = torch.randn(2, 4, 6, 16, device=device), torch.randn(2, 2, 6, 16, device=device)
    cos, sin = (t.to(device, torch.float32) for t in _cos_sin(1, 6, 16, torch.Generator().manual_seed(0)))
    out_q, _ = torchport.kernels.RoPE()(q, k, cos[0], sin[0])
    check_close("q", out_q, rope_reference(q.cpu().double(), k.cpu().double(), cos.cpu().double(),
                                           sin.cpu().double())[0], torch.float32)
    rope = torchport.kernels.rope
    with pytest.raises(ValueError, match=r"must be \[batch, heads, seq, head_dim\], got q \[2, 4, 96\]"):
        rope(q.reshape(2, 4, 96), k, cos, sin)
    with pytest.raises(ValueError, match=r"k \[2, 2, 5, 16\] must match q \[2, 4, 6, 16\]"):
        rope(q, k[:, :, :5], cos, sin)
    with pytest.raises(ValueError, match=r"cos/sin must be \[batch or 1, seq, head_dim\] = \[2 or 1, 6, 16\].*\[1, 6, 8\]"):
        rope(q, k, cos[..., :8], sin[..., :8])
    with pytest.raises(ValueError, match=r"cos and sin must have one shape"):
        rope(q, k, cos, sin[:, :3])
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])
    with pytest.raises(TypeError, match=r"one dtype, got q torch.float32, k torch.float16"):
        rope(q, k.half(), cos, sin)
    with pytest.raises(TypeError, match="q has dtype torch.int64"):
        rope(q.long(), k, cos, sin)


def test_gradient_for_cos_sin_falls_back_to_the_reference(device):
    if device.type not in ("cuda",):
        pytest.skip("only the Triton implementation refuses cos/sin gradients (it is chosen on cuda)")
    q, k = torch.randn(1, 2, 3, 8, device=device), torch.randn(1, 1, 3, 8, device=device)
    cos = torch.randn(1, 3, 8, device=device, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="gradients with respect to cos and sin"):
        out_q, _ = torchport.kernels.rope(q, k, cos, torch.randn(1, 3, 8, device=device))
    out_q.sum().backward()
    assert cos.grad is not None


def _angles(batch: int, seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = _cos_sin(batch, seq, dim, torch.Generator().manual_seed(9))
    return cos.float(), sin.float()


def test_npu_scaled_cos_sin_take_the_reference(npu):
    """YaRN and LongRoPE multiply cos/sin by an attention scaling above 1; torch_npu.npu_rotary_mul takes them
    within [-1, 1] only: those calls take the reference (one warning), the others stay fused."""
    from torchport.kernels import registry
    from torchport.testing import npu_fused_ops

    registry.refresh()  # each reason is warned once per process
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8)
    cos, sin = _angles(1, 5, 8)
    scaled = (cos * 1.2, sin * 1.2)
    with on_chip("Ascend910B3"):
        calls = npu_fused_ops.calls["npu_rotary_mul"]
        torchport.kernels.rope(q.to(npu), k.to(npu), cos.to(npu), sin.to(npu))
        assert npu_fused_ops.calls["npu_rotary_mul"] == calls + 2
        with pytest.warns(RuntimeWarning, match=r"npu_rotary_mul takes cos/sin within \[-1, 1\]; these exceed it"):
            out = torchport.kernels.rope(q.to(npu), k.to(npu), scaled[0].to(npu), scaled[1].to(npu))
        assert npu_fused_ops.calls["npu_rotary_mul"] == calls + 2
        with pytest.raises(RuntimeError, match=r"r1 must lie in \[-1.0, 1.0\]"):
            npu_fused_ops.npu_rotary_mul(q.to(npu), scaled[0].unsqueeze(1).to(npu), scaled[1].unsqueeze(1).to(npu))
    for got, want in zip(out, rope_reference(q.double(), k.double(), scaled[0].double(), scaled[1].double())):
        check_close("rotated", got, want, torch.float32)


def test_npu_head_dims_beyond_the_operator_take_the_reference(npu):
    from torchport.kernels import registry
    from torchport.testing import npu_fused_ops

    registry.refresh()  # each reason is warned once per process
    calls = npu_fused_ops.calls["npu_rotary_mul"]
    q = torch.randn(1, 1, 2, 896)
    cos, sin = _angles(1, 2, 896)
    with pytest.warns(RuntimeWarning, match="npu_rotary_mul takes head_dim below 896, not 896"):
        out, _ = torchport.kernels.rope(q.to(npu), q.to(npu), cos.to(npu), sin.to(npu))
    check_close("q", out, rope_reference(q.double(), q.double(), cos.double(), sin.double())[0], torch.float32)
    with on_chip("Ascend910A"):  # its compiled kernel: head_dim 128, cos/sin of batch 1
        q, k = torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 128)
        with pytest.warns(RuntimeWarning, match="npu_rotary_mul on Ascend910A takes head_dim 128"):
            torchport.kernels.rope(q.to(npu), q.to(npu), *(t.to(npu) for t in _angles(1, 3, 64)))
        torchport.kernels.rope(k.to(npu), k.to(npu), *(t.to(npu) for t in _angles(1, 3, 128)))
    assert npu_fused_ops.calls["npu_rotary_mul"] == calls + 2
