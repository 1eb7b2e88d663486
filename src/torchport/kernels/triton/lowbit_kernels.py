"""The Triton kernels of the low-bit matmul (:mod:`.lowbit` chooses and launches them).

* ``gemv_kernel``: one row of ``x`` per program (batch-1 decode, or a few rows, one program per row and weight
  block, so that the rows of one block share its bytes through L2) on the CUDA cores; every format's codes read as
  int32 words and decoded with one logic operation and one float subtraction per code (int4, int8), or two codes
  per float16 pair (e2m1, e4m3).
* ``gemv8_kernel`` and ``gemv4_kernel``: the previous one-row kernels (8-bit codes as bytes, 4-bit codes in tiles of
  [rows, groups, words of a group]), kept as autotuning candidates.
* ``matmul_kernel``: up to 16 rows on the tensor cores, weight tiles loaded K-major; split-K with float32 atomics
  when the output features alone give too few programs.
* ``dequantize_kernel``: the dense weight in the activation dtype, for prefill.

Per-channel formats (int8, fp8) multiply the scale after the sum: ``x @ (q * s).T == (x @ q.T) * s``; int4 keeps
the sum on the raw codes, ``(q + o) * s`` summed over a group being ``s * (x . q) + s * o * sum(x)``; mxfp4 and
nvfp4 scale each group's codes, and nvfp4's tensor scale is applied at the end. Codes are decoded with integer
operations into float bits (no int-to-float conversion instructions), which also runs under Triton's interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["FORMAT_IDS", "MAGIC_BITS", "SIGN_BITS", "dequantize_kernel", "gemv4_kernel", "gemv8_kernel",
           "gemv_kernel", "matmul_kernel"]

FORMAT_IDS = {"int8": 0, "fp8": 1, "int4": 2, "mxfp4": 3, "nvfp4": 4}
_INT8, _FP8, _INT4, _MXFP4, _NVFP4 = (tl.constexpr(v) for v in range(5))
# Passed to gemv_kernel as run-time integers, so that ``(word & mask) | MAGIC_BITS`` is one three-input logic
# instruction (LOP3 takes one immediate: with both constants immediate, ptxas emits two).
MAGIC_BITS = 0x4B000000  # float32 2^23: a code in the low mantissa bits reads as 2^23 + code
SIGN_BITS = -0x7FFF8000  # 0x80008000 as int32: the sign bits of a float16 pair


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
        if FORMAT == _INT8:
            w = _int8(q)
        else:
            w = _e4m3(q & 255)
        acc += w * x[None, :]
    scale = tl.load(s_ptr + rn * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
    if FORMAT == _FP8:
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
    if FORMAT == _INT4:
        value = _nibble(code)
    else:
        value = _e2m1(code)
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
def _load(ptr, mask, other, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptr)
    return tl.load(ptr, mask=mask, other=other)


@triton.jit
def _magic(src, MASK: tl.constexpr, magic_bits, MAGIC: tl.constexpr):
    """The bits ``MASK`` of ``src`` as a float: ``(src & MASK) | 2^23`` read as float32, minus ``MAGIC`` (exact)."""
    return ((src & MASK) | magic_bits).to(tl.float32, bitcast=True) - MAGIC


@triton.jit
def _half_pair(w, SHIFT: tl.constexpr, sign_bits, MAG_SHIFT: tl.constexpr, MAG_MASK: tl.constexpr):
    """Two codes of each word, 16 bits apart, as float32 through a float16 pair: after ``w << SHIFT`` their sign bits
    sit at bits 15 and 31 and stay; their magnitude bits move right by ``MAG_SHIFT`` into the float16 exponent and
    mantissa (e2m1: value / 2^14, e4m3: value / 2^8; subnormals included)."""
    q = w << SHIFT
    h = (q & sign_bits) | ((q >> MAG_SHIFT) & MAG_MASK)
    low = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, g_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                magic_bits, sign_bits, FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Row ``program_id(0)`` of ``x`` against ``BLOCK_N`` output features (``program_id(1)``), codes read as int32
    words: four bytes (int8, fp8) or eight nibbles (int4, e2m1), column ``CPW * w + i`` in byte / nibble ``i`` of word
    ``w``. A tile is [BLOCK_N, BLOCK_W] words; ``x`` is read once per tile as ``CPW`` strided vectors, one per code
    position, shared by the tile's rows. int4 and int8 codes are decoded by the 2^23 trick in place: code ``i`` is
    masked where it lies (within the 23 mantissa bits: the upper half-word is shifted down first), ``(c - 8) * 16^(i % 4)``
    (int4) or ``c * 256^(i % 2)`` (int8), and ``x`` is pre-scaled by the
    inverse power of two (exact). Group scales are gathered per word (a word never straddles two groups)."""
    CPW: tl.constexpr = 4 if FORMAT == _INT8 or FORMAT == _FP8 else 8
    WPG: tl.constexpr = GROUP // CPW
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    n_words = K // CPW
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    acc_o = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    for w0 in range(0, n_words, BLOCK_W):
        wi = w0 + tl.arange(0, BLOCK_W)
        mask_w = wi < n_words
        mask = mask_n[:, None] & mask_w[None, :]
        w = _load(q_ptr + rn[:, None] * stride_qn + wi[None, :], mask, 0, EVEN)
        xb = x_row + CPW * wi
        x0 = _load(xb, mask_w, 0.0, EVEN).to(tl.float32)
        x1 = _load(xb + 1, mask_w, 0.0, EVEN).to(tl.float32)
        x2 = _load(xb + 2, mask_w, 0.0, EVEN).to(tl.float32)
        x3 = _load(xb + 3, mask_w, 0.0, EVEN).to(tl.float32)
        if FORMAT == _INT8:
            t = w ^ -0x7F7F7F80  # 0x80808080: each byte + 128, so that it reads as an unsigned 0..255
            p = _magic(t, 0xFF, magic_bits, 8388736.0) * x0[None, :]
            p += _magic(t, 0xFF00, magic_bits, 8421376.0) * (x1 * (1.0 / 256))[None, :]
            t_hi = t >> 16  # bytes 2, 3 (a byte in bits 16-23 would reach the float's exponent)
            p += _magic(t_hi, 0xFF, magic_bits, 8388736.0) * x2[None, :]
            p += _magic(t_hi, 0xFF00, magic_bits, 8421376.0) * (x3 * (1.0 / 256))[None, :]
            acc += p
        elif FORMAT == _FP8:
            a0, a2 = _half_pair(w, 8, sign_bits, 1, 0x3F803F80)
            a1, a3 = _half_pair(w, 0, sign_bits, 1, 0x3F803F80)
            acc += a0 * x0[None, :] + a1 * x1[None, :] + a2 * x2[None, :] + a3 * x3[None, :]
        else:
            x4 = _load(xb + 4, mask_w, 0.0, EVEN).to(tl.float32)
            x5 = _load(xb + 5, mask_w, 0.0, EVEN).to(tl.float32)
            x6 = _load(xb + 6, mask_w, 0.0, EVEN).to(tl.float32)
            x7 = _load(xb + 7, mask_w, 0.0, EVEN).to(tl.float32)
            if FORMAT == _INT4:
                w_hi = w >> 16
                p = _magic(w, 0xF, magic_bits, 8388616.0) * x0[None, :]
                p += _magic(w, 0xF0, magic_bits, 8388736.0) * (x1 * (1.0 / 16))[None, :]
                p += _magic(w, 0xF00, magic_bits, 8390656.0) * (x2 * (1.0 / 256))[None, :]
                p += _magic(w, 0xF000, magic_bits, 8421376.0) * (x3 * (1.0 / 4096))[None, :]
                p += _magic(w_hi, 0xF, magic_bits, 8388616.0) * x4[None, :]
                p += _magic(w_hi, 0xF0, magic_bits, 8388736.0) * (x5 * (1.0 / 16))[None, :]
                p += _magic(w_hi, 0xF00, magic_bits, 8390656.0) * (x6 * (1.0 / 256))[None, :]
                p += _magic(w_hi, 0xF000, magic_bits, 8421376.0) * (x7 * (1.0 / 4096))[None, :]
            else:
                a0, a4 = _half_pair(w, 12, sign_bits, 3, 0x0E000E00)
                a1, a5 = _half_pair(w, 8, sign_bits, 3, 0x0E000E00)
                a2, a6 = _half_pair(w, 4, sign_bits, 3, 0x0E000E00)
                a3, a7 = _half_pair(w, 0, sign_bits, 3, 0x0E000E00)
                p = a0 * x0[None, :] + a1 * x1[None, :] + a2 * x2[None, :] + a3 * x3[None, :]
                p += a4 * x4[None, :] + a5 * x5[None, :] + a6 * x6[None, :] + a7 * x7[None, :]
            s_off = rn[:, None] * stride_sn + (wi // WPG)[None, :]
            if FORMAT == _INT4:
                s = _load(s_ptr + s_off, mask, 0.0, EVEN).to(tl.float32)
                o = _load(o_ptr + s_off, mask, 0.0, EVEN).to(tl.float32)
                acc += p * s
                acc_o += (o * s) * (x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7)[None, :]
            else:
                raw = _load(s_ptr + s_off, mask, 0, EVEN).to(tl.int32) & 255
                if FORMAT == _MXFP4:
                    s = (raw << 23).to(tl.float32, bitcast=True)
                else:
                    s = _e4m3(raw)
                acc += p * s
    total = tl.sum(acc, axis=1)
    if FORMAT == _INT4:
        total += tl.sum(acc_o, axis=1)
    if FORMAT == _INT8 or FORMAT == _FP8:
        scale = tl.load(s_ptr + rn * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
        if FORMAT == _FP8:
            scale = scale * E4M3_UNIT
        total = total * scale
    if FORMAT == _MXFP4:
        total = total * E2M1_UNIT
    if FORMAT == _NVFP4:
        total = total * (E2M1_UNIT * E4M3_UNIT) * tl.load(g_ptr)
    if HAS_BIAS:
        total += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + rn, total.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def dequantize_kernel(q_ptr, s_ptr, o_ptr, g_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn,
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
