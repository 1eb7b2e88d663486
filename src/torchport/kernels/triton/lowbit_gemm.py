"""A tensor-core GEMM on low-bit weights with the decoding in its B-operand prologue: ``y = x @ dequantise(W).T``.

Each program owns a ``[BLOCK_M, BLOCK_N]`` output tile and walks K in ``BLOCK_K`` steps: it loads the packed codes
and the group scales of ``[BLOCK_N, BLOCK_K]`` weights, decodes them to the activation dtype in registers
(:func:`decode_tile`), and feeds ``tl.dot`` with float32 accumulation. Used for prefill (large tiles, the weight
never written out in bf16: the dequantise-then-matmul route writes and reads back 2 bytes per weight, 33.5 MB for a
4096 x 4096 layer, 16-18 us on an H100 against ~100 us of matmul at 2048 rows) and for 2-16 rows (``BLOCK_M`` 16,
K split over programs with :func:`split_sum`, so that the small layers fill every multiprocessor).

Decoded weights round to the activation dtype as the dense route's do: int8 codes and e4m3/e2m1 values are exact
in bf16 (per-channel scales are applied after the sum), int4's ``(c - 8 + offset) * scale`` and the fp4 formats'
scaled values round once, like ``dequantize_kernel``'s output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .lowbit_decode import FP8, INT8, decode_tile, split_sum

__all__ = ["gemm_kernel"]


@triton.jit
def gemm_kernel(x_ptr, q_ptr, s_ptr, o_ptr, g_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                stride_xm, stride_qn, stride_sn, stride_ym, FORMAT: tl.constexpr, GROUP: tl.constexpr,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                WEIGHT_A: tl.constexpr = False):
    """Tile ``program_id(0)`` (grouped: ``GROUP_M`` row tiles share each weight tile while it is in L2), K range
    ``program_id(1) * K_SPLIT ..`` (a multiple of ``BLOCK_K``).

    ``WEIGHT_A``: the transposed product ``y.T = W · x.T``, the decoded weights as the dot's A operand. Hopper's
    tensor cores (wgmma) take A from registers and only B from shared memory, so the decoded tile feeds them as
    computed, with no store to shared memory and no transpose, and the activations' tiles are the loads the
    pipeline prefetches; the accumulator is ``[BLOCK_N, BLOCK_M]``, transposed once at the store."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < N
    # Dots run in the activations' dtype (tensor cores), or in float32 under Triton's interpreter, whose NumPy
    # arrays have no bfloat16 product.
    dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    if WEIGHT_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(K, k_begin + K_SPLIT)
    x_rows = x_ptr + rm[:, None] * stride_xm
    x_cols = x_ptr + rm[None, :] * stride_xm
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = decode_tile(q_ptr, s_ptr, o_ptr, g_ptr, rn, mask_n, k0, K, stride_qn, stride_sn, FORMAT, GROUP,
                        BLOCK_N, BLOCK_K)
        if WEIGHT_A:
            xt = tl.load(x_cols + k[:, None], mask=(k < K)[:, None] & mask_m[None, :], other=0.0).to(dtype)
            acc += tl.dot(w.to(dtype), xt, input_precision=PRECISION)
        else:
            x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0).to(dtype)
            acc += tl.dot(x, tl.trans(w.to(dtype)), input_precision=PRECISION)
    if WEIGHT_A:
        acc = tl.trans(acc)
    if FORMAT == INT8 or FORMAT == FP8:
        acc = acc * tl.load(s_ptr + rn * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT > 1:
        acc, mask = split_sum(acc, rm[:, None] * N + rn[None, :], mask, part_ptr, count_ptr, pid, pid_k, M * N,
                              SPLIT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
