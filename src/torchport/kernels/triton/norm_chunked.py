"""The RMSNorm and LayerNorm kernels for rows longer than :data:`.norm.MAX_FUSED` columns, which do not fit in
registers.

* Forward, one program per row walking it in chunks of ``BLOCK_N`` columns, twice: the row's statistics in one
  pass (RMSNorm's mean square; LayerNorm's mean and variance by Welford's method, per lane, merged across lanes),
  then ``y``. The second walk should find the row in L2, or the kernel moves half as many bytes again: with
  ``REVERSE`` and the eviction policies ``KEEP``/``DROP`` set (:func:`.norm._walk`), the first walk keeps what it
  loads (``evict_last``) and the second goes last chunk first, reading and writing with ``evict_first``, as the
  cross-entropy kernel does (:mod:`.cross_entropy`); the tuner also times plain forward walks.
* Backward, two kernels. :func:`bwd_row_sums_kernel` reads x and dy once per row for the two row sums that every
  dx of the row needs (and x once more for the statistics where the forward saved none);
  :func:`bwd_columns_kernel` then reads x and dy again in tiles of rows by a block of columns and writes dx,
  keeping its columns' weight gradient in registers across its rows. For M x N activations of s bytes that is
  5·M·N·s (6·M·N·s without saved statistics) against the 3·M·N·s a backward must move. A single kernel walking
  each row twice moves the same when its second walk misses L2, which it does at these widths (the rows in flight
  outgrow the 50 MiB L2 of an H100), and must also add each row into a per-program weight-gradient buffer in
  memory: 4·M·N more bytes each way, which measured three times the least time at 65536 columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["add_weight_gradients", "bwd_columns_kernel", "bwd_row_sums_kernel", "fwd_chunked_kernel", "input_gradient",
           "store_weight_gradients"]


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
def input_gradient(wdy, xhat, rstd, c1, c2, IS_RMS: tl.constexpr):
    """dx of a tile of rows from ``w·dy``, ``xhat``, each row's ``rstd`` and its row means ``c1 = mean(xhat·w·dy)``
    and ``c2 = mean(w·dy)`` (LayerNorm only); shared with the one-kernel backward of :mod:`.norm`."""
    dx = wdy - xhat * c1[:, None]
    if not IS_RMS:
        dx = dx - c2[:, None]
    return dx * rstd[:, None]


@triton.jit
def add_weight_gradients(dw, db, dy, xhat, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr):
    """A tile's column sums added to the weight and bias gradients a program keeps in registers."""
    if WANT_DW:
        dw += tl.sum(dy * xhat, axis=0)
    if WANT_DB:
        db += tl.sum(dy, axis=0)
    return dw, db


@triton.jit
def store_weight_gradients(DW, DB, row, N, cols, col_ok, dw, db, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr):
    """A program's weight and bias gradients, into its ``row`` of the partial sums."""
    if WANT_DW:
        tl.store(DW + row * N + cols, dw, mask=col_ok)
    if WANT_DB:
        tl.store(DB + row * N + cols, db, mask=col_ok)


@triton.jit
def bwd_row_sums_kernel(
    X, W, DY, MEAN, RSTD, SUMS, M, N, stride_x, stride_dy, offset, eps,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_STATS: tl.constexpr, SHIFTED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The backward's first kernel, one program per row: the row's ``shift``, ``mean``, ``rstd`` (the forward's, or
    computed again where it saved none) and the two row means of the gradient, ``c1 = mean(xhat·w·dy)`` and
    ``c2 = mean(w·dy)``, into ``SUMS[k * M + row]`` for k = 0..4 (float32). ``SHIFTED``: the saved LayerNorm mean
    is that of the row minus its first value (what :func:`fwd_chunked_kernel` saves), not the row's own."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    dy_row = DY + row * stride_dy
    if HAS_STATS:
        rstd = tl.load(RSTD + row)
        shift = 0.0
        mean = 0.0
        if not IS_RMS:
            if SHIFTED:
                shift = tl.load(x_row).to(tl.float32)
            mean = tl.load(MEAN + row)
    else:  # the statistics again, as the forward computes them
        shift, mean, rstd = _row_stats(x_row, N, eps, IS_RMS, BLOCK_N, "")
    c1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    c2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        xhat = tl.where(col_ok, (x - shift - mean) * rstd, 0.0)
        wdy = tl.load(dy_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_W:
            wdy = wdy * (tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset)
        c1 += xhat * wdy
        c2 += wdy
    tl.store(SUMS + row, shift)
    tl.store(SUMS + M + row, mean)
    tl.store(SUMS + 2 * M + row, rstd)
    tl.store(SUMS + 3 * M + row, tl.sum(c1, axis=0) / N)
    tl.store(SUMS + 4 * M + row, tl.sum(c2, axis=0) / N)


@triton.jit
def bwd_columns_kernel(
    X, W, DY, DX, SUMS, DW, DB, M, N, stride_x, stride_dy, stride_dx, offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The backward's second kernel: program ``(j, r)`` owns columns ``[j·BLOCK_N, (j+1)·BLOCK_N)`` and every
    ``R``-th block of ``BLOCK_M`` rows from block ``r`` (``R`` = the grid's second size). It writes those rows' dx
    from the row sums of :func:`bwd_row_sums_kernel`, keeps its columns' weight and bias gradients in registers
    over all its rows, and writes them once, into row ``r`` of the partial sums."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    r = tl.program_id(1)
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(r, tl.cdiv(M, BLOCK_M), tl.num_programs(1)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < M
        ok = row_ok[:, None] & col_ok[None, :]
        shift = tl.load(SUMS + rows, mask=row_ok, other=0.0)
        mean = tl.load(SUMS + M + rows, mask=row_ok, other=0.0)
        rstd = tl.load(SUMS + 2 * M + rows, mask=row_ok, other=0.0)
        c1 = tl.load(SUMS + 3 * M + rows, mask=row_ok, other=0.0)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        xhat = tl.where(ok, (x - shift[:, None] - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c2 = c1
        if not IS_RMS:
            c2 = tl.load(SUMS + 4 * M + rows, mask=row_ok, other=0.0)
        dx = input_gradient(wdy, xhat, rstd, c1, c2, IS_RMS)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        dw, db = add_weight_gradients(dw, db, dy, xhat, WANT_DW, WANT_DB)
    store_weight_gradients(DW, DB, r, N, cols, col_ok, dw, db, WANT_DW, WANT_DB)
