"""The fused linear cross-entropy's per-slice steps in PyTorch (every device without Triton: the ``chunked`` and
``npu`` implementations), with the signatures of the Triton kernels in
:mod:`torchport.kernels.triton.linear_ce_slices`; :mod:`torchport.kernels.linear_ce_passes` runs the passes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["TORCH_MATH", "SliceMath", "scale_rows_torch"]


class SliceMath(NamedTuple):
    """The per-slice element-wise steps, in Triton or in PyTorch (signatures of the Triton module's functions);
    ``scale_rows(t, factor)``: ``t[i] *= factor[i]``, for the accumulator's rescaling (Triton's skips rows whose
    factor is exactly 1, which most rows' is). ``whole_rows(x, target, ignore_index, label_smoothing, z_loss,
    scale)``, where there is one: whole rows of logits without soft-capping in one step, returning each row's loss
    (float32) and overwriting ``x`` with ``scale · d loss_row / d logits`` (``scale`` a float, or a float32 tensor of
    one element read on the device); without it, ``stats`` and then ``grad`` on the whole row do the same."""

    stats: Callable[..., None]
    grad: Callable[..., None]
    scale_rows: Callable[[torch.Tensor, torch.Tensor], None]
    whole_rows: Callable[..., torch.Tensor] | None = None


def _row_chunks(x: torch.Tensor, copies: int) -> range:
    """Row starts for the PyTorch steps, so that ``copies`` float32 temporaries of a chunk of ``x`` stay within half
    of ``x``'s own bytes (on an NPU the workspace is device memory too)."""
    rows, width = x.shape
    step = max(1, x.element_size() * rows // (2 * 4 * copies))
    return range(0, rows, step)


def _stats_torch(x: torch.Tensor, target: torch.Tensor, v0: int, state: tuple[torch.Tensor, ...],
                 alpha: torch.Tensor, ignore_index: int, softcap: float | None, margin: float, want_p: bool,
                 slope_out: torch.Tensor | None) -> None:
    chunks = _row_chunks(x, 1 if softcap is None else 2)
    for r in chunks:
        sl = slice(r, r + chunks.step)
        _stats_rows(x[sl], target[sl], v0, tuple(v[sl] for v in state), alpha[sl], ignore_index, softcap, margin,
                    want_p, None if slope_out is None else slope_out[sl])


def _stats_rows(x: torch.Tensor, target: torch.Tensor, v0: int, state: tuple[torch.Tensor, ...],
                alpha: torch.Tensor, ignore_index: int, softcap: float | None, margin: float, want_p: bool,
                slope_out: torch.Tensor | None) -> None:
    m, d, x_t, total = state
    width = x.shape[1]
    y = x.to(m.dtype, copy=True)
    if softcap is not None:
        y.div_(softcap).tanh_().mul_(softcap)
    valid = target != ignore_index
    top = y.amax(1) if width else torch.full_like(m, -math.inf)
    m_new = torch.where(valid & (top > m + margin), top, m)
    alpha.copy_(torch.where(m == -math.inf, torch.ones_like(m), torch.exp(m - m_new)))
    local = target - v0
    inside = valid & (local >= 0) & (local < width)
    if width:
        x_t.copy_(torch.where(inside, y.gather(1, local.clamp(0, width - 1).unsqueeze(1)).squeeze(1), x_t))
    total.add_(torch.where(valid, y.sum(1), torch.zeros_like(total)))
    slope = None
    if softcap is not None:
        slope = torch.square(y / softcap).neg_().add_(1.0).masked_fill_(~valid.unsqueeze(1), 0.0)
    # in place: exp(y - m); an ignored row's maximum is -inf, so its values are inf until masked
    e = y.sub_(m_new.unsqueeze(1)).exp_().masked_fill_(~valid.unsqueeze(1), 0.0)
    d.copy_(torch.where(valid, d * alpha + e.sum(1), d))
    m.copy_(m_new)
    if want_p:
        x.copy_(e if slope is None else e.mul_(slope))
    if slope_out is not None:
        slope_out.copy_(slope)


def _grad_torch(x: torch.Tensor, target: torch.Tensor, v0: int, vocab: int, lse: torch.Tensor, scale: torch.Tensor,
                label_smoothing: float, z_loss: float, softcap: float | None) -> None:
    chunks = _row_chunks(x, 1 if softcap is None else 2)
    for r in chunks:
        sl = slice(r, r + chunks.step)
        _grad_rows(x[sl], target[sl], v0, vocab, lse[sl], scale[sl], label_smoothing, z_loss, softcap)


def _grad_rows(x: torch.Tensor, target: torch.Tensor, v0: int, vocab: int, lse: torch.Tensor, scale: torch.Tensor,
               label_smoothing: float, z_loss: float, softcap: float | None) -> None:
    width = x.shape[1]
    g = x.to(lse.dtype, copy=True)
    slope = None
    if softcap is not None:
        g.div_(softcap).tanh_()
        slope = torch.square(g).neg_().add_(1.0)
        g.mul_(softcap)
    g.sub_(lse.unsqueeze(1)).exp_()
    if z_loss:
        g.mul_((1.0 + 2.0 * z_loss * lse).unsqueeze(1))
    if label_smoothing:
        g.sub_(label_smoothing / vocab)
    local = target - v0
    inside = (local >= 0) & (local < width)
    if width:
        g.scatter_add_(1, local.clamp(0, width - 1).unsqueeze(1),
                       (inside.to(g.dtype) * (label_smoothing - 1.0)).unsqueeze(1))  # in g's precision
    if slope is not None:
        g.mul_(slope)
    # masked, not only multiplied: rows with scale 0 (ignored targets) are 0 even where their exp() overflowed
    g.mul_(scale.unsqueeze(1)).masked_fill_((scale == 0).unsqueeze(1), 0.0)
    x.copy_(g)


def scale_rows_torch(t: torch.Tensor, factor: torch.Tensor) -> None:
    t.mul_(factor.unsqueeze(1))


TORCH_MATH = SliceMath(_stats_torch, _grad_torch, scale_rows_torch)
