"""Decoding of low-bit codes inside Triton kernels, shared by the low-bit matmul kernels (:mod:`.lowbit_kernels`,
:mod:`.lowbit_gemv`, :mod:`.lowbit_gemm`), and the split-K reduction they share.

Codes are decoded with integer operations into float bits (no int-to-float conversion instructions, a quarter-rate
instruction on recent GPUs that would cap a decode kernel below memory bandwidth), which also runs under Triton's
interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["FORMAT_IDS", "MAGIC_BITS", "SIGN_BITS"]

FORMAT_IDS = {"int8": 0, "fp8": 1, "int4": 2, "mxfp4": 3, "nvfp4": 4}
INT8, FP8, INT4, MXFP4, NVFP4 = (tl.constexpr(v) for v in range(5))  # FORMAT_IDS as constants
# Passed to gemv_kernel as run-time integers, so that ``(word & mask) | MAGIC_BITS`` is one three-input logic
# instruction (LOP3 takes one immediate: with both constants immediate, ptxas emits two).
MAGIC_BITS = 0x4B000000  # float32 2^23: a code in the low mantissa bits reads as 2^23 + code
SIGN_BITS = -0x7FFF8000  # 0x80008000 as int32: the sign bits of a float16 pair


# Decoding without int-to-float conversions (a quarter-rate instruction on recent GPUs, which would cap the decode
# kernel below memory bandwidth): codes are placed into the bits of a float whose value is then exact.
@triton.jit
def nibble(code):
    """int32 in [0, 15] -> float32 ``code - 8``: 2^23 + code read as a float, minus 2^23 + 8 (both exact)."""
    return (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def int8_code(byte):
    """int8 codes (sign-extended to int32) -> float32, by the same 2^23 trick on ``code + 128``."""
    return ((byte + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


E2M1_UNIT = tl.constexpr(16384.0)  # e2m1 returns value / 2^14
E4M3_UNIT = tl.constexpr(256.0)  # e4m3 returns value / 2^8


@triton.jit
def e2m1(code):
    """e2m1 codes (int32 in [0, 15]) -> float32 value / 2^14: the code's exponent and mantissa bits land in a
    float16's low exponent and top mantissa bits, and subnormals (code 1 = 0.5) come out right too."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3(byte):
    """float8 e4m3fn bytes (int32 in [0, 255]) -> float32 value / 2^8, through float16 bits as in :func:`e2m1`."""
    bits = ((byte & 0x7F) << 7) | ((byte & 0x80) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def block_scales(s_ptr, rn, mask_n, stride_sn, group0, n_groups, GROUPS: tl.constexpr, FORMAT: tl.constexpr):
    """The float32 scales of ``GROUPS`` consecutive groups for the rows ``rn``: ``[BLOCK_N, GROUPS]``."""
    g = group0 + tl.arange(0, GROUPS)
    mask = mask_n[:, None] & (g < n_groups)[None, :]
    raw = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=mask, other=0).to(tl.int32)
    if FORMAT == MXFP4:
        scale = ((raw & 255) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127); e = 0 (2^-127) reads as 0
    else:
        scale = e4m3(raw & 255) * E4M3_UNIT
    return scale


@triton.jit
def scaled(values, scale, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HALF_GROUP: tl.constexpr):
    """``values`` [BLOCK_N, GROUPS * HALF_GROUP] times each group's scale."""
    v = tl.reshape(values, (BLOCK_N, GROUPS, HALF_GROUP)) * scale[:, :, None]
    return tl.reshape(v, (BLOCK_N, GROUPS * HALF_GROUP))


@triton.jit
def scaled_t(values, scale, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HALF_GROUP: tl.constexpr):
    """``values`` [GROUPS * HALF_GROUP, BLOCK_N] (K-major) times each group's scale ``scale`` [GROUPS, BLOCK_N]."""
    v = tl.reshape(values, (GROUPS, HALF_GROUP, BLOCK_N)) * scale[:, None, :]
    return tl.reshape(v, (GROUPS * HALF_GROUP, BLOCK_N))


@triton.jit
def affine(values, scale, offset, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HALF_GROUP: tl.constexpr):
    """``(values + offset) * scale`` with one offset and scale per group of ``values`` [BLOCK_N, GROUPS * HALF_GROUP]."""
    v = (tl.reshape(values, (BLOCK_N, GROUPS, HALF_GROUP)) + offset[:, :, None]) * scale[:, :, None]
    return tl.reshape(v, (BLOCK_N, GROUPS * HALF_GROUP))


@triton.jit
def load(ptr, mask, other, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptr)
    return tl.load(ptr, mask=mask, other=other)


@triton.jit
def magic(src, MASK: tl.constexpr, magic_bits, MAGIC: tl.constexpr):
    """The bits ``MASK`` of ``src`` as a float: ``(src & MASK) | 2^23`` read as float32, minus ``MAGIC`` (exact)."""
    return ((src & MASK) | magic_bits).to(tl.float32, bitcast=True) - MAGIC


@triton.jit
def half_pair(w, SHIFT: tl.constexpr, sign_bits, MAG_SHIFT: tl.constexpr, MAG_MASK: tl.constexpr):
    """Two codes of each word, 16 bits apart, as float32 through a float16 pair: after ``w << SHIFT`` their sign bits
    sit at bits 15 and 31 and stay; their magnitude bits move right by ``MAG_SHIFT`` into the float16 exponent and
    mantissa (e2m1: value / 2^14, e4m3: value / 2^8; subnormals included)."""
    q = w << SHIFT
    h = (q & sign_bits) | ((q >> MAG_SHIFT) & MAG_MASK)
    low = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def decode_tile(q_ptr, s_ptr, o_ptr, g_ptr, rn, mask_n, k0, K, stride_qn, stride_sn, FORMAT: tl.constexpr,
                GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights ``[BLOCK_N, BLOCK_K]`` of rows ``rn``, columns ``k0 ..``, as float32: 4-bit formats fully scaled
    (nvfp4's tensor scale included), per-channel formats (int8, fp8) without their channel scale (the caller applies
    it, to the tile or after the sum). ``BLOCK_K`` is a whole number of groups, or divides the group (int4)."""
    if FORMAT == INT8 or FORMAT == FP8:
        k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (k < K)[None, :]
        q = tl.load(q_ptr + rn[:, None] * stride_qn + k[None, :], mask=mask, other=0)
        if FORMAT == INT8:
            w = int8_code(q.to(tl.int32))
        else:
            w = e4m3(q.to(tl.int32) & 255) * E4M3_UNIT
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        kh = k0 // 2 + tl.arange(0, HALF)
        mask = mask_n[:, None] & (kh < K // 2)[None, :]
        p = tl.load(q_ptr + rn[:, None] * stride_qn + kh[None, :], mask=mask, other=0).to(tl.int32)
        low = p & 15
        high = (p >> 4) & 15
        if FORMAT == INT4:
            GROUPS: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1
            SPAN: tl.constexpr = GROUP // 2 if BLOCK_K > GROUP else HALF
            g = k0 // GROUP + tl.arange(0, GROUPS)
            g_mask = mask_n[:, None] & (g < K // GROUP)[None, :]
            s = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=g_mask, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + rn[:, None] * stride_sn + g[None, :], mask=g_mask, other=0.0).to(tl.float32)
            w_even = affine(nibble(low), s, o, BLOCK_N, GROUPS, SPAN)
            w_odd = affine(nibble(high), s, o, BLOCK_N, GROUPS, SPAN)
        else:
            GROUPS: tl.constexpr = BLOCK_K // GROUP
            scale = block_scales(s_ptr, rn, mask_n, stride_sn, k0 // GROUP, K // GROUP, GROUPS, FORMAT)
            scale = scale * E2M1_UNIT
            if FORMAT == NVFP4:
                scale = scale * tl.load(g_ptr)
            w_even = scaled(e2m1(low), scale, BLOCK_N, GROUPS, GROUP // 2)
            w_odd = scaled(e2m1(high), scale, BLOCK_N, GROUPS, GROUP // 2)
        w = tl.reshape(tl.join(w_even, w_odd), (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def split_sum(total, offs, mask, part_ptr, count_ptr, tile, pid_k, PART_STRIDE, SPLIT: tl.constexpr):
    """The sum over the ``SPLIT`` programs of one output tile of their float32 partial ``total`` (elements ``offs``,
    ``mask``), and the mask of the elements this program holds (``mask`` in the program that holds the sum, nothing
    in the others): every program writes its partial to the workspace ``part_ptr``
    (``SPLIT`` slices ``PART_STRIDE`` apart) and takes a ticket from the tile's counter; the last to arrive reads
    the partials back and resets the counter to 0, so the next launch (or CUDA-graph replay) starts from zero with
    no fill kernel. The partials are read through L2 (``.cg``): L1 is not coherent between multiprocessors."""
    tl.store(part_ptr + pid_k * PART_STRIDE + offs, total, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
    ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
    last = ticket == SPLIT - 1
    # a select rather than ``mask & last``: Triton 3.9's interpreter gives a tensor-and-scalar ``&`` an integer
    # mask, which its loads refuse; compiled, the two are the same instruction
    held = tl.where(last, mask, False)
    total = tl.zeros_like(total)
    for s in tl.static_range(SPLIT):
        total += tl.load(part_ptr + s * PART_STRIDE + offs, mask=held, other=0.0, cache_modifier=".cg")
    tl.store(count_ptr + tile, 0, mask=last)
    return total, held
