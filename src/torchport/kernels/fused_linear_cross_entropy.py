"""Cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising the logits: the LM head and its loss in one.

The tokens are processed in chunks. For each chunk the forward computes the chunk's logits with one matmul, gets
the per-row losses and ``d loss / d logits`` from the cross-entropy kernel of the device (written over the chunk's
logits, a temporary nobody else holds), and turns them into ``grad_hidden`` for those rows
(``dlogits @ weight``) and a contribution to ``grad_weight`` (``dlogits.T @ hidden``) and ``grad_bias``, which
accumulate across chunks in float32. The backward then only multiplies by the upstream gradient.

Memory, for N tokens, hidden size H, vocabulary V, s bytes per element: one chunk of logits (C·V·s, and the
reference CE math's float32 temporaries of C·V·4 off CUDA), ``grad_hidden`` (N·H·s), the float32 weight-gradient
accumulator (V·H·4, plus the V·H·s cast to the weight's dtype at the end) and the bias one (V·4) — instead of
N·V logits, their float32 copy and their gradient. The chunk holds ``CHUNK_BYTES // (4·V)`` tokens (rounded
down to a multiple of 64): 512 tokens (128 MiB of bf16 logits) for V = 128256; a larger chunk barely speeds up
the matmuls (8192 tokens, 4096 → 128256: three matmuls of 8.6 TFLOP each dominate) while memory grows linearly.

``reduction="none"`` cannot fold the upstream gradient into the weight gradient in the forward (each row has its
own), so its forward computes losses only and its backward recomputes each chunk's logits (one more matmul).

``num_items_in_batch`` (Hugging Face Trainer's gradient-accumulation convention): the loss is the *sum* over the
non-ignored tokens of this micro-batch divided by ``num_items_in_batch`` — exactly
``F.cross_entropy(logits, target, reduction="sum") / num_items_in_batch`` — so micro-batch losses add up to the
mean over the whole accumulated batch.

Implementations: ``triton`` (CUDA/ROCm: the chunks use the Triton cross-entropy kernel), ``npu`` and ``chunked``
(the same chunked PyTorch with the reference cross-entropy math per chunk: Ascend has no fused
linear-cross-entropy operator, and torch_npu's ``npu_cross_entropy_loss`` returns log-probabilities for its own
backward rather than the gradient), and the ``reference``: the full logits, then ``F.cross_entropy``.
``chunked`` serves every other device in auto mode; ``TORCHPORT_KERNELS`` can force ``reference``, ``triton``
(CUDA) or ``npu`` (Ascend), the modes every op shares.

Example:
    >>> loss = torchport.kernels.fused_linear_cross_entropy(hidden_states, lm_head.weight, labels)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import registry
from .checks import check_floating, check_same_device, check_same_dtype, widen
from .cross_entropy import (
    check_options, check_target_tensor, check_targets, loss_and_grad_reference,
)

__all__ = ["CHUNK_BYTES", "FusedLinearCrossEntropyLoss", "chunk_tokens", "fused_linear_cross_entropy"]

CHUNK_BYTES = 256 * 2**20  # a chunk's logits in float32 stay under this


def chunk_tokens(n: int, vocab: int) -> int:
    """Tokens per chunk for ``n`` tokens and a vocabulary of ``vocab`` (see the module docstring)."""
    tokens = max(1, CHUNK_BYTES // (4 * max(vocab, 1)))
    if tokens >= 64:
        tokens -= tokens % 64
    return max(1, min(n, tokens))


@registry.register_kernel("fused_linear_cross_entropy", "reference")
def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                                         label_smoothing: float = 0.0, reduction: str = "mean",
                                         divisor: float | None = None, n_valid: int | None = None) -> torch.Tensor:
    """``F.linear`` then ``F.cross_entropy`` in float32 (float64 for float64 inputs), on ``[N, H]`` hidden states;
    a mean over no rows is 0, and ``divisor`` replaces the mean's row count."""
    logits = widen(F.linear(hidden, weight, bias))
    if reduction == "none":
        return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction="none").to(hidden.dtype)
    total = F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                            reduction="sum")
    if divisor is not None:
        total = total / divisor
    elif reduction == "mean":
        total = total / (target != ignore_index).sum().clamp_min(1)
    return total.to(hidden.dtype)


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in float32: straight into it where the device's matmul can write float32 from
    16-bit inputs (no weight-sized temporary), else through a product in the inputs' dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if _OUT_DTYPE_WORKS.get(acc.device.type, True):
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, NotImplementedError, TypeError):
            _OUT_DTYPE_WORKS[acc.device.type] = False
    acc.add_(a @ b)


_OUT_DTYPE_WORKS: dict[str, bool] = {}  # device type -> whether addmm(out_dtype=float32) runs there


class _ChunkedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str, scale: float,
                loss_and_grad: Callable[..., torch.Tensor]) -> torch.Tensor:
        n = hidden.shape[0]
        chunk = chunk_tokens(n, weight.shape[0])
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        want_b = want_b and bias is not None
        grads_now = reduction != "none" and (want_h or want_w or want_b)
        rows = torch.empty(n, dtype=torch.float32 if hidden.dtype != torch.float64 else torch.float64,
                           device=hidden.device)
        grad_h = torch.empty_like(hidden) if grads_now and want_h else None
        grad_w = torch.zeros(weight.shape, dtype=_accumulator(weight), device=weight.device) if grads_now and want_w \
            else None
        grad_b = torch.zeros(bias.shape, dtype=_accumulator(bias), device=bias.device) if grads_now and want_b \
            else None
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            h = hidden[start:end]
            logits = F.linear(h, weight, bias)
            rows[start:end] = loss_and_grad(logits, target[start:end], ignore_index, label_smoothing, 0.0, scale,
                                            logits if grads_now else None)
            if grads_now:
                _chunk_grads(logits, h, weight, grad_h, grad_w, grad_b, start, end)
        ctx.args = (ignore_index, label_smoothing, reduction, loss_and_grad, weight.dtype,
                    None if bias is None else bias.dtype, (want_h, want_w, want_b))
        ctx.used = False
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, target)
            return rows.to(hidden.dtype)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return (rows.sum() * scale).to(hidden.dtype)

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple[Any, ...]:
        if ctx.used:
            raise RuntimeError(
                "fused_linear_cross_entropy: the gradients are computed in the forward and handed over by the first "
                "backward; a second backward through the same loss (retain_graph=True) is not supported"
            )
        ctx.used = True
        ignore_index, label_smoothing, reduction, loss_and_grad, w_dtype, b_dtype, wanted = ctx.args
        if reduction == "none":
            grad_h, grad_w, grad_b = _recompute(ctx.saved_tensors, dloss, ignore_index, label_smoothing,
                                                loss_and_grad, wanted)
        else:
            grad_h, grad_w, grad_b = ctx.saved_tensors
            for g in (grad_h, grad_w, grad_b):
                if g is not None:
                    g.mul_(dloss.to(g.dtype))
        # New views (or casts) of our own buffers: autograd hands them on without copying.
        return (None if grad_h is None else grad_h.view(grad_h.shape),
                None if grad_w is None else grad_w.to(w_dtype).view(grad_w.shape),
                None if grad_b is None else grad_b.to(b_dtype).view(grad_b.shape),
                None, None, None, None, None, None)


def _accumulator(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chunk_grads(dlogits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, grad_h: torch.Tensor | None,
                 grad_w: torch.Tensor | None, grad_b: torch.Tensor | None, start: int, end: int) -> None:
    if grad_h is not None:
        torch.mm(dlogits, weight, out=grad_h[start:end])
    if grad_w is not None:
        _add_product(grad_w, dlogits.t(), h)
    if grad_b is not None:
        grad_b.add_(dlogits.sum(0, dtype=grad_b.dtype))


def _recompute(saved: tuple[torch.Tensor, ...], dloss: torch.Tensor, ignore_index: int, label_smoothing: float,
               loss_and_grad: Callable[..., torch.Tensor],
               wanted: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``sum(dloss · loss_rows)`` for ``reduction="none"``: each chunk's logits again, their gradient
    scaled row by row, then the same products as the forward of the other reductions."""
    hidden, weight, bias, target = saved
    want_h, want_w, want_b = wanted
    grad_h = torch.empty_like(hidden) if want_h else None
    grad_w = torch.zeros(weight.shape, dtype=_accumulator(weight), device=weight.device) if want_w else None
    grad_b = torch.zeros(bias.shape, dtype=_accumulator(bias), device=bias.device) if want_b else None
    n = hidden.shape[0]
    chunk = chunk_tokens(n, weight.shape[0])
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        h = hidden[start:end]
        logits = F.linear(h, weight, bias)
        loss_and_grad(logits, target[start:end], ignore_index, label_smoothing, 0.0, 1.0, logits)
        logits.mul_(dloss[start:end].to(logits.dtype).unsqueeze(-1))
        _chunk_grads(logits, h, weight, grad_h, grad_w, grad_b, start, end)
    return grad_h, grad_w, grad_b


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
             ignore_index: int, label_smoothing: float, reduction: str, divisor: float | None, n_valid: int | None,
             loss_and_grad: Callable[..., torch.Tensor]) -> torch.Tensor:
    if n_valid is None:
        n_valid = int((target != ignore_index).sum())
    if divisor is not None:
        scale = 1.0 / divisor
    else:
        scale = 1.0 / max(n_valid, 1) if reduction == "mean" else 1.0
    return _ChunkedFunction.apply(hidden, weight, bias, target, ignore_index, label_smoothing, reduction, scale,
                                  loss_and_grad)


@registry.register_kernel("fused_linear_cross_entropy", "chunked", priority=10)
def _fused_linear_cross_entropy_chunked(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                        bias: torch.Tensor | None = None, ignore_index: int = -100,
                                        label_smoothing: float = 0.0, reduction: str = "mean",
                                        divisor: float | None = None, n_valid: int | None = None) -> torch.Tensor:
    return _chunked(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor, n_valid,
                    loss_and_grad_reference)


@registry.register_kernel("fused_linear_cross_entropy", "npu", devices=["npu"], priority=15)
def _fused_linear_cross_entropy_npu(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                    bias: torch.Tensor | None = None, ignore_index: int = -100,
                                    label_smoothing: float = 0.0, reduction: str = "mean",
                                    divisor: float | None = None, n_valid: int | None = None) -> torch.Tensor:
    # The chunked PyTorch implementation: there is no fused operator to call (see the module docstring).
    return _chunked(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor, n_valid,
                    loss_and_grad_reference)


@registry.register_kernel("fused_linear_cross_entropy", "triton", devices=["cuda"], priority=20)
def _fused_linear_cross_entropy_triton(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                       bias: torch.Tensor | None = None, ignore_index: int = -100,
                                       label_smoothing: float = 0.0, reduction: str = "mean",
                                       divisor: float | None = None, n_valid: int | None = None) -> torch.Tensor:
    from .triton import cross_entropy as kernel

    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise registry.Unsupported(f"the Triton kernel takes float32, bfloat16 or float16, not {hidden.dtype}")
    return _chunked(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor, n_valid,
                    kernel.loss_and_grad)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean", *,
                               num_items_in_batch: int | float | torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``target``, computed chunk by chunk.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` hidden states (float32, bfloat16 or float16).
        weight: ``[V, H]``, the LM head's weight, of hidden's dtype.
        target: integer class indices with hidden's leading shape.
        bias: optional ``[V]``.
        ignore_index, label_smoothing: as ``F.cross_entropy``.
        reduction: ``"mean"`` (over non-ignored tokens; 0 when all are ignored), ``"sum"`` or ``"none"``.
        num_items_in_batch: when given (Hugging Face Trainer under gradient accumulation), the loss is the sum
            over this call's tokens divided by it, whatever ``reduction`` (``"mean"`` or ``"sum"``) says.

    Returns:
        A scalar in hidden's dtype, or for ``"none"`` the per-token losses with ``target``'s shape.

    Example:
        >>> h, w = torch.randn(4, 16, 64, requires_grad=True), torch.randn(1000, 64, requires_grad=True)
        >>> loss = fused_linear_cross_entropy(h, w, torch.randint(0, 1000, (4, 16)))
        >>> loss.backward()
    """
    op = "fused_linear_cross_entropy"
    check_floating(op, hidden=hidden, weight=weight, bias=bias)
    check_same_dtype(op, hidden=hidden, weight=weight, bias=bias)
    if hidden.dim() < 2:
        raise ValueError(f"{op}: hidden must be [N, H] or [B, T, H], got shape {list(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"{op}: weight must have shape [vocab, hidden] = [V, {hidden.shape[-1]}] for hidden of shape "
            f"{list(hidden.shape)}, got weight of shape {list(weight.shape)}"
        )
    vocab = weight.shape[0]
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"{op}: bias must have shape [vocab] = [{vocab}], got {list(bias.shape)}")
    target = check_target_tensor(op, target, hidden.shape[:-1], "hidden's shape without the hidden dim")
    check_same_device(op, hidden=hidden, weight=weight, bias=bias, target=target)
    check_options(op, label_smoothing, reduction)
    divisor = None
    if num_items_in_batch is not None:
        if reduction == "none":
            raise ValueError(f"{op}: num_items_in_batch divides a summed loss; it cannot be used with reduction='none'")
        divisor = float(num_items_in_batch)
        if not divisor > 0:
            raise ValueError(f"{op}: num_items_in_batch must be > 0, got {num_items_in_batch}")
    rows, flat = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    n_valid = check_targets(op, flat, vocab, ignore_index)
    loss = registry.call(op, hidden.device, rows, weight, flat, bias, int(ignore_index), float(label_smoothing),
                         reduction, divisor, n_valid)
    return loss.view(target.shape) if reduction == "none" else loss


class FusedLinearCrossEntropyLoss(nn.Module):
    """``nn.Module`` form of :func:`fused_linear_cross_entropy`: ``forward(hidden, weight, target, bias=None)``.

    Example:
        >>> criterion = FusedLinearCrossEntropyLoss(ignore_index=-100)
        >>> loss = criterion(hidden_states, model.lm_head.weight, labels)
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean") -> None:
        super().__init__()
        check_options("FusedLinearCrossEntropyLoss", label_smoothing, reduction)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, *,
                num_items_in_batch: int | float | torch.Tensor | None = None) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden, weight, target, bias, self.ignore_index, self.label_smoothing,
                                          self.reduction, num_items_in_batch=num_items_in_batch)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, reduction={self.reduction!r}"
