"""int4 weights at 1-16 rows on the tensor cores, the weight as the dot's register operand, two codes decoded by one
logic instruction.

A 16-bit tensor-core operand register holds two values of consecutive K. An int4 word holds eight codes, code ``i``
in bits ``4i..4i+3``; ``(word >> 4i) & 0x000F000F | 0x43004300`` (one ``lop3``) puts codes ``i`` and ``i + 4`` into
the low mantissa bits of the bfloat16 pair ``(128 + c_i, 128 + c_{i+4})`` (``0x6400``, 1024, for float16), exact.
So the kernel multiplies in a K order of its own, the same for both operands: per code position ``i`` (0-3) one dot
over K = 2 x words of the group, whose element ``2j + h`` is code ``i + 4h`` of word ``j``; the activations' tile is
loaded in its natural order and rearranged in registers to match.

The decoded values carry an offset, undone per group in float32: with ``v = c + B`` (B = 128 or 1024) and int4's
``(c - 8 + o) * s``, a group contributes ``s * (sum(v * x) + (o - 8 - B) * sum(x))``. The sums of ``v * x`` are
exact products accumulated in float32 by the tensor cores; ``B`` makes them about 17 (bfloat16) or 130 (float16)
times larger than the centred ones, 4 or 7 of float32's 24 bits. ``sum(x)`` over the group comes from the
activations' tile.

Against the CUDA-core one-row kernel (``lowbit_gemv``): the decode is cheaper (one ``lop3`` per two codes and a
shift per word and position, against a mask, a subtract and a multiply-add per code), but the activations'
rearrangement, the tensor cores' synchronisation and the per-group scaling take the rest: compiled for sm_90, a step
issues 3.9-4.9 instructions per code (128 output features, 4 warps) against the one-row kernel's 4.5. It gains the
rows: 16 cost what one does, where the one-row kernel runs once per row. Measured (RESULTS.md, issue 24): at one row
from 23% slower (k/v) to 9% faster (the down projection) than the tuned one-row kernels (an H200); at 4 and 16 rows
1.2-1.7x faster than the earlier choices on every layer but k/v, where the tuner keeps those (1.72-2.30x bf16 on an
H100's q/o, gate/up and down shapes). The ``lop3`` is PTX, so the decode needs an NVIDIA GPU (``ASM``); elsewhere
(Triton's interpreter, ROCm, float32 activations) the same kernel decodes ``code - 8`` with integer operations,
which needs no offset undone.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .lowbit_decode import split_sum

__all__ = ["int4_mma_kernel"]


@triton.jit
def _codes(w, SHIFT: tl.constexpr, ASM: tl.constexpr, HALF: tl.constexpr):
    """Codes ``SHIFT / 4`` and ``SHIFT / 4 + 4`` of each word of ``w``: ``B + code`` as a bfloat16/float16 pair
    from one ``lop3`` (``ASM``; B = 1024 for float16, else 128), or ``code - 8`` in float32 from integer operations
    (no offset to undo, so float32 activations keep float32's accuracy)."""
    if SHIFT > 0:
        w = w >> SHIFT
    if ASM:
        if HALF:
            low, high = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; mov.b32 {$0, $1}, t; }",
                "=h,=h,r", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            low, high = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$0, $1}, t; }",
                "=h,=h,r", [w], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        low = ((w & 15) - 8).to(tl.float32)
        high = (((w >> 16) & 15) - 8).to(tl.float32)
    return low, high


@triton.jit
def _operand(low, high, BLOCK_N: tl.constexpr, WPG: tl.constexpr):
    """[BLOCK_N, 2 * WPG]: element ``2j + h`` is ``low`` (h = 0) or ``high`` (h = 1) of word ``j``, so that each
    register pair of the tensor-core operand is one ``lop3``'s result."""
    return tl.reshape(tl.join(low, high), (BLOCK_N, 2 * WPG))


@triton.jit
def _activations(x, BLOCK_M: tl.constexpr, WPG: tl.constexpr):
    """[BLOCK_M, WPG, 2] (row, word, h) -> [2 * WPG, BLOCK_M] with element ``2j + h``: the dot's B operand."""
    return tl.reshape(tl.permute(x, (1, 2, 0)), (2 * WPG, BLOCK_M))


@triton.jit
def int4_mma_kernel(x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, W_SPLIT,
                    stride_xm, stride_qn, stride_sn, stride_ym, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ASM: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr, SPLIT: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """Output features ``program_id(0) * BLOCK_N ..`` for the (at most ``BLOCK_M``) rows of ``x``, words
    ``program_id(1) * W_SPLIT ..`` of each weight row (a whole number of groups), one group per step.

    ``PREFETCH``: the next group's scales and offsets are loaded a step ahead (the pipeliner stages the words and
    activations, which feed the dots, but not these). ``SPLIT`` > 1: the partial sums meet in :func:`split_sum`.
    ``EVEN``: ``BLOCK_N`` divides N, so the words load without a mask. ``PRECISION``: the dots' (``ieee`` where
    they multiply float32). ``UPCAST``: the dots run in float32 (Triton's interpreter, whose NumPy arrays have no
    bfloat16 product); otherwise in the activations' dtype, where ``code - 8`` is exact too."""
    WPG: tl.constexpr = GROUP // 8  # int32 words per group
    HALF: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    CENTRE: tl.constexpr = (1032.0 if HALF else 136.0) if ASM else 0.0  # B + 8: what _codes adds to code - 8
    dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    rm = tl.arange(0, BLOCK_M)
    mask_m = rm < M
    j = tl.arange(0, WPG)
    c = tl.arange(0, GROUP)
    w_begin = pid_k * W_SPLIT
    w_end = tl.minimum(K // 8, w_begin + W_SPLIT)
    q_rows = q_ptr + rn[:, None] * stride_qn
    x_rows = x_ptr + rm[:, None] * stride_xm
    s_rows = s_ptr + rn * stride_sn
    o_rows = o_ptr + rn * stride_sn
    g = w_begin // WPG
    if PREFETCH:
        s_next = tl.load(s_rows + g, mask=mask_n, other=0.0)
        o_next = tl.load(o_rows + g, mask=mask_n, other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for w0 in range(w_begin, w_end, WPG):
        if PREFETCH:
            s = s_next.to(tl.float32)
            o = o_next.to(tl.float32)
            ahead = tl.where(w0 + WPG < w_end, mask_n, False)  # a select: see split_sum
            s_next = tl.load(s_rows + g + 1, mask=ahead, other=0.0)
            o_next = tl.load(o_rows + g + 1, mask=ahead, other=0.0)
        else:
            s = tl.load(s_rows + g, mask=mask_n, other=0.0).to(tl.float32)
            o = tl.load(o_rows + g, mask=mask_n, other=0.0).to(tl.float32)
        g += 1
        if EVEN:
            w = tl.load(q_rows + (w0 + j)[None, :])
        else:
            w = tl.load(q_rows + (w0 + j)[None, :], mask=mask_n[:, None], other=0)
        x = tl.load(x_rows + (8 * w0 + c)[None, :], mask=mask_m[:, None], other=0.0)
        # column 8j + 4h + 2a + b of the group is code i = 2a + b (+ 4h) of word j
        xa, xb = tl.split(tl.reshape(x.to(dtype), (BLOCK_M, WPG, 2, 2, 2)))
        x0, x2 = tl.split(xa)
        x1, x3 = tl.split(xb)
        l0, h0 = _codes(w, 0, ASM, HALF)
        l1, h1 = _codes(w, 4, ASM, HALF)
        l2, h2 = _codes(w, 8, ASM, HALF)
        l3, h3 = _codes(w, 12, ASM, HALF)
        part = tl.dot(_operand(l0.to(dtype), h0.to(dtype), BLOCK_N, WPG), _activations(x0, BLOCK_M, WPG),
                      input_precision=PRECISION)
        part = tl.dot(_operand(l1.to(dtype), h1.to(dtype), BLOCK_N, WPG), _activations(x1, BLOCK_M, WPG), part,
                      input_precision=PRECISION)
        part = tl.dot(_operand(l2.to(dtype), h2.to(dtype), BLOCK_N, WPG), _activations(x2, BLOCK_M, WPG), part,
                      input_precision=PRECISION)
        part = tl.dot(_operand(l3.to(dtype), h3.to(dtype), BLOCK_N, WPG), _activations(x3, BLOCK_M, WPG), part,
                      input_precision=PRECISION)
        x_sum = tl.sum(x.to(tl.float32), axis=1)
        acc += s[:, None] * (part + (o - CENTRE)[:, None] * x_sum[None, :])
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT > 1:
        acc, mask = split_sum(acc, rm[None, :] * N + rn[:, None], mask, part_ptr, count_ptr, pid_n, pid_k, M * N,
                              SPLIT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)
