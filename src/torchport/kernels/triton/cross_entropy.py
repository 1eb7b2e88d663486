"""Cross-entropy in Triton: loss and gradient in one forward kernel; the backward only scales the gradient.

Bytes, forward + backward, for ``N x V`` logits of ``s`` bytes each (targets and per-row losses are negligible):
the least any implementation can move is 2·N·V·s — read the logits once, write their gradient once. This kernel
reads each row twice (once for the row's maximum and log-sum-exp, once for the gradient) and writes the gradient
once: 3·N·V·s from memory at worst, 2·N·V·s when the second read of a row hits the L2 cache (a 128256-wide bf16
row is 250 KiB; one row per program, a few programs per multiprocessor, stay well inside an H100's 50 MiB L2).
For 8192 x 128256 bf16 the floor is 4.20 GB, 1.39 ms at the H100's 3022 GB/s copy bandwidth. The backward reads
the upstream gradient and, when it is exactly 1 (``loss.backward()`` on a mean or sum), returns without touching
the gradient; otherwise it scales it in place (another 2·N·V·s).

How it works:

* One program per row. Pass 1 walks the vocabulary in chunks of ``BLOCK`` columns keeping a running maximum and
  a running sum of ``exp(x - max)`` (online softmax), so any vocabulary size works with registers for one chunk
  and no full-size float32 copy of the logits exists at any time. It also sums the row (for label smoothing) and
  reads the target's logit with one scalar load.
* Pass 2 writes ``d loss / d logits = scale · (softmax·(1 + 2·z·lse) − (1−ε)·onehot − ε/V)``, where ``scale`` is
  the reduction's (1/non-ignored count for a mean, 1 for a sum or per row). Ignored rows get zeros.
* The gradient goes into a fresh buffer, or over the logits themselves when the caller opts in (``in_place``).

Two kernels serve the fused linear cross-entropy (:mod:`torchport.kernels.fused_linear_cross_entropy`), which
never holds a whole row of logits: ``slice_stats`` folds a slice of a block's logits into each row's running
maximum, sum of exponentials, target logit and logit sum, and overwrites the slice with ``exp(logit − max)``
(the operand of the next matmul); ``slice_grad`` overwrites a slice with its gradient once each row's log-sum-exp is
known. Each reads a slice twice (the second read from L2: a slice is at most the op's workspace, 48 MiB at
8192 x 4096 -> 128256, against the H100's 50 MiB L2) and writes it once: 4 bytes per bf16 logit in all, 4.2 GB
per pass for 8192 x 128256, 1.4 ms at 3022 GB/s, next to 11 ms for each of the pass's two matmuls. Both
soft-cap the logits (``cap · tanh(x / cap)``, Gemma 2) when asked, with the derivative in what they write.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .. import registry
from . import multiprocessor_count

__all__ = ["cross_entropy", "loss_and_grad", "scale_rows", "slice_grad", "slice_stats"]

_BLOCK = 8192  # columns per step: 16 KiB of bf16, 32 KiB of float32 values in registers per program


@triton.jit
def _fwd_kernel(
    X, DX, T, LOSS, stride_x, stride_dx, V, ignore_index, smoothing, z_loss, grad_scale,
    WANT_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    dx_row = DX + row * stride_dx
    cols = tl.arange(0, BLOCK)
    target = tl.load(T + row)
    if target == ignore_index:
        tl.store(LOSS + row, 0.0)
        if WANT_GRAD:
            for start in range(0, V, BLOCK):
                offs = start + cols
                tl.store(dx_row + offs, tl.zeros([BLOCK], dtype=tl.float32).to(DX.dtype.element_ty), mask=offs < V)
        return
    # pass 1: running max m and running sum d of exp(x - m); the row sum for label smoothing
    m = -float("inf")
    d = 0.0
    total = 0.0
    for start in range(0, V, BLOCK):
        offs = start + cols
        ok = offs < V
        x = tl.load(x_row + offs, mask=ok, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        total += tl.sum(tl.where(ok, x, 0.0), axis=0)
    lse = m + tl.log(d)
    x_t = tl.load(x_row + target).to(tl.float32)
    loss = lse - (1.0 - smoothing) * x_t - smoothing * total / V + z_loss * lse * lse
    tl.store(LOSS + row, loss)
    if WANT_GRAD:
        # pass 2: the gradient, chunk by chunk (each value is read before it is overwritten when DX is X)
        softmax_factor = 1.0 + 2.0 * z_loss * lse
        for start in range(0, V, BLOCK):
            offs = start + cols
            ok = offs < V
            x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * softmax_factor - smoothing / V
            g = tl.where(offs == target, g - (1.0 - smoothing), g)
            tl.store(dx_row + offs, (g * grad_scale).to(DX.dtype.element_ty), mask=ok)


@triton.jit
def _scale_kernel(DX, G, M, V, stride_dx, stride_g, BLOCK: tl.constexpr):
    """Rows of DX times G[row] in place; rows whose factor is exactly 1 are not touched."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    for row in range(pid, M, tl.num_programs(0)):
        row64 = tl.zeros([], dtype=tl.int64) + row  # 64-bit offsets (the loop variable is 32-bit)
        g = tl.load(G + row64 * stride_g).to(tl.float32)
        if g != 1.0:
            dx_row = DX + row64 * stride_dx
            for start in range(0, V, BLOCK):
                offs = start + cols
                ok = offs < V
                v = tl.load(dx_row + offs, mask=ok, other=0.0).to(tl.float32)
                tl.store(dx_row + offs, (v * g).to(DX.dtype.element_ty), mask=ok)


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact limits at +-inf, and the same code on every Triton backend and the interpreter
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _slice_stats_kernel(
    X, G, T, M, D, XT, TOTAL, ALPHA, stride_x, stride_g, v0, width, ignore_index, softcap, margin,
    SOFTCAP: tl.constexpr, WANT_P: tl.constexpr, WANT_G: tl.constexpr, BLOCK: tl.constexpr,
):
    """One row of a [tokens, width] slice of logits (columns v0 .. v0 + width of the vocabulary): fold it into the
    row's running maximum M (moved only when the slice's maximum exceeds it by more than ``margin``), sum D of
    exp(logit - M), target logit XT and logit sum TOTAL; ALPHA gets exp(old M - new M), the factor by which sums
    relative to the old maximum must be rescaled (exactly 1 when M did not move). With WANT_P the slice is
    overwritten by exp(logit - M), times the soft-cap's derivative; with WANT_G, G receives that derivative."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    g_row = G + row * stride_g
    cols = tl.arange(0, BLOCK)
    target = tl.load(T + row)
    if target == ignore_index:
        tl.store(ALPHA + row, 1.0)
        for start in range(0, width, BLOCK):
            offs = start + cols
            zero = tl.zeros([BLOCK], dtype=tl.float32)
            if WANT_P:
                tl.store(x_row + offs, zero.to(X.dtype.element_ty), mask=offs < width)
            if WANT_G:
                tl.store(g_row + offs, zero.to(G.dtype.element_ty), mask=offs < width)
        return
    top = -float("inf")
    total = 0.0
    for start in range(0, width, BLOCK):
        offs = start + cols
        ok = offs < width
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = softcap * _tanh(x / softcap)
        top = tl.maximum(top, tl.max(tl.where(ok, x, -float("inf")), axis=0))
        total += tl.sum(tl.where(ok, x, 0.0), axis=0)
    m_old = tl.load(M + row)
    m_new = tl.where(top > m_old + margin, top, m_old)
    alpha = tl.where(m_old == -float("inf"), 1.0, tl.exp(m_old - m_new))
    local = target - v0
    if (local >= 0) & (local < width):  # read before the slice is overwritten
        x_t = tl.load(x_row + local).to(tl.float32)
        if SOFTCAP:
            x_t = softcap * _tanh(x_t / softcap)
        tl.store(XT + row, x_t)
    d = 0.0
    for start in range(0, width, BLOCK):
        offs = start + cols
        ok = offs < width
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = softcap * _tanh(x / softcap)
        e = tl.where(ok, tl.exp(x - m_new), 0.0)
        d += tl.sum(e, axis=0)
        if SOFTCAP:
            slope = 1.0 - (x / softcap) * (x / softcap)
            if WANT_P:
                tl.store(x_row + offs, (e * slope).to(X.dtype.element_ty), mask=ok)
            if WANT_G:
                tl.store(g_row + offs, slope.to(G.dtype.element_ty), mask=ok)
        elif WANT_P:
            tl.store(x_row + offs, e.to(X.dtype.element_ty), mask=ok)
    tl.store(D + row, tl.load(D + row) * alpha + d)
    tl.store(M + row, m_new)
    tl.store(ALPHA + row, alpha)
    tl.store(TOTAL + row, tl.load(TOTAL + row) + total)


@triton.jit
def _slice_grad_kernel(
    X, T, LSE, SCALE, stride_x, v0, width, vocab, smoothing, z_loss, softcap,
    SOFTCAP: tl.constexpr, BLOCK: tl.constexpr,
):
    """One row of a [tokens, width] slice of logits, overwritten by SCALE[row] · d loss_row / d logits, given the
    row's log-sum-exp over the whole vocabulary. Rows whose scale is 0 (ignored targets) get zeros."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    cols = tl.arange(0, BLOCK)
    scale = tl.load(SCALE + row)
    if scale == 0.0:
        for start in range(0, width, BLOCK):
            offs = start + cols
            tl.store(x_row + offs, tl.zeros([BLOCK], dtype=tl.float32).to(X.dtype.element_ty), mask=offs < width)
        return
    lse = tl.load(LSE + row)
    softmax_factor = 1.0 + 2.0 * z_loss * lse
    local = tl.load(T + row) - v0
    for start in range(0, width, BLOCK):
        offs = start + cols
        ok = offs < width
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = softcap * _tanh(x / softcap)
        g = tl.exp(x - lse) * softmax_factor - smoothing / vocab
        g = tl.where(offs == local, g - (1.0 - smoothing), g)
        if SOFTCAP:
            g = g * (1.0 - (x / softcap) * (x / softcap))
        tl.store(x_row + offs, (g * scale).to(X.dtype.element_ty), mask=ok)


def _block(v: int) -> int:
    return min(_BLOCK, triton.next_power_of_2(max(v, 1)))


def loss_and_grad(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                  z_loss: float, grad_scale: float, grad_out: torch.Tensor | None) -> torch.Tensor:
    """Per-row losses (float32, 0 for ignored rows) of ``[N, V]`` logits; when ``grad_out`` is given (``[N, V]``,
    unit column stride, may be ``logits`` itself) it receives ``grad_scale · d loss_row / d logits``.

    Targets must already be checked (in ``[0, V)`` or ``ignore_index``): the kernel reads the target's logit.
    """
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise registry.Unsupported(f"the Triton kernel takes float32, bfloat16 or float16 logits, not {logits.dtype}")
    if logits.stride(-1) != 1:
        raise registry.Unsupported("the Triton kernel needs logits with unit stride along the vocabulary")
    n, v = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return loss
    block = _block(v)
    dx = grad_out if grad_out is not None else logits
    _fwd_kernel[(n,)](
        logits, dx, target, loss, logits.stride(0), dx.stride(0), v, int(ignore_index), float(label_smoothing),
        float(z_loss), float(grad_scale), WANT_GRAD=grad_out is not None, BLOCK=block,
        num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4,
    )
    return loss


def _warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def slice_stats(x: torch.Tensor, target: torch.Tensor, v0: int, state: tuple[torch.Tensor, ...], alpha: torch.Tensor,
                ignore_index: int, softcap: float | None, margin: float, want_p: bool,
                slope_out: torch.Tensor | None) -> None:
    """Fold a slice of logits into the running per-row statistics of the fused linear cross-entropy (see
    :mod:`torchport.kernels.fused_linear_cross_entropy`): ``x`` is ``[rows, width]`` (unit column stride), the
    columns ``v0 ..`` of the vocabulary; ``state`` is (maximum, sum of exp, target logit, logit sum), float32
    vectors of ``rows``; ``alpha`` receives each row's rescaling factor. With ``want_p`` ``x`` is overwritten by
    exp(logit - maximum) (times the soft-cap's slope); ``slope_out`` (``[rows, width]``) receives the slope."""
    rows, width = x.shape
    if rows == 0 or width == 0:
        return
    m, d, x_t, total = state
    block = _block(width)
    g = slope_out if slope_out is not None else x
    _slice_stats_kernel[(rows,)](
        x, g, target, m, d, x_t, total, alpha, x.stride(0), g.stride(0), int(v0), width, int(ignore_index),
        float(softcap or 1.0), float(margin), SOFTCAP=softcap is not None, WANT_P=want_p,
        WANT_G=slope_out is not None, BLOCK=block, num_warps=_warps(block),
    )


def slice_grad(x: torch.Tensor, target: torch.Tensor, v0: int, vocab: int, lse: torch.Tensor, scale: torch.Tensor,
               label_smoothing: float, z_loss: float, softcap: float | None) -> None:
    """Overwrite a ``[rows, width]`` slice of logits (vocabulary columns ``v0 ..``) with ``scale[row] · d loss_row /
    d logits``, given each row's log-sum-exp ``lse`` (float32); rows with scale 0 get zeros."""
    rows, width = x.shape
    if rows == 0 or width == 0:
        return
    block = _block(width)
    _slice_grad_kernel[(rows,)](
        x, target, lse, scale, x.stride(0), int(v0), width, int(vocab), float(label_smoothing), float(z_loss),
        float(softcap or 1.0), SOFTCAP=softcap is not None, BLOCK=block, num_warps=_warps(block),
    )


def scale_rows(grad: torch.Tensor, factor: torch.Tensor) -> None:
    """``grad[i] *= factor[i]`` (or ``*= factor`` for a scalar) in place, skipping factors that are exactly 1
    without a host synchronisation (so ``loss.backward()`` costs one small launch, and a CUDA graph can hold it)."""
    n, v = grad.shape
    if n == 0 or v == 0:
        return
    stride_g = 0 if factor.numel() == 1 else factor.stride(0)
    programs = min(n, multiprocessor_count(grad.device) * 8)
    block = _block(v)
    _scale_kernel[(programs,)](grad, factor, n, v, grad.stride(0), stride_g, BLOCK=block,
                               num_warps=8 if block >= 2048 else 4)


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                reduction: str, z_loss: float, in_place: bool, n_valid: int,
                loss_dtype: torch.dtype | None) -> torch.Tensor:
        want_grad = ctx.needs_input_grad[0]
        if want_grad and in_place:
            grad = logits
        elif want_grad:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        else:
            grad = None
        scale = 1.0 / max(n_valid, 1) if reduction == "mean" else 1.0
        rows = loss_and_grad(logits, target, ignore_index, label_smoothing, z_loss, scale, grad)
        if grad is not None:
            if in_place:
                # The logits now hold their gradient: any autograd node that saved them fails loudly.
                torch.autograd.graph.increment_version(logits)
            ctx.save_for_backward(grad)
        ctx.args = (reduction, registry.forced("cross_entropy"))
        ctx.used = False
        dtype = loss_dtype or logits.dtype
        if reduction == "none":
            return rows.to(dtype)
        total = rows.sum()
        return (total * scale).to(dtype)

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple[Any, ...]:
        if ctx.used:
            raise RuntimeError(
                "cross_entropy: the gradient is computed in the forward and handed over by the first backward; "
                "a second backward through the same loss (retain_graph=True) is not supported"
            )
        ctx.used = True
        (grad,) = ctx.saved_tensors
        reduction, was_forced = ctx.args
        factor = dloss.reshape(-1) if reduction == "none" else dloss.reshape(1)
        try:
            scale_rows(grad, factor)
        except Exception as exc:
            if was_forced or isinstance(exc, torch.OutOfMemoryError):
                raise
            registry._warn_once("cross_entropy", "triton", "backward", f"{type(exc).__name__}: {exc}")
            grad.mul_(factor.to(grad.dtype)[:, None] if reduction == "none" else factor.to(grad.dtype))
        # A new view, never the saved tensor itself: autograd hands it on without copying it.
        return grad.view(grad.shape), None, None, None, None, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                  reduction: str, z_loss: float, in_place: bool, n_valid: int,
                  loss_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The op on ``[N, V]`` logits and ``[N]`` targets (checked by the caller)."""
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise registry.Unsupported(f"the Triton kernel takes float32, bfloat16 or float16 logits, not {logits.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _CrossEntropyFunction.apply(logits, target.contiguous(), ignore_index, label_smoothing, reduction, z_loss,
                                       in_place, n_valid, loss_dtype)
