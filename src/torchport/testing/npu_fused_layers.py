"""torch_npu's fused layers on the simulated NPU: RMSNorm, rotary embedding, SwiGLU, GELU and cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .npu_fused_contract import chip_family, dtype_name, start

__all__ = ["npu_cross_entropy_loss", "npu_gelu", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"]


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: normalised over gamma's dims, y in self's dtype, rstd float32 with those dims kept as 1."""
    limits = start("npu_rms_norm")
    low, high = limits["input_dims"]
    if not low <= self.dim() <= high:
        raise RuntimeError(f"npu_rms_norm: self must have {low} to {high} dims, got {list(self.shape)}")
    if gamma.dim() > self.dim() or tuple(gamma.shape) != tuple(self.shape[self.dim() - gamma.dim():]):
        raise RuntimeError(f"npu_rms_norm: gamma {list(gamma.shape)} must be the trailing dims of self "
                           f"{list(self.shape)}")
    family = chip_family()
    pairs = [tuple(pair) for pair in limits["dtype_pairs"].get(family, [])]
    if (dtype_name(self), dtype_name(gamma)) not in pairs:
        raise RuntimeError(f"npu_rms_norm: (self, gamma) dtypes ({dtype_name(self)}, {dtype_name(gamma)}) are not "
                           f"supported on {family}; supported: {pairs}")
    least = limits["min_last_dim_bytes"].get(family)
    if least is not None and self.shape[-1] * self.element_size() < least:
        raise RuntimeError(f"npu_rms_norm: on {family} the last dim must hold at least {least} bytes, got "
                           f"{self.shape[-1]} x {self.element_size()}")
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    h = self.float()
    rstd = torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + epsilon)
    return (h * rstd * gamma.float()).to(self.dtype), rstd.detach()


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half",
                   rotate: torch.Tensor | None = None) -> torch.Tensor:
    """``self·r1 + rotate(self)·r2``, r1/r2 broadcast to self; rotate halves (``"half"``) or pairs
    (``"interleave"``)."""
    limits = start("npu_rotary_mul")
    low, high = limits["input_dims"]
    if rotate is not None:
        raise RuntimeError("npu_rotary_mul: the rotate matrix is not simulated by torchport.testing")
    if rotary_mode not in limits["rotary_modes"]:
        raise RuntimeError(f"npu_rotary_mul: rotary_mode {rotary_mode!r} is not one of {limits['rotary_modes']}")
    if not low <= self.dim() <= high or r1.dim() != self.dim() or r2.shape != r1.shape:
        raise RuntimeError(f"npu_rotary_mul: self, r1 and r2 must have {low} or {high} dims, r1 and r2 one shape; "
                           f"got {list(self.shape)}, {list(r1.shape)}, {list(r2.shape)}")
    head_dim = self.shape[-1]
    if head_dim % limits["head_dim_multiple"] or head_dim >= limits["head_dim_below"]:
        raise RuntimeError(f"npu_rotary_mul: the last dim must be even and below {limits['head_dim_below']}, "
                           f"got {head_dim}")
    if self.dim() == 4 and (self.shape[0] >= limits["batch_below"] or self.shape[1] >= limits["heads_below"]):
        raise RuntimeError(f"npu_rotary_mul: B and N must be below {limits['batch_below']}, got {list(self.shape)}")
    if chip_family() in limits["compiled_kernel_families"]:
        kernel = limits["compiled_kernel"]
        if (self.dim() != kernel["input_dims"] or head_dim != kernel["head_dim"] or r1.shape[0] != kernel["r_batch"]
                or rotary_mode not in kernel["rotary_modes"] or self.shape[0] > kernel["batch_max"]
                or self.shape[1] > kernel["heads_max"]):
            raise RuntimeError(f"npu_rotary_mul: on {chip_family()} it takes 4-D input with D = {kernel['head_dim']}, "
                               f"r1/r2 of batch {kernel['r_batch']} and the half mode; got {list(self.shape)}, "
                               f"{list(r1.shape)}, {rotary_mode!r}")
    low_r, high_r = limits["r_range"]
    for name, r in (("r1", r1), ("r2", r2)):
        if r.numel() and not bool(((r >= low_r) & (r <= high_r)).all()):
            raise RuntimeError(f"npu_rotary_mul: {name} must lie in [{low_r}, {high_r}] (torch_npu documents that "
                               "range; outside it the result is not specified)")
    if rotary_mode == "half":
        half = head_dim // 2
        rotated = torch.cat((-self[..., half:], self[..., :half]), dim=-1)
    else:
        pairs = self.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return self * r1 + rotated * r2


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(a)·b`` where ``a, b = self.chunk(2, dim)``."""
    limits = start("npu_swiglu")
    low, high = limits["input_dims"]
    if not low <= self.dim() <= high or self.numel() == 0 or not self.is_contiguous():
        raise RuntimeError(f"npu_swiglu: self must be a contiguous, non-empty tensor of {low} to {high} dims, got "
                           f"{list(self.shape)} (contiguous: {self.is_contiguous()})")
    if self.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu: dim {dim} of {list(self.shape)} does not split in two halves")
    a, b = self.chunk(2, dim=dim)
    return (F.silu(a.float()) * b.float()).to(self.dtype)


def npu_gelu(self: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    limits = start("npu_gelu")
    if approximate not in limits["approximate"]:
        raise RuntimeError(f"npu_gelu: approximate {approximate!r} is not one of {limits['approximate']}")
    return F.gelu(self, approximate=approximate)


def npu_cross_entropy_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                           reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                           lse_square_scale_for_zloss: float = 0.0,
                           return_zloss: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, log_prob, zloss, lse_for_zloss)``.

    Contract (torch_npu documentation): input ``[N, C]`` fp16/bf16/fp32 with 0 < N <= 200000; target int64 in
    ``[0, C)``; ignore_index < C, a negative one ignoring nothing; loss in input's dtype (``[N]`` for "none", else
    one element); log_prob ``[N, C]``; z-loss documented as not supported yet (its outputs are empty). When input
    requires grad, "sum" and "none" take only the default label_smoothing, and "mean" only the defaults of weight,
    ignore_index and label_smoothing.
    """
    limits = start("npu_cross_entropy_loss")
    low, high = limits["rows"]
    if input.dim() != 2 or not low <= input.shape[0] <= high:
        raise RuntimeError(f"npu_cross_entropy_loss: input must be [N, C] with {low} <= N <= {high}, got "
                           f"{list(input.shape)}")
    if target.dtype != torch.int64 or target.shape != input.shape[:1]:
        raise RuntimeError("npu_cross_entropy_loss: target must be int64 of shape [N]")
    if ((target < 0) | (target >= input.shape[1])).any():
        raise RuntimeError("npu_cross_entropy_loss: target values must lie in [0, C)")
    if reduction not in limits["reductions"]:
        raise RuntimeError(f"npu_cross_entropy_loss: reduction {reduction!r} is not one of {limits['reductions']}")
    if lse_square_scale_for_zloss or return_zloss:
        raise RuntimeError("npu_cross_entropy_loss: z-loss is not supported")
    if input.requires_grad and torch.is_grad_enabled():
        given = {"weight": weight is not None, "ignore_index": ignore_index != -100,
                 "label_smoothing": label_smoothing != 0.0}
        refused = [name for name in limits["defaults_only_when_input_requires_grad"][reduction] if given[name]]
        if refused:
            raise RuntimeError(f"npu_cross_entropy_loss: when input requires grad, reduction={reduction!r} takes only "
                               f"the default {', '.join(refused)}")
    log_prob = torch.log_softmax(input.float(), dim=-1)
    loss = F.nll_loss(log_prob, target, weight, ignore_index=ignore_index if ignore_index >= 0 else -(2**62),
                      reduction=reduction)
    if label_smoothing:
        smooth = -log_prob.mean(-1)
        if ignore_index >= 0:
            smooth = torch.where(target == ignore_index, torch.zeros_like(smooth), smooth)
        smooth = smooth if reduction == "none" else smooth.sum() if reduction == "sum" else smooth.mean()
        loss = (1 - label_smoothing) * loss + label_smoothing * smooth
    loss = loss.to(input.dtype)
    if reduction != "none":
        loss = loss.reshape(1)
    empty = input.new_empty(0)
    return loss, log_prob.detach().to(input.dtype), empty, empty
