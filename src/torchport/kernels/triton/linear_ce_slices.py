"""The fused linear cross-entropy's per-slice kernels (:mod:`torchport.kernels.linear_ce_passes`): ``slice_stats``
folds a slice of a block's logits into each row's running maximum, sum of exponentials, target logit and logit sum,
and overwrites the slice with ``exp(logit - max)`` (the operand of the next matmul); ``slice_grad`` overwrites a
slice with its gradient once each row's log-sum-exp is known. The two passes give them slices of at most 48 MiB;
the whole-row strategy gives them whole rows of a chunk (up to 256 MiB) only with soft-capping, which its own
whole-row kernel (the cross-entropy kernel) does not take.

Bytes: each reads a slice twice and writes it once. In the two passes the second read comes from L2 (a slice is at
most the op's workspace, 48 MiB at 8192 x 4096 -> 128256, against the H100's 50 MiB L2): 4 bytes per bf16 logit in
all, 4.2 GB per pass for 8192 x 128256, 1.4 ms at 3022 GB/s, next to 11 ms for each of the pass's two matmuls; a
program walks one row, so on whole rows the second read comes from L2 as long as the rows in flight fit there.
Both soft-cap the logits (``cap · tanh(x / cap)``, Gemma 2) when asked, with the derivative in what they write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["slice_grad", "slice_stats"]

_BLOCK = 8192  # columns per step: 16 KiB of bf16, 32 KiB of float32 values in registers per program


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
