"""Low-bit weight matmul in Triton: ``y = x @ dequantise(W).T (+ bias)`` with the dequantisation fused in.

Decode (few rows, M <= 16) is bound by reading the weight: an 8B-shaped Llama reads 15.0 GB of bf16 weights per
token, 7.5 GB in int8/fp8 and about 4 GB in 4-bit formats, which is the whole speed-up low-bit weights can give at
batch 1 (4.95 ms -> 1.3 ms per token at the H100's 3022 GB/s). So the fused kernel reads each weight byte once,
decodes it in registers and feeds the tensor cores; ``x`` is tiny and stays in cache. Each program owns a block of
output features and a slice of the input features (split-K with float32 atomics when the output alone gives too
few programs to fill the GPU).

* Per-channel formats (int8, fp8) multiply the scale after the dot: ``x @ (q * s).T == (x @ q.T) * s``.
* int4 with one group per K block also keeps the dot on the raw codes: ``(q + o) * s`` summed over a group is
  ``s * (x . q) + s * o * sum(x)``.
* mxfp4 and nvfp4 (blocks of 32 and 16) scale each code before the dot; nvfp4's tensor scale is applied at the end.
* 4-bit codes are not unpacked into one tile: the even columns of ``x`` meet the low nibbles and the odd columns
  the high nibbles, two dots of half the depth, so no register shuffle is needed.
* fp8 codes are read as bytes and decoded with integer arithmetic, which also runs under Triton's interpreter.

More rows (prefill) dequantise the weight once into the activation dtype with :func:`dequantize` and leave the
matmul to the vendor library: for a 4096 x 14336 layer at 2048 rows the dense matmul is ~0.34 ms on an H100 and
the dequantisation, which moves 2.5 bytes per weight, ~0.05 ms.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from . import autotune, cdiv, multiprocessor_count, next_power_of_2

__all__ = ["FORMAT_IDS", "dequantize", "matmul", "supports"]

FORMAT_IDS = {"int8": 0, "fp8": 1, "int4": 2, "mxfp4": 3, "nvfp4": 4}
_INT8, _FP8, _INT4, _MXFP4, _NVFP4 = (tl.constexpr(v) for v in range(5))


# Decoding without int-to-float conversions (a quarter-rate instruction on recent GPUs, which would cap the decode
# kernel below memory bandwidth): codes are placed into the bits of a float whose value is then exact.
@triton.jit
def _nibble(code):
    """int32 in [0, 15] -> float32 ``code - 8``: 2^23 + code read as a float, minus 2^23 + 8 (both exact)."""
    return (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _int8(byte):
    """int8 codes (sign-extended to int32) -> float32, by the same 2^23 trick on ``code + 128``."""
    return ((byte + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


E2M1_UNIT = tl.constexpr(16384.0)  # _e2m1 returns value / 2^14
E4M3_UNIT = tl.constexpr(256.0)  # _e4m3 returns value / 2^8


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32 in [0, 15]) -> float32 value / 2^14: the code's exponent and mantissa bits land in a
    float16's low exponent and top mantissa bits, and subnormals (code 1 = 0.5) come out right too."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(byte):
    """float8 e4m3fn bytes (int32 in [0, 255]) -> float32 value / 2^8, through float16 bits as in :func:`_e2m1`."""
    bits = ((byte & 0x7F) << 7) | ((byte & 0x80) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _block_scales(s_ptr, rn, mask_n, stride_sn, group0, n_groups, GROUPS: tl.constexpr, FORMAT: tl.constexpr):
    """The float32 scales of ``GROUPS`` consecutive groups for the rows ``rn``: ``[BLOCK_N, GROUPS]``."""
    g = group0 + tl.arange(0, GROUPS)
    mask = mask_n[:, None] & (g < n_groups)[None, :]
    raw = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=mask, other=0).to(tl.int32)
    if FORMAT == _MXFP4:
        scale = ((raw & 255) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127); e = 0 (2^-127) reads as 0
    else:
        scale = _e4m3(raw & 255) * E4M3_UNIT
    return scale


@triton.jit
def _scaled(values, scale, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HALF_GROUP: tl.constexpr):
    """``values`` [BLOCK_N, GROUPS * HALF_GROUP] times each group's scale."""
    v = tl.reshape(values, (BLOCK_N, GROUPS, HALF_GROUP)) * scale[:, :, None]
    return tl.reshape(v, (BLOCK_N, GROUPS * HALF_GROUP))


@triton.jit
def _scaled_t(values, scale, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HALF_GROUP: tl.constexpr):
    """``values`` [GROUPS * HALF_GROUP, BLOCK_N] (K-major) times each group's scale ``scale`` [GROUPS, BLOCK_N]."""
    v = tl.reshape(values, (GROUPS, HALF_GROUP, BLOCK_N)) * scale[:, None, :]
    return tl.reshape(v, (GROUPS * HALF_GROUP, BLOCK_N))


@triton.jit
def _affine(values, scale, offset, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HALF_GROUP: tl.constexpr):
    """``(values + offset) * scale`` with one offset and scale per group of ``values`` [BLOCK_N, GROUPS * HALF_GROUP]."""
    v = (tl.reshape(values, (BLOCK_N, GROUPS, HALF_GROUP)) + offset[:, :, None]) * scale[:, :, None]
    return tl.reshape(v, (BLOCK_N, GROUPS * HALF_GROUP))


@triton.jit
def _matmul_kernel(x_ptr, q_ptr, s_ptr, o_ptr, g_ptr, b_ptr, y_ptr,
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
    if FORMAT == _INT8 or FORMAT == _FP8:
        for step in range(0, K_SPLIT, BLOCK_K):
            k0 = k_begin + step
            k = k0 + tl.arange(0, BLOCK_K)
            mask_k = k < K
            x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(dtype)
            q = tl.load(q_cols + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
            if FORMAT == _INT8:
                w = _int8(q.to(tl.int32))
            else:
                w = _e4m3(q.to(tl.int32) & 255)
            acc += tl.dot(x, w.to(dtype), input_precision=PRECISION)
        scale = tl.load(s_ptr + rn * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
        if FORMAT == _FP8:
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
            if FORMAT == _INT4:
                # BLOCK_K divides GROUP: the whole block shares one scale and offset per row
                group = k0 // GROUP
                s = tl.load(s_ptr + rn * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
                o = tl.load(o_ptr + rn * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
                dots = tl.dot(x_even, _nibble(low).to(dtype), input_precision=PRECISION)
                dots += tl.dot(x_odd, _nibble(high).to(dtype), input_precision=PRECISION)
                x_sum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)
                acc += dots * s[None, :] + x_sum[:, None] * (o * s)[None, :]
            else:
                GROUPS: tl.constexpr = BLOCK_K // GROUP
                scale = _block_scales(s_ptr, rn, mask_n, stride_sn, k0 // GROUP, K // GROUP, GROUPS, FORMAT)
                scale = tl.trans(scale * E2M1_UNIT)  # [GROUPS, BLOCK_N]: a few values, cheap to move
                w_even = _scaled_t(_e2m1(low), scale, BLOCK_N, GROUPS, GROUP // 2)
                w_odd = _scaled_t(_e2m1(high), scale, BLOCK_N, GROUPS, GROUP // 2)
                acc += tl.dot(x_even, w_even.to(dtype), input_precision=PRECISION)
                acc += tl.dot(x_odd, w_odd.to(dtype), input_precision=PRECISION)
        if FORMAT == _NVFP4:
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
def _gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, g_ptr, b_ptr, y_ptr, N, K, stride_qn, stride_sn,
                 FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row of ``x`` (batch-1 decode): products summed on the CUDA cores, no tensor-core tile to stage. Each
    program owns ``BLOCK_N`` output features and walks all of K, so no split and no atomics are needed."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    q_rows = q_ptr + rn[:, None] * stride_qn
    if FORMAT == _INT8 or FORMAT == _FP8:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            mask_k = k < K
            x = tl.load(x_ptr + k, mask=mask_k, other=0.0).to(tl.float32)
            q = tl.load(q_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0).to(tl.int32)
            if FORMAT == _INT8:
                w = _int8(q)
            else:
                w = _e4m3(q & 255)
            acc2 += w * x[None, :]
        scale = tl.load(s_ptr + rn * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
        if FORMAT == _FP8:
            scale = scale * E4M3_UNIT
        acc = tl.sum(acc2, axis=1) * scale
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        acc2 = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kh = k0 // 2 + tl.arange(0, HALF)
            mask_k = kh < K // 2
            p = tl.load(q_rows + kh[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0).to(tl.int32)
            x_even = tl.load(x_ptr + 2 * kh, mask=mask_k, other=0.0).to(tl.float32)
            x_odd = tl.load(x_ptr + 2 * kh + 1, mask=mask_k, other=0.0).to(tl.float32)
            if FORMAT == _INT4:
                # (q - 8 + o) * s summed over a group = s * sum((q - 8) x) + s * o * sum(x)
                part = _nibble(p & 15) * x_even[None, :] + _nibble(p >> 4) * x_odd[None, :]
                if BLOCK_K >= GROUP:
                    GROUPS: tl.constexpr = BLOCK_K // GROUP
                    g = k0 // GROUP + tl.arange(0, GROUPS)
                    g_mask = mask_n[:, None] & (g < K // GROUP)[None, :]
                    s = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=g_mask, other=0.0).to(tl.float32)
                    o = tl.load(o_ptr + rn[:, None] * stride_sn + g[None, :], mask=g_mask, other=0.0).to(tl.float32)
                    acc2 += _scaled(part, s, BLOCK_N, GROUPS, GROUP // 2)
                    x_sums = tl.sum(tl.reshape(x_even + x_odd, (GROUPS, GROUP // 2)), axis=1)
                    acc += tl.sum(o * s * x_sums[None, :], axis=1)
                else:  # the block lies inside one group
                    group = k0 // GROUP
                    s = tl.load(s_ptr + rn * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
                    o = tl.load(o_ptr + rn * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
                    acc2 += part * s[:, None]
                    acc += o * s * tl.sum(x_even + x_odd, axis=0)
            else:
                GROUPS: tl.constexpr = BLOCK_K // GROUP
                scale = _block_scales(s_ptr, rn, mask_n, stride_sn, k0 // GROUP, K // GROUP, GROUPS, FORMAT)
                part = _e2m1(p & 15) * x_even[None, :] + _e2m1((p >> 4) & 15) * x_odd[None, :]
                acc2 += _scaled(part, scale, BLOCK_N, GROUPS, GROUP // 2)
        acc += tl.sum(acc2, axis=1)
        if FORMAT == _MXFP4 or FORMAT == _NVFP4:
            acc = acc * E2M1_UNIT
        if FORMAT == _NVFP4:
            acc = acc * tl.load(g_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


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
    if FORMAT == _INT4:
        value = _nibble(code)
    else:
        value = _e2m1(code)
    return value * x[None, :, :]


@triton.jit
def _gemv4_kernel(x_ptr, q_ptr, s_ptr, o_ptr, g_ptr, b_ptr, y_ptr, N, K, stride_qn, stride_sn,
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
        if FORMAT == _INT4:
            s = tl.load(s_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
            x_sums = tl.sum(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7, axis=1)
            acc_offset += o * s * x_sums[None, :]
        else:
            raw = tl.load(s_ptr + s_off, mask=s_mask, other=0).to(tl.int32) & 255
            if FORMAT == _MXFP4:
                s = (raw << 23).to(tl.float32, bitcast=True)
            else:
                s = _e4m3(raw)
        acc += part * s[:, :, None]
    total = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(acc_offset, axis=1)
    if FORMAT == _MXFP4:
        total = total * E2M1_UNIT
    if FORMAT == _NVFP4:
        total = total * (E2M1_UNIT * E4M3_UNIT) * tl.load(g_ptr)
    if HAS_BIAS:
        total += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, total.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, o_ptr, g_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn,
                       FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    k0 = tl.program_id(1) * BLOCK_K
    dtype = w_ptr.dtype.element_ty
    if FORMAT == _INT8 or FORMAT == _FP8:
        k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (k < K)[None, :]
        q = tl.load(q_ptr + rn[:, None] * stride_qn + k[None, :], mask=mask, other=0)
        if FORMAT == _INT8:
            w = _int8(q.to(tl.int32))
        else:
            w = _e4m3(q.to(tl.int32) & 255) * E4M3_UNIT
        s = tl.load(s_ptr + rn * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(w_ptr + rn[:, None] * stride_wn + k[None, :], (w * s[:, None]).to(dtype), mask=mask)
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        kh = k0 // 2 + tl.arange(0, HALF)
        mask = mask_n[:, None] & (kh < K // 2)[None, :]
        p = tl.load(q_ptr + rn[:, None] * stride_qn + kh[None, :], mask=mask, other=0).to(tl.int32)
        low = p & 15
        high = (p >> 4) & 15
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        if FORMAT == _INT4:
            g = k0 // GROUP + tl.arange(0, GROUPS)
            g_mask = mask_n[:, None] & (g < K // GROUP)[None, :]
            s = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=g_mask, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + rn[:, None] * stride_sn + g[None, :], mask=g_mask, other=0.0).to(tl.float32)
            w_even = _affine(_nibble(low), s, o, BLOCK_N, GROUPS, GROUP // 2)
            w_odd = _affine(_nibble(high), s, o, BLOCK_N, GROUPS, GROUP // 2)
        else:
            scale = _block_scales(s_ptr, rn, mask_n, stride_sn, k0 // GROUP, K // GROUP, GROUPS, FORMAT)
            scale = scale * E2M1_UNIT
            if FORMAT == _NVFP4:
                scale = scale * tl.load(g_ptr)
            w_even = _scaled(_e2m1(low), scale, BLOCK_N, GROUPS, GROUP // 2)
            w_odd = _scaled(_e2m1(high), scale, BLOCK_N, GROUPS, GROUP // 2)
        w = tl.reshape(tl.join(w_even, w_odd), (BLOCK_N, BLOCK_K))
        k = k0 + tl.arange(0, BLOCK_K)
        tl.store(w_ptr + rn[:, None] * stride_wn + k[None, :], w.to(dtype), mask=mask_n[:, None] & (k < K)[None, :])


# -- launch configurations -----------------------------------------------------------------------------------------
_PER_CHANNEL = ("int8", "fp8")


def supports(fmt: str, group: int, k: int) -> str | None:
    """Why the kernels cannot take this layout (None when they can): Triton tiles are powers of two."""
    if fmt in _PER_CHANNEL:
        return None
    if group & (group - 1) or group < (32 if fmt == "int4" else 16):
        return f"the Triton kernels need a power-of-two group of at least 32 for {fmt}; this layer has {group}"
    return None


def _bucket(m: int, n: int, k: int, group: int) -> tuple[int, int, int, int]:
    return next_power_of_2(m), next_power_of_2(n), next_power_of_2(k), group


def _candidates(fmt: str, m: int, n: int, k: int, group: int) -> list[autotune.Config]:
    """Output-feature block, K block and warps; the heuristic first. The K split is derived at launch so that
    (n-blocks x splits) gives every multiprocessor about four programs."""
    configs = []
    for block_n, block_k, warps in ((32, 256, 4), (16, 256, 4), (64, 128, 4), (32, 512, 8), (16, 512, 4),
                                    (64, 256, 8)):
        configs.append({"BLOCK_N": block_n, "BLOCK_K": _block_k(fmt, block_k, k, group), "num_warps": warps})
    return autotune.distinct(configs)


def _gemv_bucket(n: int, k: int, group: int) -> tuple[int, int, int]:
    return next_power_of_2(n), next_power_of_2(k), group


def _block_k(fmt: str, block_k: int, k: int, group: int) -> int:
    """A K block for ``k`` columns: int4 needs one group per block (BLOCK_K divides the group); the fp4 blocks
    (16, 32) divide any BLOCK_K >= 32; per-channel formats take any."""
    block_k = min(block_k, max(32, next_power_of_2(k)))
    return min(block_k, group) if fmt == "int4" else block_k


def _gemv_candidates(fmt: str, n: int, k: int, group: int) -> list[autotune.Config]:
    """Rows per program, K block, warps and pipeline stages; the heuristic first. Few rows (k/v projections) take
    long K blocks so that enough bytes are in flight."""
    if n <= 2048:
        shapes = ((2, 2048, 4, 3), (4, 2048, 8, 3), (1, 2048, 4, 3), (2, 4096, 8, 3), (4, 1024, 4, 3), (2, 2048, 4, 4))
    else:
        shapes = ((4, 1024, 4, 3), (2, 2048, 4, 3), (4, 2048, 8, 3), (2, 1024, 2, 3), (4, 1024, 4, 4), (8, 1024, 8, 3))
    configs = [{"BLOCK_N": block_n, "BLOCK_K": min(block_k, max(32, next_power_of_2(k))), "num_warps": warps,
                "num_stages": stages} for block_n, block_k, warps, stages in shapes]
    return autotune.distinct(configs)


_TUNED = {fmt: autotune.Tunable(f"lowbit_matmul.{fmt}", ("m", "n", "k", "group"), _bucket,
                                functools.partial(_candidates, fmt)) for fmt in FORMAT_IDS}
_TUNED_GEMV = {fmt: autotune.Tunable(f"lowbit_gemv.{fmt}", ("n", "k", "group"), _gemv_bucket,
                                     functools.partial(_gemv_candidates, fmt)) for fmt in FORMAT_IDS}


def _split_k(block_n: int, block_k: int, m_blocks: int, n: int, k: int, device: torch.device) -> int:
    programs = m_blocks * cdiv(n, block_n)
    target = 4 * multiprocessor_count(device)
    split = 1
    while programs * split * 2 <= target and k // (split * 2) >= 4 * block_k:
        split *= 2
    return split


def _as_bytes(fmt: str, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 codes (fp8) and block scales (nvfp4) as their bytes: the kernels decode the bits themselves."""
    if fmt == "fp8":
        q = q.view(torch.uint8)
    if fmt == "nvfp4":
        scale = scale.view(torch.uint8)
    return q, scale


def _kernel_group(fmt: str, group: int) -> int:
    return 1 if fmt in _PER_CHANNEL else group  # per-channel formats: one constant, not one compile per width


def _launch(config: autotune.Config, x: torch.Tensor, t: dict[str, Any], fmt: str, group: int,
            bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    q, scale = t["qweight"], t["scale"]
    n = q.shape[0]
    block_m, block_n, block_k = 16, config["BLOCK_N"], config["BLOCK_K"]
    m_blocks = cdiv(m, block_m)
    split = _split_k(block_n, block_k, m_blocks, n, k, x.device)
    k_split = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_split)
    atomic = split > 1
    y = torch.zeros((m, n), dtype=torch.float32, device=x.device) if atomic else x.new_empty((m, n))
    q, scale = _as_bytes(fmt, q, scale)
    _matmul_kernel[(cdiv(n, block_n), split, m_blocks)](
        x, q, scale, t.get("offset", scale), t.get("global_scale", scale), scale if bias is None else bias, y,
        m, n, k, k_split, x.stride(0), q.stride(0), scale.stride(0), y.stride(0),
        FORMAT=FORMAT_IDS[fmt], GROUP=_kernel_group(fmt, group), HAS_BIAS=bias is not None, ATOMIC=atomic,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=x.device.type == "cpu",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=config["num_warps"],
    )
    return y.to(x.dtype) if atomic else y


def _words(fmt: str, k: int, group: int) -> bool:
    """Whether a 4-bit layer's codes can be read as int32 words (eight codes each)."""
    return fmt not in _PER_CHANNEL and k % 8 == 0 and group % 8 == 0


def _launch_gemv(config: autotune.Config, x: torch.Tensor, t: dict[str, Any], fmt: str, group: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[1]
    q, scale = _as_bytes(fmt, t["qweight"], t["scale"])
    n = q.shape[0]
    y = x.new_empty((1, n))
    if _words(fmt, k, group):
        words = q.view(torch.int32)
        _gemv4_kernel[(cdiv(n, config["BLOCK_N"]),)](
            x, words, scale, t.get("offset", scale), t.get("global_scale", scale), scale if bias is None else bias, y,
            n, k, words.stride(0), scale.stride(0), FORMAT=FORMAT_IDS[fmt], GROUP=group,
            HAS_BIAS=bias is not None, BLOCK_N=config["BLOCK_N"], BLOCK_K=max(config["BLOCK_K"], group),
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )
        return y
    _gemv_kernel[(cdiv(n, config["BLOCK_N"]),)](
        x, q, scale, t.get("offset", scale), t.get("global_scale", scale), scale if bias is None else bias, y,
        n, k, q.stride(0), scale.stride(0), FORMAT=FORMAT_IDS[fmt], GROUP=_kernel_group(fmt, group),
        HAS_BIAS=bias is not None, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return y


def matmul(x: torch.Tensor, t: dict[str, Any], fmt: str, group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantise(t).T + bias`` for 2-D ``x`` with a contiguous last dimension (the fused decode kernels:
    one row on the CUDA cores, up to 16 on the tensor cores).

    ``t`` holds the format's tensors (``qweight``, ``scale`` and, by format, ``offset`` / ``global_scale``), all
    contiguous; ``group`` is the format's group size (``in_features`` for per-channel formats).
    """
    m, k = x.shape
    n = t["qweight"].shape[0]
    if m == 1:
        tunable = _TUNED_GEMV[fmt]
        config = tunable.lookup(x.device, x.dtype, n, k, group)
        if config is None:
            config = tunable.tune(x.device, x.dtype, (n, k, group), lambda c: _launch_gemv(c, x, t, fmt, group, bias))
        return _launch_gemv(config, x, t, fmt, group, bias)
    tunable = _TUNED[fmt]
    config = tunable.lookup(x.device, x.dtype, m, n, k, group)
    if config is None:
        config = tunable.tune(x.device, x.dtype, (m, n, k, group), lambda c: _launch(c, x, t, fmt, group, bias))
    return _launch(config, x, t, fmt, group, bias)


def dequantize(t: dict[str, Any], fmt: str, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``(out_features, in_features)`` weight in ``dtype``, in one pass over the codes."""
    q, scale = t["qweight"], t["scale"]
    n = q.shape[0]
    k = q.shape[1] * (1 if fmt in _PER_CHANNEL else 2)
    w = torch.empty((n, k), dtype=dtype, device=q.device)
    q, scale = _as_bytes(fmt, q, scale)
    block_n = 16
    block_k = 256 if fmt in _PER_CHANNEL else max(group, 128)  # a whole number of groups per program
    _dequantize_kernel[(cdiv(n, block_n), cdiv(k, block_k))](
        q, scale, t.get("offset", scale), t.get("global_scale", scale), w, n, k, q.stride(0), scale.stride(0),
        w.stride(0), FORMAT=FORMAT_IDS[fmt], GROUP=_kernel_group(fmt, group), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )
    return w
