"""The RMSNorm and LayerNorm kernels for rows longer than :data:`.norm.MAX_FUSED` columns, which do not fit in
registers: each program walks a row in chunks of ``BLOCK_N`` columns, twice.

* Forward: the row's statistics in one pass (RMSNorm's mean square; LayerNorm's mean and variance by Welford's
  method, per lane, merged across lanes), then ``y``.
* Backward: the statistics in one more pass where the forward saved none (a compiled graph's backward), then the
  two row sums of the gradient, then ``dx``. The weight gradient accumulates in a per-program row of partial sums
  in memory (:func:`.norm._total` adds the programs' rows).

The second walk should find the row in L2, or these kernels move half as many bytes again. With ``REVERSE`` and the
eviction policies ``KEEP``/``DROP`` set (:func:`.norm._walk`), the first walk keeps what it loads (``evict_last``)
and the second goes last chunk first, reading and writing with ``evict_first``, as the cross-entropy kernel does
(:mod:`.cross_entropy`); the tuner also times plain forward walks.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bwd_chunked_kernel", "fwd_chunked_kernel"]


@triton.jit
def _welford_combine(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    """Merge two (mean, sum of squared deviations, count) summaries of disjoint parts of a row (Chan et al.)."""
    n = n_a + n_b
    share = n_b / tl.maximum(n, 1.0)
    delta = mean_b - mean_a
    return mean_a + delta * share, m2_a + m2_b + delta * delta * n_a * share, n


@triton.jit
def _row_stats(x_row, N, eps, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr, KEEP: tl.constexpr):
    """``(shift, mean, rstd)`` of one row in one pass over it, loads with eviction policy ``KEEP`` (the caller reads
    the row again); the centred values are ``(x - shift) - mean``.

    RMSNorm: the mean square (shift and mean 0). LayerNorm: Welford's running mean and sum of squared deviations per
    lane, merged across lanes, of the row minus its first value. The shift keeps the mean that the merges round
    of the order of the row's spread, not of its magnitude: a row of mean 4096 and variance 1 in float32 keeps its
    centred values to about 1e-6 of the spread, where a mean rounded at 4096 (spacing 2.4e-4) would lose more.
    """
    if IS_RMS:
        squares = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_row + cols, mask=cols < N, other=0.0, eviction_policy=KEEP).to(tl.float32)
            squares += x * x
        shift = 0.0
        mean = 0.0
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / N + eps)
    else:
        shift = tl.load(x_row).to(tl.float32)
        count = tl.zeros([BLOCK_N], dtype=tl.float32)
        means = tl.zeros([BLOCK_N], dtype=tl.float32)
        m2s = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < N
            x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy=KEEP).to(tl.float32) - shift
            count_new = count + ok.to(tl.float32)
            delta = x - means
            means = tl.where(ok, means + delta / tl.maximum(count_new, 1.0), means)
            m2s = tl.where(ok, m2s + delta * (x - means), m2s)
            count = count_new
        mean, m2, _ = tl.reduce((means, m2s, count), 0, _welford_combine)
        rstd = tl.rsqrt(m2 / N + eps)
    return shift, mean, rstd


@triton.jit
def _chunk_start(i, chunks, BLOCK_N: tl.constexpr, REVERSE: tl.constexpr):
    """Column where step ``i`` of a walk over a row's ``chunks`` chunks starts: last chunk first when ``REVERSE``
    (the chunks the previous walk read last are the likeliest to still be in L2)."""
    if REVERSE:
        return (chunks - 1 - i) * BLOCK_N
    else:
        return i * BLOCK_N


@triton.jit
def fwd_chunked_kernel(
    X, W, B, Y, MEAN, RSTD, N, stride_x, stride_y, eps, offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr,
    REVERSE: tl.constexpr, KEEP: tl.constexpr, DROP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    shift, mean, rstd = _row_stats(x_row, N, eps, IS_RMS, BLOCK_N, KEEP)
    if not IS_RMS:
        tl.store(MEAN + row, mean)  # of the shifted row: the backward loads the shift (the row's first value) again
    tl.store(RSTD + row, rstd)
    chunks = tl.cdiv(N, BLOCK_N)
    for i in range(chunks):
        cols = _chunk_start(i, chunks, BLOCK_N, REVERSE) + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        y = (tl.load(x_row + cols, mask=col_ok, other=0.0, eviction_policy=DROP).to(tl.float32) - shift - mean) * rstd
        if HAS_W:
            y = y * (tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset)
        if HAS_B:
            y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=col_ok, eviction_policy=DROP)


@triton.jit
def bwd_chunked_kernel(
    X, W, DY, DX, MEAN, RSTD, DW, DB, M, N, stride_x, stride_dy, stride_dx, offset, eps,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
    HAS_STATS: tl.constexpr, BLOCK_N: tl.constexpr, REVERSE: tl.constexpr, KEEP: tl.constexpr,
    DROP: tl.constexpr,
):
    pid = tl.program_id(0)
    chunks = tl.cdiv(N, BLOCK_N)
    for row in range(pid, M, tl.num_programs(0)):
        row64 = tl.zeros([], dtype=tl.int64) + row  # 64-bit offsets (the loop variable is 32-bit)
        x_row = X + row64 * stride_x
        dy_row = DY + row64 * stride_dy
        dx_row = DX + row64 * stride_dx
        if HAS_STATS:
            rstd = tl.load(RSTD + row)
            shift = 0.0
            mean = 0.0
            if not IS_RMS:
                shift = tl.load(x_row).to(tl.float32)
                mean = tl.load(MEAN + row)
        else:  # the statistics again, as the forward computes them
            shift, mean, rstd = _row_stats(x_row, N, eps, IS_RMS, BLOCK_N, KEEP)
        c1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        c2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            x = tl.load(x_row + cols, mask=col_ok, other=0.0, eviction_policy=KEEP).to(tl.float32)
            xhat = tl.where(col_ok, (x - shift - mean) * rstd, 0.0)
            wdy = tl.load(dy_row + cols, mask=col_ok, other=0.0, eviction_policy=KEEP).to(tl.float32)
            if HAS_W:
                wdy = wdy * (tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset)
            c1 += xhat * wdy
            c2 += wdy
        c1_row = tl.sum(c1, axis=0) / N
        c2_row = tl.sum(c2, axis=0) / N
        # The second walk reads x and dy again, last chunk first (see _chunk_start), and keeps none of it in L2.
        for i in range(chunks):
            cols = _chunk_start(i, chunks, BLOCK_N, REVERSE) + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            x = tl.load(x_row + cols, mask=col_ok, other=0.0, eviction_policy=DROP).to(tl.float32)
            xhat = tl.where(col_ok, (x - shift - mean) * rstd, 0.0)
            dy = tl.load(dy_row + cols, mask=col_ok, other=0.0, eviction_policy=DROP).to(tl.float32)
            wdy = dy
            if HAS_W:
                wdy = dy * (tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset)
            if IS_RMS:
                dx = (wdy - xhat * c1_row) * rstd
            else:
                dx = (wdy - xhat * c1_row - c2_row) * rstd
            tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=col_ok, eviction_policy=DROP)
            # Each program owns row ``pid`` of the partial sums: no other program touches it, and every row the
            # program walks adds to it (kept in L2).
            if WANT_DW:
                part = DW + pid * N + cols
                tl.store(part, tl.load(part, mask=col_ok, other=0.0, eviction_policy=KEEP) + dy * xhat,
                         mask=col_ok, eviction_policy=KEEP)
            if WANT_DB:
                part = DB + pid * N + cols
                tl.store(part, tl.load(part, mask=col_ok, other=0.0, eviction_policy=KEEP) + dy, mask=col_ok,
                         eviction_policy=KEEP)
