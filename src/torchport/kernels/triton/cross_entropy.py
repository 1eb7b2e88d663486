"""Cross-entropy in Triton: loss and gradient in one forward kernel; the backward only scales the gradient.

Bytes, forward + backward, for ``N x V`` logits of ``s`` bytes each (targets and per-row losses are negligible):
the least any implementation can move is 2·N·V·s — read the logits once, write their gradient once. For
8192 x 128256 bf16 that is 4.20 GB, 1.39 ms at the H100's 3022 GB/s copy bandwidth. The backward reads the upstream
gradient and, when it is exactly 1 (``loss.backward()`` on a mean or sum), returns without touching the gradient;
otherwise it scales it in place (another 2·N·V·s).

Two kernels, by row length (launches chosen from ``benchmarks/bench_ce_variants.py`` on an H100, notes in
``benchmarks/KERNELS_NOTES.md``):

* **Short rows** (``V`` up to ``_ROW_MAX`` = 4096 columns): ``BLOCK_M`` whole rows per program (2048 values, 4
  warps), each read once into registers; the maximum, log-sum-exp, loss and gradient come from those registers, so
  the kernel moves exactly 2·N·V·s. Several rows per program keep small vocabularies (256 columns: 512 bytes a row)
  from being one tiny program per row.
* **Longer rows**: a program walks each row in chunks of ``BLOCK`` columns twice — an online softmax (running
  maximum and sum of ``exp(x - max)``) for its log-sum-exp, then the gradient. The second read should come from
  L2, or the kernel moves 3·N·V·s: the first pass loads with ``evict_last``, the second walks the row backwards (the
  chunks read last come back first) and loads and stores with ``evict_first``. Up to 65536 columns, one program per
  row (8 warps up to 32768 columns, 88–96% of the copy ceiling; 16 beyond). Wider rows take a persistent grid of
  one 32-warp program per multiprocessor that loads each 32768-column chunk ahead (``prefetch``): 132 rows in flight
  between their two reads (34 MB at 128256 bf16 columns) fit in the 50 MiB L2, where a program per row had ~4 per
  multiprocessor, 132 MB, and read part of each row twice from memory; without the loads ahead, so few programs
  kept too few loads in flight (57–74%). 8192 x 128256 bf16: 1.672 ms, 83.8% of the ceiling, against 1.901 ms for
  a program per row in the same run (an H100; another H100 had measured that launch at 1.80 ms, 77.6%).
  Splitting a row over programs that hold it in registers and exchange their statistics through memory moves the
  least bytes but measured 46–63% (notes in ``benchmarks/KERNELS_NOTES.md``).

These are the heuristics. The launch is timed once per shape bucket on the device itself (:mod:`.cross_entropy_tuning`,
``cross_entropy.launch``; both kernels among the candidates of short rows), because cards differ: an H200 runs
programs per row in 10-23% less time than the persistent grid at 128256 columns, and other launches than the
heuristics in 9-14% less at 256, 1024 and 4096 columns (kernel alone).

Arithmetic per logit is kept to a few instructions, because the kernels were bound by it, not by bytes: an
exponential is one multiply-add and ``ex2``, the scale is folded into per-row factors (a gradient is then one more
multiply-add and a select, and in the whole-row kernel a second select that keeps rows without a class at zero
whatever their logits hold), the target's column is found by a 32-bit compare (a 64-bit one is two instructions;
written against the chunk's offset, the 32-bit one made the chunked kernel hold 96 registers a thread instead of
64), the target's logit is loaded rather than picked out by a reduction, and the row's sum is taken only for label
smoothing. On an H200, kernel
alone, 8192 rows bf16, best tuner candidate: 8192 columns from 66.9% to 88.5% of the copy ceiling, 16384 from 72.4%
to 95.8%, 131072 from 66.8% to 81.4% (RESULTS.md, "the cross-entropy bound by its instructions").

Both write ``d loss / d logits = scale · (softmax·(1 + 2·z·lse) − (1−ε)·onehot − ε/V)`` where ``scale`` (a
float32 on the device: 1/non-ignored count for a mean, so no count is read on the host) is the reduction's. Ignored
rows get zeros. The gradient goes into a fresh buffer, or over the logits themselves when the caller opts in
(``in_place``). A target outside ``[0, V)`` that is not ``ignore_index`` (only possible where no host read checked
it) gets a NaN loss and a zero gradient row. The mean's count, the reduced loss and the backward's scaling are
one-program kernels of their own (:mod:`.loss_reduce`), so that a forward and backward is four launches in all: a
CUDA graph of the op measured 22 launches and 25 µs more at 8192 x 8192 when these were PyTorch operations
(RESULTS.md).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .. import registry
from . import cdiv, multiprocessor_count, next_power_of_2
from .cross_entropy_tuning import Launch, launch_for, tuned_launch
from .launch import Kernel
from .loss_reduce import mean_scale, reduce_rows, scale_rows

__all__ = ["Launch", "cross_entropy", "launch_for", "loss_and_grad"]

_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = 2^(x · log2(e))


@triton.jit
def _row_loss(lse, x_t, total, V, smoothing, z_loss):
    """A row's loss from its log-sum-exp, target logit and logit sum; the smoothing term only where smoothing is on
    (a masked vocabulary's -inf logits sum to -inf, and 0 · -inf would be NaN)."""
    smooth = tl.where(smoothing != 0.0, smoothing * total / V, 0.0)
    return lse - (1.0 - smoothing) * x_t - smooth + z_loss * lse * lse


@triton.jit
def _rows_kernel(
    X, DX, T, LOSS, SCALE, stride_x, stride_dx, N, V, ignore_index, smoothing, z_loss,
    WANT_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    ok = row_ok[:, None] & (cols < V)[None, :]
    target = tl.load(T + rows64, mask=row_ok, other=ignore_index)
    kept = (target != ignore_index) & row_ok
    valid = kept & (target >= 0) & (target < V)  # a class: the rows that get a loss and a gradient
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=-float("inf")).to(tl.float32)
    # the target's logit read again (the row's lines are on chip), not picked out of the registers by a reduction;
    # before the reductions, whose barriers then order it ahead of any warp's gradient store over it (in place)
    x_t = tl.load(X + rows64 * stride_x + tl.where(valid, target, 0), mask=valid, other=0.0).to(tl.float32)
    m = tl.max(x, axis=1)
    m = tl.where(row_ok, m, 0.0)  # rows past N hold only -inf
    # one multiply-add and ex2 a logit (x · log2(e) overflows only for |x| > 2.3e38, past any trained model's logits)
    e = tl.exp2(x * _LOG2E - (m * _LOG2E)[:, None])
    d = tl.sum(e, axis=1)
    d = tl.where(row_ok, d, 1.0)
    lse = m + tl.log(d)
    if smoothing != 0.0:  # the row sums only where label smoothing needs them
        total = tl.sum(tl.where(ok, x, 0.0), axis=1)
    else:
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
    loss = _row_loss(lse, x_t, total, V, smoothing, z_loss)
    tl.store(LOSS + rows64, tl.where(valid, loss, tl.where(kept, float("nan"), 0.0)), mask=row_ok)
    if WANT_GRAD:
        # per row: the softmax's factor, the smoothing's term and the target's one, each times the scale, so that
        # a logit costs one multiply-add and two selects; rows without a class get zeros whatever their logits
        # hold (a NaN, or all -inf, makes e NaN)
        scale = tl.load(SCALE)
        factor = scale * (1.0 + 2.0 * z_loss * lse) / d
        spread = scale * smoothing / V  # scalars, the same for every row (Triton 3.9 indexes no scalar with [:, None])
        hit = scale * (1.0 - smoothing)
        g = e * factor[:, None] - spread
        # in 32 bits (a 64-bit compare is two instructions a logit); rows without a class never match
        target32 = tl.where(valid, target, -1).to(tl.int32)
        g = tl.where(cols[None, :] == target32[:, None], g - hit, g)
        g = tl.where(valid[:, None], g, 0.0)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], g.to(DX.dtype.element_ty), mask=ok)


@triton.jit
def _chunk(row_ptr, index, cols, V, other, policy: tl.constexpr, BLOCK: tl.constexpr):
    """Chunk ``index`` of a row, in the logits' dtype (a chunk outside the row loads nothing)."""
    offs = index * BLOCK + cols
    return tl.load(row_ptr + offs, mask=(offs >= 0) & (offs < V), other=other, eviction_policy=policy)


@triton.jit
def _chunked_kernel(
    X, DX, T, LOSS, SCALE, stride_x, stride_dx, N, V, ignore_index, smoothing, z_loss,
    WANT_GRAD: tl.constexpr, BLOCK: tl.constexpr, REVERSE: tl.constexpr, KEEP: tl.constexpr,
    DROP: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Rows ``program_id(0)``, ``+ num_programs(0)``, ... walked twice in chunks of ``BLOCK`` columns.

    ``PREFETCH``: both walks load the next chunk before working on the current one, so that a program keeps two
    chunks of loads in flight (Triton pipelines only loads that feed a dot): with it, a persistent grid of one
    program per multiprocessor, whose rows in flight fit in L2, still keeps the memory busy."""
    cols = tl.arange(0, BLOCK)
    chunks = tl.cdiv(V, BLOCK)
    for row in range(tl.program_id(0), N, tl.num_programs(0)):
        row64 = tl.zeros([], dtype=tl.int64) + row  # 64-bit offsets (the loop variable is 32-bit)
        x_row = X + row64 * stride_x
        dx_row = DX + row64 * stride_dx
        target = tl.load(T + row64)
        if (target == ignore_index) | (target < 0) | (target >= V):
            # ignored: loss 0; a target outside the classes: loss NaN (see loss_and_grad); no gradient for either
            tl.store(LOSS + row64, tl.where(target == ignore_index, 0.0, float("nan")))
            if WANT_GRAD:
                for start in range(0, V, BLOCK):
                    offs = start + cols
                    tl.store(dx_row + offs, tl.zeros([BLOCK], dtype=tl.float32).to(DX.dtype.element_ty),
                             mask=offs < V)
        else:
            # pass 1: running max m and running sum d of exp(x - m); the row sum for label smoothing
            # the target's logit first: pass 1's reductions then order its read ahead of pass 2's stores (in place)
            x_t = tl.load(x_row + target).to(tl.float32)
            m = -float("inf")
            d = 0.0
            total = 0.0
            if PREFETCH:
                ahead = _chunk(x_row, 0, cols, V, -float("inf"), KEEP, BLOCK)
            for i in range(chunks):
                if PREFETCH:
                    raw = ahead
                    ahead = _chunk(x_row, i + 1, cols, V, -float("inf"), KEEP, BLOCK)
                else:
                    raw = _chunk(x_row, i, cols, V, -float("inf"), KEEP, BLOCK)
                x = raw.to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, axis=0))
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # leading -inf chunks (a masked vocabulary)
                d = d * tl.exp(m - m_safe) + tl.sum(tl.exp2(x * _LOG2E - m_safe * _LOG2E), axis=0)
                m = m_new
                if smoothing != 0.0:
                    total += tl.sum(tl.where(i * BLOCK + cols < V, x, 0.0), axis=0)
            lse = m + tl.log(d)
            loss = _row_loss(lse, x_t, total, V, smoothing, z_loss)
            tl.store(LOSS + row64, loss)
            if WANT_GRAD:
                # pass 2: the gradient, chunk by chunk, last chunk first (each value is read before it is
                # overwritten when DX is X)
                # as in _rows_kernel: a logit costs two multiply-adds, ex2 and a select
                scale = tl.load(SCALE)
                factor = scale * (1.0 + 2.0 * z_loss * lse)
                spread = scale * smoothing / V
                hit = scale * (1.0 - smoothing)
                lse2 = lse * _LOG2E
                target32 = target.to(tl.int32)  # a class (< V): the chunk's columns compare in 32 bits
                if PREFETCH:
                    ahead = _chunk(x_row, chunks - 1 if REVERSE else 0, cols, V, 0.0, DROP, BLOCK)
                for i in range(chunks):
                    index = chunks - 1 - i if REVERSE else i
                    if PREFETCH:
                        raw = ahead
                        ahead = _chunk(x_row, index - 1 if REVERSE else index + 1, cols, V, 0.0, DROP, BLOCK)
                    else:
                        raw = _chunk(x_row, index, cols, V, 0.0, DROP, BLOCK)
                    offs = index * BLOCK + cols
                    g = tl.exp2(raw.to(tl.float32) * _LOG2E - lse2) * factor - spread
                    g = tl.where(offs == target32, g - hit, g)
                    tl.store(dx_row + offs, g.to(DX.dtype.element_ty), mask=offs < V, eviction_policy=DROP)


_ROWS, _CHUNKED = Kernel(_rows_kernel), Kernel(_chunked_kernel)


def loss_and_grad(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                  z_loss: float, grad_scale: float | torch.Tensor, grad_out: torch.Tensor | None,
                  launch: Launch | None = None) -> torch.Tensor:
    """Per-row losses (float32, 0 for ignored rows) of ``[N, V]`` logits; when ``grad_out`` is given (``[N, V]``,
    unit column stride, may be ``logits`` itself) it receives ``grad_scale · d loss_row / d logits``
    (``grad_scale``: a float, or a one-element float32 tensor on the logits' device, read by the kernel).
    ``launch``: a launch of its own instead of the chosen one (the tuner's for long rows).

    A row whose target is neither ``ignore_index`` nor a class in ``[0, V)`` gets a NaN loss and no gradient, and
    nothing outside its row is read: the check that a compiled or captured graph needs, made by the kernel itself.
    """
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise registry.Unsupported(f"the Triton kernel takes float32, bfloat16 or float16 logits, not {logits.dtype}")
    if logits.stride(-1) != 1:
        raise registry.Unsupported("the Triton kernel needs logits with unit stride along the vocabulary")
    n, v = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return loss
    if not isinstance(grad_scale, torch.Tensor):
        grad_scale = torch.full((1,), float(grad_scale), dtype=torch.float32, device=logits.device)
    sms = multiprocessor_count(logits.device)
    want_grad = grad_out is not None
    dx = grad_out if grad_out is not None else logits

    def run(plan: Launch, x: torch.Tensor, out: torch.Tensor) -> None:
        args = (x, out, target, loss, grad_scale, x.stride(0), out.stride(0), n, v, int(ignore_index),
                float(label_smoothing), float(z_loss))
        if plan.kind == "rows":
            _ROWS.launch((cdiv(n, plan.block),), *args, WANT_GRAD=want_grad, BLOCK_M=plan.block,
                         BLOCK_V=next_power_of_2(v), num_warps=plan.warps)
        else:
            block = min(plan.block, next_power_of_2(v))
            programs = n if plan.per_sm == 0 else min(n, sms * plan.per_sm)
            _CHUNKED.launch((programs,), *args, WANT_GRAD=want_grad, BLOCK=block, REVERSE=plan.reverse,
                            KEEP="evict_last" if plan.evict else "", DROP="evict_first" if plan.evict else "",
                            PREFETCH=plan.prefetch, num_warps=plan.warps)

    run(launch or tuned_launch(logits, dx, run, want_grad), logits, dx)
    return loss


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                reduction: str, z_loss: float, in_place: bool, n_valid: int | None,
                loss_dtype: torch.dtype | None) -> torch.Tensor:
        want_grad = ctx.needs_input_grad[0]
        if want_grad and in_place:
            grad = logits
        elif want_grad:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        else:
            grad = None
        if reduction != "mean":
            scale: float | torch.Tensor = 1.0
        elif n_valid is not None:
            scale = 1.0 / max(n_valid, 1)
        else:  # counted on the device: no host synchronisation, and a CUDA graph can hold the call
            scale = mean_scale(target, ignore_index, logits.shape[1])
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
        return reduce_rows(rows, scale, dtype)

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
                  reduction: str, z_loss: float, in_place: bool, n_valid: int | None,
                  loss_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The op on ``[N, V]`` logits and ``[N]`` targets (checked by the caller); ``n_valid``, the non-ignored rows, is
    counted on the device when None."""
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise registry.Unsupported(f"the Triton kernel takes float32, bfloat16 or float16 logits, not {logits.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _CrossEntropyFunction.apply(logits, target.contiguous(), ignore_index, label_smoothing, reduction, z_loss,
                                       in_place, n_valid, loss_dtype)
