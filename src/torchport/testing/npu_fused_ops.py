"""torch_npu's fused operators for the simulated NPU, with torch_npu's names, signatures and results.

They compute with ordinary PyTorch ops on the simulated device (so autograd works as with torch_npu, whose fused
operators have backward kernels), and count their calls, so tests can check that a kernel took the fused path.
Contracts, from torch_npu's documentation:

* ``npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)``: normalised over gamma's dims, y in x's dtype, rstd float32
  with those dims kept as 1.
* ``npu_rotary_mul(x, r1, r2) -> x·r1 + rotate_half(x)·r2``, r1/r2 broadcast to x.
* ``npu_swiglu(x, dim=-1) -> silu(a)·b`` where ``a, b = x.chunk(2, dim)``.
* ``npu_gelu(x, approximate="none")``.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["OPS", "calls", "enabled", "lookup", "only"]

calls: collections.Counter[str] = collections.Counter()


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    calls["npu_rms_norm"] += 1
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + epsilon)
    return (h * rstd * gamma.float()).to(x.dtype), rstd


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    calls["npu_rotary_mul"] += 1
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * r1 + rotated * r2


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    calls["npu_swiglu"] += 1
    a, b = x.chunk(2, dim=dim)
    return (F.silu(a.float()) * b.float()).to(x.dtype)


def npu_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    calls["npu_gelu"] += 1
    return F.gelu(x, approximate=approximate)


OPS: dict[str, Callable[..., Any]] = {
    fn.__name__: fn for fn in (npu_rms_norm, npu_rotary_mul, npu_swiglu, npu_gelu)
}
enabled: set[str] = set(OPS)


def lookup(name: str) -> Callable[..., Any] | None:
    """The operator ``name`` if the simulated software stack has it now."""
    return OPS.get(name) if name in enabled else None


@contextlib.contextmanager
def only(names: Iterable[str]) -> Iterator[None]:
    """Simulate a torch_npu release that has only the operators ``names`` (e.g. ``()`` for none) in a block."""
    names = set(names)
    unknown = names - set(OPS)
    if unknown:
        raise ValueError(f"no simulated fused operator(s) {sorted(unknown)}; simulated: {', '.join(OPS)}")
    saved = set(enabled)
    enabled.clear()
    enabled.update(names)
    try:
        yield
    finally:
        enabled.clear()
        enabled.update(saved)


def npu_cross_entropy_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                           reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                           lse_square_scale_for_zloss: float = 0.0,
                           return_zloss: bool = False) -> tuple[torch.Tensor, ...]:
    """``torch_npu.npu_cross_entropy_loss`` -> ``(loss, log_prob, zloss, lse_for_zloss)``.

    Contract (torch_npu documentation): input ``[N, C]`` fp16/bf16/fp32 with 0 < N <= 200000; target int64 in
    ``[0, C)``; ignore_index < C, a negative one ignoring nothing; loss in input's dtype (``[N]`` for "none", else
    one element); log_prob ``[N, C]``; z-loss documented as not supported yet (its outputs are empty).
    """
    calls["npu_cross_entropy_loss"] += 1
    if input.dim() != 2 or not 0 < input.shape[0] <= 200_000:
        raise RuntimeError(f"npu_cross_entropy_loss: input must be [N, C] with 0 < N <= 200000, got {list(input.shape)}")
    if target.dtype != torch.int64 or target.shape != input.shape[:1]:
        raise RuntimeError("npu_cross_entropy_loss: target must be int64 of shape [N]")
    if ((target < 0) | (target >= input.shape[1])).any():
        raise RuntimeError("npu_cross_entropy_loss: target values must lie in [0, C)")
    if lse_square_scale_for_zloss or return_zloss:
        raise RuntimeError("npu_cross_entropy_loss: z-loss is not supported")
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
    return loss, log_prob.to(input.dtype), empty, empty


OPS[npu_cross_entropy_loss.__name__] = npu_cross_entropy_loss
enabled.add(npu_cross_entropy_loss.__name__)
