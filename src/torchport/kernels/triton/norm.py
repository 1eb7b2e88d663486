"""RMSNorm and LayerNorm in Triton: one forward kernel, one backward kernel, both norms (``IS_RMS``).

Bytes, forward + backward, for ``M x N`` activations of ``s`` bytes each (weights and per-row statistics are
negligible): the forward reads x and writes y (2·M·N·s), the backward reads x and dy and writes dx (3·M·N·s) —
5·M·N·s in all, the least any implementation can move. For 8192 x 4096 bf16 that is 335.5 MB, 0.111 ms at the
H100's 3022 GB/s copy bandwidth. Measured figures are in ``benchmarks/RESULTS.md``.

Where the time goes in simpler kernels, and what these do instead:

* The weight gradient is a column sum over all rows. The backward runs a persistent grid (a few programs per
  multiprocessor); each program walks its share of rows, keeps its partial column sums in registers, and writes
  them once; one small kernel sums the programs' rows of both gradients and rounds them to the parameters' dtype.
  Nothing re-reads x or dy (PyTorch's eager LayerNorm backward reads both twice). With few programs per SM, each
  loads its next tiles while it computes the current one (``stages``; NVIDIA GPUs, while the tiles fit in shared
  memory): 8-30% less time at 1024-8192 columns on an H200. From 16384 columns the weight is read per tile, not
  held in registers (RMSNorm 16384: 10% less time). The forward (many programs per SM) took 2-8% more time than one
  elementwise pass over its bytes at 1024-16384 columns (``benchmarks/RESULTS.md``, issue 23).
* Short rows (N ≤ 1024) are processed several to a program, so each program still moves a few KiB per step.
* Rows longer than ``MAX_FUSED`` columns do not fit in registers; they, and LayerNorm's backward past half of
  that, take the wide-row kernels of :mod:`.norm_chunked`: a forward that walks each row twice, a backward of two
  kernels (the row sums, then dx and the weight gradients by blocks of columns).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from .. import _autograd, registry
from . import autotune, cdiv, multiprocessor_count, next_power_of_2, rows_view
from .launch import Kernel
from .norm_chunked import (add_weight_gradients, bwd_columns_kernel, bwd_row_sums_kernel, fwd_chunked_kernel,
                           input_gradient, store_weight_gradients)
from .norm_tuning import BACKWARD as _BACKWARD
from .norm_tuning import FORWARD as _FORWARD
from .norm_tuning import backward_launch

__all__ = ["MAX_FUSED", "backward", "layer_norm", "rms_norm"]

MAX_FUSED = 16384  # longest row (elements) held in registers by one program
# From this width the one-kernel backward reads the weight per tile (results/issue23/wide_bwd_h200.json)
_W_RELOAD_WIDTH = tl.constexpr(16384)


@triton.jit
def _fwd_kernel(
    X, W, B, Y, MEAN, RSTD, M, N, stride_x, stride_y, eps, offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(ok, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=row_ok)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    y = xc * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
        y = y * w[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_kernel(
    X, W, DY, DX, MEAN, RSTD, DW, DB, M, N, stride_x, stride_dy, stride_dx, offset, eps,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
    HAS_STATS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W and BLOCK_N < _W_RELOAD_WIDTH:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    # STAGES > 1: the next tiles' x and dy are loaded (through shared memory) while this one is computed
    for block in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=STAGES):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < M
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_STATS:
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            if IS_RMS:
                xhat = x * rstd[:, None]
            else:
                mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
                xhat = tl.where(ok, (x - mean[:, None]) * rstd[:, None], 0.0)
        else:  # the statistics again, as the forward computes them, from the x in registers
            if IS_RMS:
                xc = x
            else:
                xc = tl.where(ok, x - (tl.sum(x, axis=1) / N)[:, None], 0.0)
            rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
            xhat = xc * rstd[:, None]
        if HAS_W:
            if BLOCK_N >= _W_RELOAD_WIDTH:  # read again per tile (from L1/L2): its registers go to the tile
                w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=1) / N
        c2 = c1
        if not IS_RMS:
            c2 = tl.sum(wdy, axis=1) / N
        dx = input_gradient(wdy, xhat, rstd, c1, c2, IS_RMS)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        dw, db = add_weight_gradients(dw, db, dy, xhat, WANT_DW, WANT_DB)
    store_weight_gradients(DW, DB, pid, N, cols, col_ok, dw, db, WANT_DW, WANT_DB)


@triton.jit
def _sum_partials_kernel(DW_P, DB_P, DW, DB, P, N, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """``DW[c] = sum_p DW_P[p, c]`` (and ``DB`` likewise) for this program's ``BLOCK_N`` columns: the weight and bias
    gradients from the backward's per-program partial sums, summed in float32 in a fixed order and stored in the
    parameters' dtype, both in one launch."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    parts = tl.arange(0, BLOCK_P)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        p = start + parts
        ok = (p < P)[:, None] & col_ok[None, :]
        offs = p.to(tl.int64)[:, None] * N + cols[None, :]
        if WANT_DW:
            dw += tl.sum(tl.load(DW_P + offs, mask=ok, other=0.0), axis=0)
        if WANT_DB:
            db += tl.sum(tl.load(DB_P + offs, mask=ok, other=0.0), axis=0)
    if WANT_DW:
        tl.store(DW + cols, dw.to(DW.dtype.element_ty), mask=col_ok)
    if WANT_DB:
        tl.store(DB + cols, db.to(DB.dtype.element_ty), mask=col_ok)


_FWD, _FWD_CHUNKED = Kernel(_fwd_kernel), Kernel(fwd_chunked_kernel)
_SUM_PARTIALS = Kernel(_sum_partials_kernel)
_SUM_TILE = 16384  # partial sums per program of _sum_partials_kernel's one step (64 KiB of float32 per gradient)
_BWD, _BWD_ROW_SUMS, _BWD_COLUMNS = Kernel(_bwd_kernel), Kernel(bwd_row_sums_kernel), Kernel(bwd_columns_kernel)
_ROW_SUMS_BLOCK, _ROW_SUMS_WARPS = 4096, 16  # the wide-row forward walk's best on an H100 at 65536 and 262144


def _launch_forward(config: autotune.Config, rows: torch.Tensor, weight: torch.Tensor | None,
                    bias: torch.Tensor | None, y: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor,
                    eps: float, offset: float, is_rms: bool) -> None:
    m, n = rows.shape
    # Unused pointer arguments get a real tensor: Triton needs a pointer even where a constexpr removes the load.
    args = (rows, weight if weight is not None else rows, bias if bias is not None else rows, y,
            mean if mean is not None else rstd, rstd)
    if n <= MAX_FUSED:
        block_m = config["BLOCK_M"]
        _FWD.launch((cdiv(m, block_m),), *args, m, n, rows.stride(0), n, eps, offset, IS_RMS=is_rms,
                    HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_M=block_m, BLOCK_N=next_power_of_2(n),
                    num_warps=config["num_warps"])
    else:
        _FWD_CHUNKED.launch((m,), *args, n, rows.stride(0), n, eps, offset, IS_RMS=is_rms, HAS_W=weight is not None,
                            HAS_B=bias is not None, BLOCK_N=config["BLOCK_N"], num_warps=config["num_warps"],
                            **_walk(config))


def _walk(config: autotune.Config) -> dict[str, Any]:
    """How a chunked kernel walks a row twice. ``hints`` 1 (the heuristics): the first walk keeps what it loads in
    L2 and the second goes last chunk first, reading and writing with ``evict_first``, as the cross-entropy kernel
    does (:mod:`.cross_entropy`); 0 (a tuner candidate, and configurations cached before the key existed): both
    walks forward, without hints."""
    hints = bool(config.get("hints", 0))
    return {"REVERSE": hints, "KEEP": "evict_last" if hints else "", "DROP": "evict_first" if hints else ""}


def _forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, offset: float,
             is_rms: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    rows = x if x.dim() == 2 and x.stride(1) == 1 else rows_view(x, n)
    m = rows.shape[0]
    device = x.device
    y = torch.empty(x.shape, dtype=x.dtype, device=device)
    mean = None if is_rms else torch.empty(m, dtype=torch.float32, device=device)
    rstd = torch.empty(m, dtype=torch.float32, device=device)
    if m and n:
        tunable = _FORWARD[is_rms, n <= MAX_FUSED]
        args = (rows, weight, bias, y, mean, rstd, eps, offset, is_rms)
        config = tunable.lookup(device, x.dtype, m, n)
        if config is None:  # first launch at these sizes: candidates may write y, mean and rstd, rewritten below
            config = tunable.tune(device, x.dtype, (m, n), lambda c: _launch_forward(c, *args))
        _launch_forward(config, *args)
    return y, mean, rstd, rows


def _wide_backward(n: int, is_rms: bool) -> bool:
    """Whether rows of ``n`` columns take the two-kernel backward of :mod:`.norm_chunked`: those past
    ``MAX_FUSED``, and LayerNorm's past half of it: its one-kernel backward (two weight-gradient rows in registers
    beside the tile) took 0.95 ms at 8192 x 16384 bf16 on an H100, RMSNorm's 0.34; on an H200 reading the weight
    per tile, 445 us against the two kernels' 331."""
    return n > (MAX_FUSED if is_rms else MAX_FUSED // 2)


def _launch_backward(config: autotune.Config, rows: torch.Tensor, weight: torch.Tensor | None, dy_rows: torch.Tensor,
                     dx: torch.Tensor, stats: _Stats, offset: float, want_dw: bool,
                     want_db: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward; returns the per-program partial sums of dweight and dbias (None when not wanted)."""
    m, n = rows.shape
    device = rows.device
    if _wide_backward(n, stats.is_rms):
        return _launch_wide_backward(config, rows, weight, dy_rows, dx, stats, offset, want_dw, want_db)
    block_n = next_power_of_2(n)
    config = backward_launch(config, block_n, rows.element_size() + dy_rows.element_size(), device, stats.is_rms)
    block_m = config["BLOCK_M"]
    programs = min(cdiv(m, block_m), multiprocessor_count(device) * config["per_sm"])
    dw = torch.empty((programs, n), dtype=torch.float32, device=device) if want_dw else None
    db = torch.empty((programs, n), dtype=torch.float32, device=device) if want_db else None
    # Unused pointer arguments get a real tensor: Triton needs a pointer even where a constexpr removes the load.
    rstd = stats.rstd if stats.rstd is not None else dx
    _BWD.launch((programs,), rows, weight if weight is not None else rows, dy_rows, dx,
                stats.mean if stats.mean is not None else rstd, rstd, dw if want_dw else rstd,
                db if want_db else rstd, m, n, rows.stride(0), dy_rows.stride(0), n, offset, stats.eps,
                IS_RMS=stats.is_rms, HAS_W=weight is not None, WANT_DW=want_dw, WANT_DB=want_db,
                HAS_STATS=stats.rstd is not None, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=config.get("stages", 1),
                num_warps=config["num_warps"])
    return dw, db


def _launch_wide_backward(config: autotune.Config, rows: torch.Tensor, weight: torch.Tensor | None,
                          dy_rows: torch.Tensor, dx: torch.Tensor, stats: _Stats, offset: float, want_dw: bool,
                          want_db: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The two kernels of :mod:`.norm_chunked`: the row sums, then dx and the weight gradient by column blocks
    (``config``: ``BLOCK_M`` x ``BLOCK_N`` tiles, ``num_warps``, ``per_sm`` programs per multiprocessor in all)."""
    m, n = rows.shape
    device = rows.device
    sums = torch.empty((5, m), dtype=torch.float32, device=device)
    w = weight if weight is not None else rows
    rstd = stats.rstd if stats.rstd is not None else sums
    # The wide forward saves LayerNorm's mean of the row minus its first value (norm_chunked._row_stats), the
    # fused one the mean itself.
    _BWD_ROW_SUMS.launch((m,), rows, w, dy_rows, stats.mean if stats.mean is not None else rstd, rstd, sums, m, n,
                         rows.stride(0), dy_rows.stride(0), offset, stats.eps, IS_RMS=stats.is_rms,
                         HAS_W=weight is not None, HAS_STATS=stats.rstd is not None, SHIFTED=n > MAX_FUSED,
                         BLOCK_N=_ROW_SUMS_BLOCK, num_warps=_ROW_SUMS_WARPS)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    columns = cdiv(n, block_n)
    groups = max(1, min(cdiv(m, block_m), multiprocessor_count(device) * config["per_sm"] // columns))
    dw = torch.empty((groups, n), dtype=torch.float32, device=device) if want_dw else None
    db = torch.empty((groups, n), dtype=torch.float32, device=device) if want_db else None
    _BWD_COLUMNS.launch((columns, groups), rows, w, dy_rows, dx, sums, dw if want_dw else sums,
                        db if want_db else sums, m, n, rows.stride(0), dy_rows.stride(0), n, offset,
                        IS_RMS=stats.is_rms, HAS_W=weight is not None, WANT_DW=want_dw, WANT_DB=want_db,
                        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=config["num_warps"])
    return dw, db


class _Stats(NamedTuple):
    """A norm's per-row statistics for the backward: the forward's (``rstd``, and ``mean`` for LayerNorm), or
    None when the backward kernel computes them again from x (with ``eps``)."""

    is_rms: bool
    mean: torch.Tensor | None
    rstd: torch.Tensor | None
    eps: float


def _backward(dy: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor | None, stats: _Stats, offset: float,
              want_dw: bool, want_db: bool, in_place: bool,
              dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight, dbias)``; the parameter gradients in ``dtypes`` (the weight's and the bias's)."""
    m, n = rows.shape
    dy_rows = dy if dy.dim() == 2 and dy.stride(1) == 1 else rows_view(dy, n)
    if in_place and dy.is_contiguous():
        dx = dy  # the incoming gradient's memory is reused for dx (see ``rms_norm(..., in_place=True)``)
    else:
        dx = torch.empty(dy.shape, dtype=rows.dtype, device=rows.device)
    if m == 0 or n == 0:
        return (dx, *(torch.zeros(n, dtype=d, device=rows.device) if want else None
                      for want, d in zip((want_dw, want_db), dtypes)))
    device = rows.device
    tunable = _BACKWARD[stats.is_rms, not _wide_backward(n, stats.is_rms)]
    args = (rows, weight, dy_rows, dx, stats, offset, want_dw, want_db)
    config = tunable.lookup(device, rows.dtype, m, n)
    if config is None:
        # Candidates write a scratch dx when dx is dy's memory: dy must reach the final launch intact.
        scratch = args if dx is not dy else (rows, weight, dy_rows, torch.empty_like(dx), *args[4:])
        config = tunable.tune(device, rows.dtype, (m, n), lambda c: _launch_backward(c, *scratch))
    dw, db = _launch_backward(config, *args)
    return (dx, *_totals(dw, db, dtypes))


def _totals(dw: torch.Tensor | None, db: torch.Tensor | None,
            dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sums over programs of the per-program partial sums ``(programs, n)`` of the weight and bias gradients,
    in ``dtypes``: one launch for both (PyTorch's column sum and cast took 10.7 + 1.4 µs for 528 x 256 partials on
    an H100, twice the backward kernel itself). A single float32 row is the sum itself (no launch)."""
    parts = dw if dw is not None else db
    if parts is None:
        return None, None
    programs, n = parts.shape
    if programs == 1 and all(t is None or d == torch.float32 for t, d in zip((dw, db), dtypes)):
        return tuple(None if t is None else t.view(n) for t in (dw, db))  # type: ignore[return-value]
    out = [None if t is None else torch.empty(n, dtype=d, device=t.device) for t, d in zip((dw, db), dtypes)]
    block_p = min(1024, next_power_of_2(programs))
    block_n = min(next_power_of_2(n), max(16, _SUM_TILE // block_p))
    _SUM_PARTIALS.launch((cdiv(n, block_n),), dw if dw is not None else db, db if db is not None else dw,
                         out[0] if out[0] is not None else out[1], out[1] if out[1] is not None else out[0],
                         programs, n, WANT_DW=dw is not None, WANT_DB=db is not None, BLOCK_P=block_p,
                         BLOCK_N=block_n, num_warps=8 if block_p * block_n >= 8192 else 4)
    return out[0], out[1]


class _NormFunction(torch.autograd.Function):
    # One tuple of settings rather than six arguments: apply inspects every argument it is given.
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                settings: tuple[Any, ...]) -> torch.Tensor:
        eps, offset, is_rms = settings[:3]
        y, mean, rstd, rows = _forward(x, weight, bias, eps, offset, is_rms)
        ctx.save_for_backward(rows, weight, bias, mean, rstd)
        ctx.settings = settings
        ctx.shape = x.shape
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        rows, weight, bias, mean, rstd = ctx.saved_tensors
        eps, offset, is_rms, in_place, reference, was_forced = ctx.settings
        shape = ctx.shape
        want_dw = weight is not None and ctx.needs_input_grad[1]
        want_db = bias is not None and ctx.needs_input_grad[2]
        try:
            stats = _Stats(is_rms, mean, rstd, eps)
            dx, dw, db = _backward(dy, rows, weight, stats, offset, want_dw, want_db, in_place,
                                   _grad_dtypes(weight, bias))
        except Exception as exc:
            op = "rms_norm" if is_rms else "layer_norm"
            x = rows.view(shape)
            ref = (lambda x, w, b: reference(x, w, eps, offset)) if is_rms else \
                (lambda x, w, b: reference(x, w, b, eps))
            dx, dw, db = registry.backward_fallback(op, "triton", exc, was_forced, ref, (x, weight, bias), (dy,))
            return dx, dw, db, None
        # A new view, never the incoming tensor itself: autograd then hands it on (or makes it a leaf's .grad)
        # without the copy it makes of a gradient that other references still hold.
        return dx.view(shape), dw, db, None


def _grad_dtypes(weight: torch.Tensor | None, bias: torch.Tensor | None) -> tuple[torch.dtype, torch.dtype]:
    return tuple(torch.float32 if t is None else t.dtype for t in (weight, bias))  # type: ignore[return-value]


def _check_dtype(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise registry.Unsupported(f"the Triton kernel takes float32, bfloat16 or float16, not {t.dtype}")


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels index weight and bias as contiguous vectors (a strided view is copied; autograd follows)."""
    return t if t is None or t.stride(-1) == 1 or t.numel() <= 1 else t.contiguous()


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
             offset: float, is_rms: bool, want_dw: bool,
             want_db: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight, dbias)`` of a norm from its inputs alone: the backward of ``torch.ops.torchport.rms_norm``
    and ``layer_norm`` in a compiled graph, where the forward keeps no statistics. The backward kernel computes
    them again from the x it reads anyway, so this moves the bytes of the eager backward (3·M·N·s)."""
    _check_dtype(x, weight, bias, dy)
    n = x.shape[-1]
    rows = x if x.dim() == 2 and x.stride(1) == 1 else rows_view(x, n)
    weight, bias = _dense(weight), _dense(bias)
    want_dw, want_db = want_dw and weight is not None, want_db and bias is not None
    dx, dw, db = _backward(dy, rows, weight, _Stats(is_rms, None, None, eps), offset, want_dw, want_db, False,
                           _grad_dtypes(weight, bias))
    return dx.view(x.shape), dw, db


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, in_place: bool,
             reference: Callable[..., torch.Tensor]) -> torch.Tensor:
    _check_dtype(x, weight)
    settings = (eps, offset, True, in_place, reference, registry.forced("rms_norm"))
    return _autograd.apply(_NormFunction, x, _dense(weight), None, settings)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               reference: Callable[..., torch.Tensor]) -> torch.Tensor:
    _check_dtype(x, weight, bias)
    settings = (eps, 0.0, False, False, reference, registry.forced("layer_norm"))
    return _autograd.apply(_NormFunction, x, _dense(weight), _dense(bias), settings)
