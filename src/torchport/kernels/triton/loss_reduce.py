"""The cross-entropy's reductions and its gradient's scaling in Triton, with no host read, so that a CUDA graph can
hold them: the mean's scale counted from the targets (:func:`mean_scale`) and the per-row losses summed
(:func:`reduce_rows`), each in one program, and the gradient's rows scaled in place by the upstream gradient
(:func:`scale_rows`, which leaves rows whose factor is exactly 1 untouched). Used by the cross-entropy
(:mod:`.cross_entropy`); :func:`scale_rows` also by the fused linear cross-entropy
(:mod:`torchport.kernels.linear_ce_passes`). Called eagerly, the cross-entropy checks its targets with
:func:`target_counts`: one program and one host read for what took PyTorch five comparisons, a reduction and a read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import multiprocessor_count, next_power_of_2
from .launch import Kernel

__all__ = ["mean_scale", "reduce_rows", "scale_rows", "target_counts"]

_REDUCE_BLOCK = 8192  # at most this many targets or row losses per step of the one-program count and sum
_SCALE_BLOCK = 8192  # columns per step of the scaling kernel: 16 KiB of bf16, 32 KiB of float32 in registers


def _reduce_launch(n: int) -> tuple[int, int]:
    """(block, warps) of the one-program count and sum over ``n`` values: the whole of up to 8192 in one step (64 KB
    of int64 targets), whose loads are then all in flight together."""
    block = min(_REDUCE_BLOCK, next_power_of_2(max(n, 1)))
    return block, 16 if block >= 8192 else 8 if block >= 2048 else 4


@triton.jit
def _total_kernel(ROWS, N, SCALE, factor, OUT, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[0] = the sum of the N float32 ROWS times ``factor`` (and SCALE[0] where SCALED), summed in float32 in one
    program and rounded once to OUT's dtype."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        index = start + offs
        acc += tl.load(ROWS + index, mask=index < N, other=0.0)
    total = tl.sum(acc, axis=0) * factor
    if SCALED:
        total = total * tl.load(SCALE)
    tl.store(OUT, total.to(OUT.dtype.element_ty))


@triton.jit
def _targets_kernel(T, N, V, ignore_index, OUT, COUNTS: tl.constexpr, BLOCK: tl.constexpr):
    """In one program, over the N targets: where COUNTS, OUT[0] = those that are neither ignore_index nor a class in
    [0, V) and OUT[1] = those that are classes (int64); otherwise OUT[0] = 1 / max(1, the classes), a mean's scale
    (float32)."""
    offs = tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    classes = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        index = start + offs
        target = tl.load(T + index, mask=index < N, other=ignore_index)
        kept = target != ignore_index
        is_class = (target >= 0) & (target < V)
        classes += (kept & is_class).to(tl.int32)
        if COUNTS:
            bad += (kept & ~is_class).to(tl.int32)
    if COUNTS:
        tl.store(OUT, tl.sum(bad, axis=0).to(tl.int64))
        tl.store(OUT + 1, tl.sum(classes, axis=0).to(tl.int64))
    else:
        tl.store(OUT, 1.0 / tl.maximum(tl.sum(classes, axis=0), 1).to(tl.float32))


_TOTAL, _TARGETS = Kernel(_total_kernel), Kernel(_targets_kernel)


def target_counts(target: torch.Tensor, ignore_index: int, vocab: int) -> tuple[int, int]:
    """(targets that are neither ``ignore_index`` nor a class in ``[0, vocab)``, targets that are classes), counted
    in one program and read on the host at once: the eager check of a cross-entropy's targets, whose second number
    is a mean's divisor. Synchronises with the device (nothing may call it while a graph is captured)."""
    counts = torch.empty(2, dtype=torch.int64, device=target.device)
    block, warps = _reduce_launch(target.numel())
    _TARGETS.launch((1,), target, target.numel(), vocab, int(ignore_index), counts, COUNTS=True, BLOCK=block,
                    num_warps=warps)
    bad, classes = counts.tolist()
    return bad, classes


def mean_scale(target: torch.Tensor, ignore_index: int, vocab: int) -> torch.Tensor:
    """``1 / max(1, targets that are classes in [0, vocab))`` as a one-element float32 tensor on the targets' device,
    counted there by one small kernel (no host read, so a CUDA graph can hold it)."""
    scale = torch.empty(1, dtype=torch.float32, device=target.device)
    block, warps = _reduce_launch(target.numel())
    _TARGETS.launch((1,), target, target.numel(), vocab, int(ignore_index), scale, COUNTS=False, BLOCK=block,
                    num_warps=warps)
    return scale


def reduce_rows(rows: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(rows.sum() * scale).to(dtype)`` for float32 ``rows`` in one launch (a NaN row makes the result NaN)."""
    out = torch.empty((), dtype=dtype, device=rows.device)
    scaled = isinstance(scale, torch.Tensor)
    block, warps = _reduce_launch(rows.numel())
    _TOTAL.launch((1,), rows, rows.numel(), scale if scaled else rows, 1.0 if scaled else float(scale), out,
                  SCALED=scaled, BLOCK=block, num_warps=warps)
    return out


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


_SCALE = Kernel(_scale_kernel)


def scale_rows(grad: torch.Tensor, factor: torch.Tensor) -> None:
    """``grad[i] *= factor[i]`` (or ``*= factor`` for a scalar) in place, skipping factors that are exactly 1
    without a host synchronisation (so ``loss.backward()`` costs one small launch, and a CUDA graph can hold it)."""
    n, v = grad.shape
    if n == 0 or v == 0:
        return
    stride_g = 0 if factor.numel() == 1 else factor.stride(0)
    programs = min(n, multiprocessor_count(grad.device) * 8)
    block = min(_SCALE_BLOCK, next_power_of_2(v))
    _SCALE.launch((programs,), grad, factor, n, v, grad.stride(0), stride_g, BLOCK=block,
                  num_warps=8 if block >= 2048 else 4)
