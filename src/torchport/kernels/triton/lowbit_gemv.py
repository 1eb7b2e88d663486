"""The one-row low-bit kernel on the CUDA cores (batch-1 decode; 2-4 rows as one program per row and weight block).

Bytes: the stored weight (4.25 bits per weight for int4 in groups of 128, 8 + 32/K for int8) is read once; ``x``
(bf16, 2K bytes) is read by every program from L2. At M = 1 an H100 moves 8.9 MB of int4 4096 x 4096 in 3 us at
its 3 TB/s; what these kernels reach is in ``benchmarks/RESULTS.md`` (issue 24).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .lowbit_decode import (FP8, INT4, INT8, MXFP4, NVFP4, E2M1_UNIT, E4M3_UNIT, e4m3, half_pair, load,
                            magic, split_sum)

__all__ = ["gemv_kernel"]


@triton.jit
def per_word(v, BLOCK_N: tl.constexpr, GT: tl.constexpr, WG: tl.constexpr):
    """[BLOCK_N, GT] values, one per run of ``WG`` words, as [BLOCK_N, GT * WG]: each repeated over its run."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BLOCK_N, GT, WG)), (BLOCK_N, GT * WG))


@triton.jit
def gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, g_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, W_SPLIT,
                stride_xm, stride_qn, stride_sn, stride_ym, magic_bits, sign_bits, FORMAT: tl.constexpr,
                GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr,
                PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Row ``program_id(0)`` of ``x`` against ``BLOCK_N`` output features (``program_id(1)``), codes read as int32
    words: four bytes (int8, fp8) or eight nibbles (int4, e2m1), column ``CPW * w + i`` in byte / nibble ``i`` of word
    ``w``. A tile is [BLOCK_N, BLOCK_W] words; ``x`` is read once per tile as ``CPW`` strided vectors, one per code
    position, shared by the tile's rows. int4 and int8 codes are decoded by the 2^23 trick in place: code ``i`` is
    masked where it lies (within the 23 mantissa bits: the upper half-word is shifted down first),
    ``(c - 8) * 16^(i % 4)`` (int4) or ``c * 256^(i % 2)`` (int8), and ``x`` is pre-scaled by the inverse power of
    two (exact). The tile's words fall into ``GT`` runs of ``WG`` words inside one group (a word never straddles
    two): a group's scale (and int4's offset) is loaded once per row and run and repeated over the run's words, and
    int4's offset joins each word's sum before the scale, with no second accumulator. Loaded per word, int4's scales
    and offsets were 64 of a thread's 88 loads per tile at one warp over 16 x 64 words; now it has 28 loads, and 168
    registers instead of 246 (PTX and ptxas for sm_90; RESULTS.md, issue 24).

    ``SPLIT`` > 1: program ``program_id(2)`` walks the ``W_SPLIT`` words from ``program_id(2) * W_SPLIT`` only, and
    the partial sums meet in :func:`split_sum` (the layers with few output features per multiprocessor).
    ``PREFETCH``: the next tile's words are loaded before the current tile is decoded, so that two tiles of loads
    are in flight per program (Triton does not pipeline loads that feed no dot)."""
    PER_CHANNEL: tl.constexpr = FORMAT == INT8 or FORMAT == FP8
    CPW: tl.constexpr = 4 if PER_CHANNEL else 8
    WPG: tl.constexpr = BLOCK_W if PER_CHANNEL else GROUP // CPW  # words per group
    WG: tl.constexpr = BLOCK_W if BLOCK_W < WPG else WPG
    GT: tl.constexpr = BLOCK_W // WG
    row = tl.program_id(0)
    pid_k = tl.program_id(2)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    w_begin = pid_k * W_SPLIT
    w_end = tl.minimum(K // CPW, w_begin + W_SPLIT)
    x_row = x_ptr + row * stride_xm
    q_rows = q_ptr + rn[:, None] * stride_qn
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    if PREFETCH:
        w_next = tl.load(q_rows + (w_begin + tl.arange(0, BLOCK_W))[None, :],
                         mask=mask_n[:, None] & (w_begin + tl.arange(0, BLOCK_W) < w_end)[None, :], other=0)
    for w0 in range(w_begin, w_end, BLOCK_W):
        wi = w0 + tl.arange(0, BLOCK_W)
        mask_w = wi < w_end
        mask = mask_n[:, None] & mask_w[None, :]
        if PREFETCH:
            w = w_next
            w_next = tl.load(q_rows + (wi + BLOCK_W)[None, :], mask=mask_n[:, None] & (wi + BLOCK_W < w_end)[None, :],
                             other=0)
        else:
            w = load(q_rows + wi[None, :], mask, 0, EVEN)
        xb = x_row + CPW * wi
        x0 = load(xb, mask_w, 0.0, EVEN).to(tl.float32)
        x1 = load(xb + 1, mask_w, 0.0, EVEN).to(tl.float32)
        x2 = load(xb + 2, mask_w, 0.0, EVEN).to(tl.float32)
        x3 = load(xb + 3, mask_w, 0.0, EVEN).to(tl.float32)
        if FORMAT == INT8:
            t = w ^ -0x7F7F7F80  # 0x80808080: each byte + 128, so that it reads as an unsigned 0..255
            p = magic(t, 0xFF, magic_bits, 8388736.0) * x0[None, :]
            p += magic(t, 0xFF00, magic_bits, 8421376.0) * (x1 * (1.0 / 256))[None, :]
            t_hi = t >> 16  # bytes 2, 3 (a byte in bits 16-23 would reach the float's exponent)
            p += magic(t_hi, 0xFF, magic_bits, 8388736.0) * x2[None, :]
            p += magic(t_hi, 0xFF00, magic_bits, 8421376.0) * (x3 * (1.0 / 256))[None, :]
            acc += p
        elif FORMAT == FP8:
            a0, a2 = half_pair(w, 8, sign_bits, 1, 0x3F803F80)
            a1, a3 = half_pair(w, 0, sign_bits, 1, 0x3F803F80)
            acc += a0 * x0[None, :] + a1 * x1[None, :] + a2 * x2[None, :] + a3 * x3[None, :]
        else:
            x4 = load(xb + 4, mask_w, 0.0, EVEN).to(tl.float32)
            x5 = load(xb + 5, mask_w, 0.0, EVEN).to(tl.float32)
            x6 = load(xb + 6, mask_w, 0.0, EVEN).to(tl.float32)
            x7 = load(xb + 7, mask_w, 0.0, EVEN).to(tl.float32)
            if FORMAT == INT4:
                w_hi = w >> 16
                p = magic(w, 0xF, magic_bits, 8388616.0) * x0[None, :]
                p += magic(w, 0xF0, magic_bits, 8388736.0) * (x1 * (1.0 / 16))[None, :]
                p += magic(w, 0xF00, magic_bits, 8390656.0) * (x2 * (1.0 / 256))[None, :]
                p += magic(w, 0xF000, magic_bits, 8421376.0) * (x3 * (1.0 / 4096))[None, :]
                p += magic(w_hi, 0xF, magic_bits, 8388616.0) * x4[None, :]
                p += magic(w_hi, 0xF0, magic_bits, 8388736.0) * (x5 * (1.0 / 16))[None, :]
                p += magic(w_hi, 0xF00, magic_bits, 8390656.0) * (x6 * (1.0 / 256))[None, :]
                p += magic(w_hi, 0xF000, magic_bits, 8421376.0) * (x7 * (1.0 / 4096))[None, :]
            else:
                a0, a4 = half_pair(w, 12, sign_bits, 3, 0x0E000E00)
                a1, a5 = half_pair(w, 8, sign_bits, 3, 0x0E000E00)
                a2, a6 = half_pair(w, 4, sign_bits, 3, 0x0E000E00)
                a3, a7 = half_pair(w, 0, sign_bits, 3, 0x0E000E00)
                p = a0 * x0[None, :] + a1 * x1[None, :] + a2 * x2[None, :] + a3 * x3[None, :]
                p += a4 * x4[None, :] + a5 * x5[None, :] + a6 * x6[None, :] + a7 * x7[None, :]
            first = w0 + tl.arange(0, GT) * WG  # each run's first word: its group's scale
            # a run is a whole group or (GT == 1) part of one, so the runs' groups are w0 // WPG + 0, 1, ...: written
            # so, the offsets are seen as contiguous and a row's scale bytes load as one vector, not byte by byte
            s_off = rn[:, None] * stride_sn + (w0 // WPG + tl.arange(0, GT))[None, :]
            s_mask = mask_n[:, None] & (first < w_end)[None, :]
            if FORMAT == INT4:
                s = load(s_ptr + s_off, s_mask, 0.0, EVEN).to(tl.float32)
                o = load(o_ptr + s_off, s_mask, 0.0, EVEN).to(tl.float32)
                # (codes - 8 + offset) * scale: the offset once per word, times the sum of the word's activations
                p += per_word(o, BLOCK_N, GT, WG) * (x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7)[None, :]
                acc += p * per_word(s, BLOCK_N, GT, WG)
            else:
                raw = load(s_ptr + s_off, s_mask, 0, EVEN).to(tl.int32) & 255
                if FORMAT == MXFP4:
                    s = (raw << 23).to(tl.float32, bitcast=True)
                else:
                    s = e4m3(raw)
                acc += p * per_word(s, BLOCK_N, GT, WG)
    total = tl.sum(acc, axis=1)
    if FORMAT == INT8 or FORMAT == FP8:
        scale = tl.load(s_ptr + rn * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
        if FORMAT == FP8:
            scale = scale * E4M3_UNIT
        total = total * scale
    if FORMAT == MXFP4:
        total = total * E2M1_UNIT
    if FORMAT == NVFP4:
        total = total * (E2M1_UNIT * E4M3_UNIT) * tl.load(g_ptr)
    y = y_ptr + row * stride_ym + rn
    if SPLIT > 1:
        total, mask_n = split_sum(total, row * N + rn, mask_n, part_ptr, count_ptr, row * tl.num_programs(1) +
                                  tl.program_id(1), pid_k, M * N, SPLIT)
    if HAS_BIAS:
        total += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y, total.to(y_ptr.dtype.element_ty), mask=mask_n)
