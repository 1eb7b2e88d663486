"""The peers of ``bench_kernels.py``: each op as Hugging Face modeling code writes it in eager PyTorch, and
liger-kernel's autograd Function for it (0.8.5 signatures)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # LlamaRMSNorm.forward: statistics in float32, cast back before the weight
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * h.to(dtype)


def layer_norm_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, 1e-5)


def swiglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_eager(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # apply_rotary_pos_emb with unsqueeze_dim=1: cos, sin [batch, seq, dim] broadcast over heads
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def cross_entropy_eager(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # transformers' ForCausalLMLoss: upcast the logits, then F.cross_entropy with ignore_index=-100
    return F.cross_entropy(logits.float(), target, ignore_index=-100)


def linear_cross_entropy_eager(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=-100)


def liger(op: str) -> Callable:
    """liger-kernel's autograd Function for ``op`` (0.8.5 signatures; apply() takes positional arguments only)."""
    if op == "rms_norm":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # liger's defaults, as its LigerRMSNorm module uses them: casting_mode="llama", in_place=True (dx into dy)
        return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", True)
    if op == "layer_norm":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
    if op == "swiglu":
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply  # backward writes da, db into a, b
    if op == "geglu":
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        return LigerGELUMulFunction.apply  # backward writes da, db into a, b
    if op == "rope":
        from liger_kernel.ops.rope import LigerRopeFunction

        return LigerRopeFunction.apply
    if op == "cross_entropy":
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, ...) -> 4-tuple;
        # it writes the gradient into the logits
        return lambda logits, t: LigerCrossEntropyFunction.apply(logits, t, None, -100, 0.0, 0.0, "mean")[0]
    if op == "fused_linear_cross_entropy":
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, ...)
        return lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(h, w, t, None, None, -100, 0.0, 0.0,
                                                                          "mean")[0]
    raise ValueError(f"liger-kernel has no {op}")


def cce(op: str) -> Callable:
    """Apple's cut-cross-entropy (``cut_cross_entropy.linear_cross_entropy``, its default ``cce`` kernels) for the
    linear + cross-entropy op."""
    if op != "fused_linear_cross_entropy":
        raise ValueError(f"cut-cross-entropy has no {op}")
    from cut_cross_entropy import linear_cross_entropy

    return lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=-100, reduction="mean").float()
