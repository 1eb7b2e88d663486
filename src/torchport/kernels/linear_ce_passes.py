"""The passes of :func:`torchport.kernels.fused_linear_cross_entropy`: the LM head's matmul and its cross-entropy
in pieces of at most a *workspace* of logits, with the per-slice element-wise steps in Triton or in PyTorch. Two
strategies, chosen per call (:func:`~torchport.kernels.linear_ce_plan.row_chunk`; the workspaces, block sizes and
chunk sizes are worked out in :mod:`torchport.kernels.linear_ce_plan`):

**Whole rows** (when the weight's gradient is wanted, the reduction is a mean or a sum, the inputs are not float16,
and the N tokens split into at most ``MAX_ROW_CHUNKS`` chunks of whole rows within ``rows_workspace_bytes()``:
``TORCHPORT_LOSS_WORKSPACE_MIB``, by default ``ROWS_WORKSPACE_BYTES``, 256 MiB, 1024 tokens of a 128256-word
vocabulary in bf16). For each chunk of tokens: its logits ``h_c @ W.T``, one
kernel that turns them into the loss per row and, in place, ``d loss / d logits`` (with soft-capping, the two
passes' slice kernels on a slice that is the whole row); then ``grad_hidden[c] = dlogits @ W`` (when wanted) and
``grad_weight += dlogits.T @ h_c``. Three matmuls of 2·N·H·V FLOPs, as the unfused op (two for frozen hidden
states); the price is that ``grad_weight`` is summed over the chunks in its own dtype (a read-modify-write of V x H
per chunk after the first, which cuBLAS mostly hides, and one rounding per chunk in bf16: measured 1.19x the two
passes' relative error at 8192 x 4096 -> 128256 with 8 chunks, H100; within 3x the error of one rounding in the
tests). 8192 x 4096 -> 128256 in bf16, fwd + bwd on H100s: 39.7-42.5 ms against the two passes' 54.3-56.3
(``benchmarks/RESULTS.md``). float16 keeps the two passes: ``scale · dlogits`` stored in float16 underflows for a
mean over many tokens. The first call of a chunk shape on a machine also times the kernel's launches in place on a
copy of the chunk (:mod:`.triton.cross_entropy`), beside the tuner's 256 MiB buffer: once, outside the workspace.

**Two passes** (every other case: ``reduction="none"``, a frozen head, float16, more tokens than
``MAX_ROW_CHUNKS`` chunks hold, or a whole-row workspace of 0), each gradient rounded once:

1. **Token blocks** (``Blocks.tokens`` rows, vocabulary slices of ``Blocks.vocab`` columns). For each slice the
   block's logits ``h_t @ W_s.T``, then one kernel folds them into each row's running maximum ``m``, sum
   ``d = Σ exp(logit − m)``, target logit and logit sum (an online softmax), and overwrites them with
   ``p = exp(logit − m)``; then ``O += p @ W_s`` into a float32 ``[tokens, H]`` accumulator. When a slice raises
   a row's maximum by more than ``RESCALE_MARGIN`` (the maximum moves only then, so ``p`` stays below e⁸), the
   row of ``O`` and ``d`` are rescaled first (as FlashAttention's output; a row whose maximum stays put is not
   touched). At the block's end ``softmax @ W = O / d``, so ``grad_hidden = scale · ((1 + 2z·lse)·O/d −
   (1−ε)·W[target] − ε/V·Σ_v W_v)``, rounded once into the hidden's dtype; and each row's ``lse = m + log d``
   gives its loss.
2. **Vocabulary slices** (``Blocks.grad_vocab`` columns, all N tokens). For each slice the logits again,
   overwritten by their gradient (``lse`` known now), then ``grad_weight[slice] = dlogits.T @ hidden`` written
   once, straight into the weight's dtype: no accumulator, no read-modify-write of a V x H buffer.

   Four matmuls of 2·N·H·V FLOPs (logits twice, ``O``, ``grad_weight``); every one is large (8192 x 4096 x 128256:
   blocks of 1024 x 16064 and slices of 8192 x 3072). Token chunks of whole rows within this strategy's small
   workspace (48 MiB) would accumulate ``grad_weight`` over many chunks (counted in
   ``benchmarks/KERNELS_NOTES.md``): 32 read-modify-writes of a V x H buffer at 62 MiB of logits, with an error
   that grows with the number of chunks (2.2x the unfused op's at 32 chunks in bf16, 3.2x at 64); the whole-row
   strategy above bounds both by its larger workspace and ``MAX_ROW_CHUNKS``. A frozen head (``weight`` without
   gradient) skips pass 2: two matmuls.

   Memory beyond the outputs (N·H and V·H for the gradients): pass 1 holds ``O`` (float32, ``Blocks.tokens`` x H,
   16 MiB) and one block of logits, pass 2 one slice of all N rows, both within ``workspace_bytes()`` (48 MiB,
   or 3/4 of the hidden states' size when that is more). Soft-capping with label smoothing needs a second
   accumulator (the smoothing term's slope varies per logit).

   ``reduction="none"``: the per-row upstream gradient must weight each row before rows are summed into
   ``grad_weight``, so pass 2 runs in the backward (``grad_hidden`` from pass 1 is scaled row by row there).

Both strategies run in the forward (but pass 2 for ``reduction="none"``); the backward multiplies by the upstream
gradient.

Example:
    >>> loss = linear_cross_entropy(hidden, weight, target, None, -100, 0.0, "mean", None, None, 0.0, None, None,
    ...                             TORCH_MATH)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .linear_ce_plan import blocks, row_chunk
from .linear_ce_torch import TORCH_MATH, SliceMath, scale_rows_torch

__all__ = ["RESCALE_MARGIN", "TORCH_MATH", "SliceMath", "linear_cross_entropy", "triton_math"]

RESCALE_MARGIN = 8.0  # a row's running maximum moves when a slice exceeds it by more than this (p <= e^8 ~ 2981)


def _whole_rows_triton(x: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                       z_loss: float, scale: torch.Tensor) -> torch.Tensor:
    from .triton.cross_entropy import loss_and_grad

    return loss_and_grad(x, target, ignore_index, label_smoothing, z_loss, scale, x)


def triton_math() -> SliceMath:
    from .triton import linear_ce_slices, loss_reduce

    return SliceMath(linear_ce_slices.slice_stats, linear_ce_slices.slice_grad, loss_reduce.scale_rows,
                     _whole_rows_triton)


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in float32: straight into it where the device's matmul can write float32 from
    16-bit inputs (CUDA), else through a product rounded once to the inputs' dtype (the CPU in torch 2.13)."""
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


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, v0: int, v1: int,
            buffer: torch.Tensor) -> torch.Tensor:
    """``h @ weight[v0:v1].T (+ bias)`` written into the front of ``buffer`` (no allocation in the loops)."""
    out = buffer[: h.shape[0] * (v1 - v0)].view(h.shape[0], v1 - v0)
    if bias is None:
        torch.mm(h, weight[v0:v1].t(), out=out)
    else:
        torch.addmm(bias[v0:v1], h, weight[v0:v1].t(), out=out)
    return out


@dataclasses.dataclass(frozen=True)
class _Options:
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float | None
    reduction: str
    # the reduction's factor: 1/num_items_in_batch or 1, or for a mean 1/n_valid as a 0-dim tensor on the device
    # (counting the kept rows on the host would synchronise)
    scale: float | torch.Tensor
    loss_dtype: torch.dtype | None


def _accumulator(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _pass_tokens(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                 valid: torch.Tensor, opts: _Options, math_: SliceMath, h_scale: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pass 1: per-row log-sum-exp and loss, and ``grad_hidden`` scaled row by row by ``h_scale`` (None: not
    wanted)."""
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    acc = _accumulator(hidden)
    eps, softcap = opts.label_smoothing, opts.softcap
    want_h = h_scale is not None
    two = want_h and bool(eps) and softcap is not None  # the smoothing term's own accumulator
    plan = blocks(n, hidden_size, vocab, hidden.element_size(), accumulators=(2 if two else 1) if want_h else 0)
    m = torch.full((n,), -math.inf, dtype=acc, device=hidden.device)
    d, x_t, total = (torch.zeros(n, dtype=acc, device=hidden.device) for _ in range(3))
    grad_h = torch.zeros_like(hidden, memory_format=torch.contiguous_format) if want_h else None
    buffer = torch.empty(plan.tokens * plan.vocab, dtype=hidden.dtype, device=hidden.device)
    slopes = torch.empty_like(buffer) if two else None
    alpha = torch.empty(plan.tokens, dtype=acc, device=hidden.device)
    out_acc = torch.empty(plan.tokens, hidden_size, dtype=acc, device=hidden.device) if want_h else None
    smooth_acc = torch.empty_like(out_acc) if two else None
    colsum = weight.sum(0, dtype=acc) if want_h and eps and softcap is None else None
    # Every block runs, even one whose targets are all ignored (its rows get loss 0 and gradient 0): skipping it
    # would need the mask on the host, a synchronisation per call.
    for a in range(0, n, plan.tokens):
        b = min(n, a + plan.tokens)
        h, t = hidden[a:b], target[a:b]
        state = (m[a:b], d[a:b], x_t[a:b], total[a:b])
        o = s = None
        if want_h:
            o = out_acc[: b - a].zero_()
            s = smooth_acc[: b - a].zero_() if two else None
        for v0 in range(0, vocab, plan.vocab):
            v1 = min(vocab, v0 + plan.vocab)
            x = _logits(h, weight, bias, v0, v1, buffer)
            g = slopes[: x.numel()].view(x.shape) if two else None
            math_.stats(x, t, v0, state, alpha[: b - a], opts.ignore_index, softcap, RESCALE_MARGIN, want_h, g)
            if want_h:
                math_.scale_rows(o, alpha[: b - a])
                _add_product(o, x, weight[v0:v1])
                if two:
                    _add_product(s, g, weight[v0:v1])
        if want_h:
            _finish_grad_hidden(o, s, colsum, weight, t, valid[a:b], state, h_scale[a:b], opts, buffer,
                                grad_h[a:b])
    lse = torch.where(valid, m + torch.log(d), torch.zeros_like(m))
    return lse, _row_losses(lse, x_t, total, valid, opts, vocab), grad_h


def _row_losses(lse: torch.Tensor, x_t: torch.Tensor, total: torch.Tensor, valid: torch.Tensor, opts: _Options,
                vocab: int) -> torch.Tensor:
    """Each row's loss from its log-sum-exp, target logit and logit sum; 0 for ignored rows."""
    eps = opts.label_smoothing
    rows = lse - (1.0 - eps) * x_t - (eps / vocab) * total
    if opts.z_loss:
        rows = rows + opts.z_loss * lse * lse
    return torch.where(valid, rows, torch.zeros_like(rows))


def _pass_rows(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
               valid: torch.Tensor, row_scale: torch.Tensor, opts: _Options, math_: SliceMath, chunk: int,
               wanted: tuple[bool, bool, bool]
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The whole-row strategy (module docstring): per-row losses, and ``grad_hidden``, ``grad_weight`` (in the
    weight's dtype) and ``grad_bias`` (float32) of ``Σ row_scale · loss_row``, those ``wanted``; ``chunk`` tokens at
    a time."""
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    acc = _accumulator(hidden)
    want_h, want_w, want_b = wanted
    grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if want_h else None
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if want_w else None
    grad_b = torch.zeros(vocab, dtype=acc, device=hidden.device) if want_b else None
    rows = torch.empty(n, dtype=acc, device=hidden.device)
    buffer = torch.empty(chunk * vocab, dtype=hidden.dtype, device=hidden.device)
    fast = math_.whole_rows is not None and opts.softcap is None
    if not fast:
        stats = tuple(torch.empty(chunk, dtype=acc, device=hidden.device) for _ in range(5))
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        h, t = hidden[a:b], target[a:b]
        x = _logits(h, weight, bias, 0, vocab, buffer)
        if fast:
            rows[a:b] = math_.whole_rows(x, t, opts.ignore_index, opts.label_smoothing, opts.z_loss, opts.scale)
        else:  # the two passes' slice steps on one slice that is the whole row
            m, d, x_t, total, alpha = (v[: b - a] for v in stats)
            m.fill_(-math.inf)
            for v in (d, x_t, total):
                v.zero_()
            math_.stats(x, t, 0, (m, d, x_t, total), alpha, opts.ignore_index, opts.softcap, RESCALE_MARGIN, False,
                        None)
            ok = valid[a:b]
            lse = torch.where(ok, m + torch.log(torch.where(ok, d, torch.ones_like(d))), torch.zeros_like(m))
            math_.grad(x, t, 0, vocab, lse, row_scale[a:b], opts.label_smoothing, opts.z_loss, opts.softcap)
            rows[a:b] = _row_losses(lse, x_t, total, ok, opts, vocab)
        if want_h:
            torch.mm(x, weight, out=grad_h[a:b])
        if want_w:
            if a == 0:
                torch.mm(x.t(), h, out=grad_w)
            else:  # the running sum in the weight's dtype: one rounding per chunk (module docstring)
                grad_w.addmm_(x.t(), h)
        if want_b:
            grad_b.add_(x.sum(0, dtype=acc))
    return rows, grad_h, grad_w, grad_b


def _finish_grad_hidden(o: torch.Tensor, s: torch.Tensor | None, colsum: torch.Tensor | None, weight: torch.Tensor,
                        target: torch.Tensor, valid: torch.Tensor, state: tuple[torch.Tensor, ...],
                        scale: torch.Tensor, opts: _Options, buffer: torch.Tensor, out: torch.Tensor) -> None:
    """``out = scale · ((1 + 2z·lse)·O/d − (1−ε)·slope_t·W[target] − ε/V·S)``, ``S`` the smoothing accumulator or
    the column sums of W, rounded once into ``out``."""
    m, d, x_t, _ = state
    eps, softcap = opts.label_smoothing, opts.softcap
    safe_d = torch.where(valid, d, torch.ones_like(d))
    lse = torch.where(valid, m + torch.log(safe_d), torch.zeros_like(m))
    scale = torch.where(valid, scale, torch.zeros_like(scale))
    o.mul_((scale * (1.0 + 2.0 * opts.z_loss * lse) / safe_d).unsqueeze(1))
    target_coef = scale * (1.0 - eps)
    if softcap is not None:
        target_coef = target_coef * (1.0 - (x_t / softcap) ** 2)
    safe_t = torch.where(valid, target, torch.zeros_like(target))
    rows, hidden_size = o.shape
    step = max(1, min(rows, buffer.numel() // max(hidden_size, 1)))
    for r in range(0, rows, step):  # W[target] gathered into the free logits buffer, a few rows at a time
        w_rows = buffer[: min(step, rows - r) * hidden_size].view(-1, hidden_size)
        torch.index_select(weight, 0, safe_t[r:r + step], out=w_rows)
        o[r:r + step].addcmul_(w_rows, target_coef[r:r + step].unsqueeze(1), value=-1.0)
    if eps:
        smoothing = scale * (-eps / weight.shape[0])
        if s is not None:
            o.add_(s.mul_(smoothing.unsqueeze(1)))
        else:
            o.addr_(smoothing, colsum)
    out.copy_(o)


def _pass_vocab(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                lse: torch.Tensor, row_scale: torch.Tensor, opts: _Options, math_: SliceMath, want_w: bool,
                want_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Pass 2: ``grad_weight`` (in the weight's dtype) and ``grad_bias`` (in float32) of ``Σ row_scale · loss_row``,
    one vocabulary slice at a time."""
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    plan = blocks(n, hidden_size, vocab, hidden.element_size())
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if want_w else None
    grad_b = torch.empty(vocab, dtype=_accumulator(hidden), device=hidden.device) if want_b else None
    buffer = torch.empty(n * plan.grad_vocab, dtype=hidden.dtype, device=hidden.device)
    for v0 in range(0, vocab, plan.grad_vocab):
        v1 = min(vocab, v0 + plan.grad_vocab)
        x = _logits(hidden, weight, bias, v0, v1, buffer)
        math_.grad(x, target, v0, vocab, lse, row_scale, opts.label_smoothing, opts.z_loss, opts.softcap)
        if want_w:
            torch.mm(x.t(), hidden, out=grad_w[v0:v1])
        if want_b:
            torch.sum(x, 0, dtype=grad_b.dtype, out=grad_b[v0:v1])
    return grad_w, grad_b


class _FusedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, opts: _Options, math_: SliceMath) -> torch.Tensor:
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        want_b = want_b and bias is not None
        valid = target != opts.ignore_index
        acc = _accumulator(hidden)
        per_row = opts.reduction == "none"
        # "none": unit scale now, each row's upstream gradient in the backward
        row_scale = valid.to(acc) * (1.0 if per_row else opts.scale)
        # float16 keeps the two passes: the whole-row kernel writes scale · dlogits in the logits' dtype, where a
        # mean's 1/N times a small probability underflows float16's range (bf16 has float32's)
        rows_ok = want_w and not per_row and hidden.dtype != torch.float16
        chunk = row_chunk(hidden.shape[0], weight.shape[0], hidden.element_size()) if rows_ok else 0
        if chunk:
            rows, grad_h, grad_w, grad_b = _pass_rows(hidden, weight, bias, target, valid, row_scale, opts, math_,
                                                      chunk, (want_h, want_w, want_b))
        else:
            lse, rows, grad_h = _pass_tokens(hidden, weight, bias, target, valid, opts, math_,
                                             row_scale if want_h else None)
            grad_w = grad_b = None
            if not per_row and (want_w or want_b):
                grad_w, grad_b = _pass_vocab(hidden, weight, bias, target, lse, row_scale, opts, math_, want_w,
                                             want_b)
        ctx.opts, ctx.math = opts, math_
        ctx.wanted = (want_h, want_w, want_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.used = False
        loss_dtype = opts.loss_dtype or hidden.dtype
        if per_row:
            ctx.save_for_backward(hidden, weight, bias, target, lse, grad_h)
            return rows.to(loss_dtype)
        ctx.save_for_backward(grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype))
        return (rows.sum() * opts.scale).to(loss_dtype)

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple[Any, ...]:
        if ctx.used:
            raise RuntimeError(
                "fused_linear_cross_entropy: the gradients are computed in the forward and handed over by the first "
                "backward; a second backward through the same loss (retain_graph=True) is not supported"
            )
        ctx.used = True
        opts, math_ = ctx.opts, ctx.math
        want_h, want_w, want_b = ctx.wanted
        if opts.reduction == "none":
            hidden, weight, bias, target, lse, grad_h = ctx.saved_tensors
            factor = dloss.reshape(-1).to(lse.dtype)
            if grad_h is not None:
                grad_h.mul_(factor.unsqueeze(1))
            grad_w = grad_b = None
            if want_w or want_b:
                row_scale = torch.where(target != opts.ignore_index, factor, torch.zeros_like(factor))
                grad_w, grad_b = _pass_vocab(hidden, weight, bias, target, lse, row_scale, opts, math_, want_w,
                                             want_b)
                grad_b = None if grad_b is None else grad_b.to(ctx.dtypes[1])
        else:
            grad_h, grad_w, grad_b = ctx.saved_tensors
            _scale_by(math_, dloss, (grad_h, grad_w, grad_b))
        # New views of our own buffers: autograd hands them on without copying.
        return (None if grad_h is None else grad_h.view(grad_h.shape),
                None if grad_w is None else grad_w.view(grad_w.shape),
                None if grad_b is None else grad_b.view(grad_b.shape),
                None, None, None)


def _scale_by(math_: SliceMath, dloss: torch.Tensor, grads: tuple[torch.Tensor | None, ...]) -> None:
    """Multiply the gradients by the scalar upstream gradient, in float32, rounded once. ``loss.backward()`` gives
    exactly 1, and then the gradients (1 GiB of grad_weight for 4096 x 128256 bf16) are handed over untouched: the
    Triton kernel reads the factor on the device and skips rows whose factor is 1 (no host synchronisation);
    elsewhere one host read of it decides."""
    if math_.scale_rows is not scale_rows_torch:
        factor = dloss.detach().reshape(1).to(torch.float32)
        for g in grads:
            if g is not None and g.numel():
                math_.scale_rows(g.view(-1, g.shape[-1]), factor)
        return
    value = float(dloss)
    if value != 1.0:
        for g in grads:
            if g is not None:
                g.mul_(value)  # a Python float: multiplied in float32, rounded once


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None, ignore_index: int, label_smoothing: float, reduction: str,
                         divisor: float | None, n_valid: int | None, z_loss: float, softcap: float | None,
                         loss_dtype: torch.dtype | None, math_: SliceMath) -> torch.Tensor:
    """The op on ``[N, H]`` hidden states (arguments checked by the caller) with the element-wise steps of
    ``math_``: the loss, whose backward hands over the gradients the forward computed."""
    if divisor is not None:
        scale: float | torch.Tensor = 1.0 / divisor
    elif reduction != "mean":
        scale = 1.0
    elif n_valid is not None:
        scale = 1.0 / max(n_valid, 1)
    else:
        kept = (target != ignore_index).sum().clamp_min(1)
        scale = 1.0 / kept.to(_accumulator(hidden))
    opts = _Options(ignore_index, label_smoothing, z_loss, softcap, reduction, scale, loss_dtype)
    return _FusedFunction.apply(hidden, weight, bias, target.contiguous(), opts, math_)
