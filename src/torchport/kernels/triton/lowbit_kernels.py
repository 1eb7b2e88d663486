"""The earlier low-bit matmul kernels, kept as autotuning candidates (:mod:`.lowbit` chooses), and the dequantisation.

* ``gemv8_kernel`` and ``gemv4_kernel``: one row of ``x`` (batch-1 decode) on the CUDA cores, 8-bit codes as bytes,
  4-bit codes in tiles of [rows, groups, words of a group] (issue 11's v4).
* ``matmul_kernel``: up to 16 rows on the tensor cores, weight tiles loaded K-major; split-K with float32 atomics
  when the output features alone give too few programs.
* ``dequantize_kernel``: the dense weight in the activation dtype (2 bytes written per weight, at ~2.4 TB/s).

Per-channel formats (int8, fp8) multiply the scale after the sum: ``x @ (q * s).T == (x @ q.T) * s``; int4 keeps
the sum on the raw codes, ``(q + o) * s`` summed over a group being ``s * (x . q) + s * o * sum(x)``; mxfp4 and
nvfp4 scale each group's codes, and nvfp4's tensor scale is applied at the end.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .lowbit_decode import (FP8, INT4, INT8, MXFP4, NVFP4, E2M1_UNIT, E4M3_UNIT, block_scales, decode_tile, e2m1,
                            e4m3, int8_code, nibble, scaled_t)

__all__ = ["dequantize_kernel", "gemv4_kernel", "gemv8_kernel", "matmul_kernel"]


@triton.jit
def matmul_kernel(x_ptr, q_ptr, s_ptr, o_ptr, g_ptr, b_ptr, y_ptr,
                   M, N, K, K_SPLIT, stride_xm, stride_qn, stride_sn, stride_ym,
                   FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < N
    # Dots run in the activations' dtype (tensor cores), or in float32 under Triton's interpreter, whose NumPy
    # arrays have no bfloat16 product.
    dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_SPLIT
    x_rows = x_ptr + rm[:, None] * stride_xm
    # Weight tiles are loaded K-major, [BLOCK_K, BLOCK_N], so the decoded tile feeds the dot as it is (a transpose of
    # a computed tile would go through shared memory).
    q_cols = q_ptr + rn[None, :] * stride_qn
    if FORMAT == INT8 or FORMAT == FP8:
        for step in range(0, K_SPLIT, BLOCK_K):
            k0 = k_begin + step
            k = k0 + tl.arange(0, BLOCK_K)
            mask_k = k < K
            x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(dtype)
            q = tl.load(q_cols + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
            if FORMAT == INT8:
                w = int8_code(q.to(tl.int32))
            else:
                w = e4m3(q.to(tl.int32) & 255)
            acc += tl.dot(x, w.to(dtype), input_precision=PRECISION)
        scale = tl.load(s_ptr + rn * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
        if FORMAT == FP8:
            scale = scale * E4M3_UNIT
        acc = acc * scale[None, :]
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        for step in range(0, K_SPLIT, BLOCK_K):
            k0 = k_begin + step
            kh = k0 // 2 + tl.arange(0, HALF)
            mask_k = kh < K // 2
            p = tl.load(q_cols + kh[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0).to(tl.int32)
            low = p & 15
            high = (p >> 4) & 15
            x_mask = mask_m[:, None] & mask_k[None, :]
            x_even = tl.load(x_rows + 2 * kh[None, :], mask=x_mask, other=0.0).to(dtype)
            x_odd = tl.load(x_rows + 2 * kh[None, :] + 1, mask=x_mask, other=0.0).to(dtype)
            if FORMAT == INT4:
                # BLOCK_K divides GROUP: the whole block shares one scale and offset per row
                group = k0 // GROUP
                s = tl.load(s_ptr + rn * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
                o = tl.load(o_ptr + rn * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
                dots = tl.dot(x_even, nibble(low).to(dtype), input_precision=PRECISION)
                dots += tl.dot(x_odd, nibble(high).to(dtype), input_precision=PRECISION)
                x_sum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)
                acc += dots * s[None, :] + x_sum[:, None] * (o * s)[None, :]
            else:
                GROUPS: tl.constexpr = BLOCK_K // GROUP
                scale = block_scales(s_ptr, rn, mask_n, stride_sn, k0 // GROUP, K // GROUP, GROUPS, FORMAT)
                scale = tl.trans(scale * E2M1_UNIT)  # [GROUPS, BLOCK_N]: a few values, cheap to move
                w_even = scaled_t(e2m1(low), scale, BLOCK_N, GROUPS, GROUP // 2)
                w_odd = scaled_t(e2m1(high), scale, BLOCK_N, GROUPS, GROUP // 2)
                acc += tl.dot(x_even, w_even.to(dtype), input_precision=PRECISION)
                acc += tl.dot(x_odd, w_odd.to(dtype), input_precision=PRECISION)
        if FORMAT == NVFP4:
            acc = acc * tl.load(g_ptr)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
        if ATOMIC:
            acc += tl.where(pid_k == 0, 1.0, 0.0) * bias[None, :]
        else:
            acc += bias[None, :]
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:
        tl.atomic_add(y, acc, mask=mask, sem="relaxed")
    else:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemv8_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, N, K, stride_qn, stride_sn,
                  FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row of ``x`` (batch-1 decode) against 8-bit codes: products summed on the CUDA cores, no tensor-core tile
    to stage. Each program owns ``BLOCK_N`` output features and walks all of K, so no split and no atomics."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    q_rows = q_ptr + rn[:, None] * stride_qn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < K
        x = tl.load(x_ptr + k, mask=mask_k, other=0.0).to(tl.float32)
        q = tl.load(q_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0).to(tl.int32)
        if FORMAT == INT8:
            w = int8_code(q)
        else:
            w = e4m3(q & 255)
        acc += w * x[None, :]
    scale = tl.load(s_ptr + rn * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
    if FORMAT == FP8:
        scale = scale * E4M3_UNIT
    total = tl.sum(acc, axis=1) * scale
    if HAS_BIAS:
        total += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, total.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _split8(x, GROUPS: tl.constexpr, WPG: tl.constexpr):
    """``x`` [GROUPS * WPG * 8] -> the eight [GROUPS, WPG] tensors of its elements ``8w + i``, i = 0..7 (register
    moves: each thread holds eight neighbours after a 16-byte load)."""
    a, b = tl.split(tl.reshape(x, (GROUPS, WPG, 4, 2)))  # a: i = 0, 2, 4, 6; b: i = 1, 3, 5, 7
    a0, a1 = tl.split(tl.reshape(a, (GROUPS, WPG, 2, 2)))  # a0: i = 0, 4; a1: i = 2, 6
    b0, b1 = tl.split(tl.reshape(b, (GROUPS, WPG, 2, 2)))  # b0: i = 1, 5; b1: i = 3, 7
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _code_times(w, x, SHIFT: tl.constexpr, FORMAT: tl.constexpr):
    """The code in bits SHIFT..SHIFT+3 of each word of ``w`` [BN, GROUPS, WPG], decoded, times ``x`` [GROUPS, WPG]."""
    code = (w >> SHIFT) & 15
    if FORMAT == INT4:
        value = nibble(code)
    else:
        value = e2m1(code)
    return value * x[None, :, :]


@triton.jit
def gemv4_kernel(x_ptr, q_ptr, s_ptr, o_ptr, g_ptr, b_ptr, y_ptr, N, K, stride_qn, stride_sn,
                  FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row of ``x`` against 4-bit codes read as int32 words (eight codes each, column ``8w + i`` in bits
    ``4i..4i+3``). Tiles are [rows, groups, words of a group]: whole 16-byte loads, one shift-and-mask per code,
    ``x`` read once per tile with vector loads, and one scale (and offset) load per row and group."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    WPG: tl.constexpr = GROUP // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    g = tl.arange(0, GROUPS)
    j = tl.arange(0, WPG)
    n_groups = K // GROUP
    acc = tl.zeros((BLOCK_N, GROUPS, WPG), dtype=tl.float32)
    acc_offset = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for g0 in range(0, n_groups, GROUPS):
        mask_g = (g0 + g) < n_groups
        word = (g0 + g)[:, None] * WPG + j[None, :]
        mask = mask_n[:, None, None] & mask_g[None, :, None]
        w = tl.load(q_ptr + rn[:, None, None] * stride_qn + word[None, :, :], mask=mask, other=0)
        k = g0 * GROUP + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x, GROUPS, WPG)
        part = _code_times(w, x0, 0, FORMAT) + _code_times(w, x1, 4, FORMAT)
        part += _code_times(w, x2, 8, FORMAT) + _code_times(w, x3, 12, FORMAT)
        part += _code_times(w, x4, 16, FORMAT) + _code_times(w, x5, 20, FORMAT)
        part += _code_times(w, x6, 24, FORMAT) + _code_times(w, x7, 28, FORMAT)
        s_off = rn[:, None] * stride_sn + (g0 + g)[None, :]
        s_mask = mask_n[:, None] & mask_g[None, :]
        if FORMAT == INT4:
            s = tl.load(s_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
            x_sums = tl.sum(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, axis=1)
            acc_offset += o * s * x_sums[None, :]
        else:
            raw = tl.load(s_ptr + s_off, mask=s_mask, other=0).to(tl.int32) & 255
            if FORMAT == MXFP4:
                s = (raw << 23).to(tl.float32, bitcast=True)
            else:
                s = e4m3(raw)
        acc += part * s[:, :, None]
    total = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(acc_offset, axis=1)
    if FORMAT == MXFP4:
        total = total * E2M1_UNIT
    if FORMAT == NVFP4:
        total = total * (E2M1_UNIT * E4M3_UNIT) * tl.load(g_ptr)
    if HAS_BIAS:
        total += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, total.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def dequantize_kernel(q_ptr, s_ptr, o_ptr, g_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn,
                      FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    k0 = tl.program_id(1) * BLOCK_K
    w = decode_tile(q_ptr, s_ptr, o_ptr, g_ptr, rn, mask_n, k0, K, stride_qn, stride_sn, FORMAT, GROUP, BLOCK_N,
                    BLOCK_K)
    if FORMAT == INT8 or FORMAT == FP8:
        w = w * tl.load(s_ptr + rn * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rn[:, None] * stride_wn + k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=mask_n[:, None] & (k < K)[None, :])
