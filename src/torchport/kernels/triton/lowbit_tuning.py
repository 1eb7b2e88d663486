"""Launch configurations of the low-bit matmul kernels (:mod:`.lowbit`): the kernels a configuration can name, the
candidates the tuner (:mod:`.autotune`) times for one row, 2-16 rows and prefill, and the shape buckets they are
chosen for. The first candidate of each list is the heuristic, used as it is where nothing can be timed."""

from __future__ import annotations

import functools

import torch

from . import autotune, multiprocessor_count, next_power_of_2, nvidia
from .lowbit_decode import FORMAT_IDS

__all__ = ["DECODE_ROWS", "DENSE", "GEMM", "GEMV", "GEMV_TILED", "INT4_MMA", "MMA", "PER_CHANNEL", "ROWS", "TUNED",
           "TUNED_GEMV", "TUNED_PREFILL", "candidates", "gemv_candidates", "int4_mma_candidates", "int4_mma_heuristic",
           "prefill_candidates",
           "tiled_candidates", "words_fit"]

PER_CHANNEL = ("int8", "fp8")
DECODE_ROWS = 16  # up to this many rows the decode kernels compete; above it, prefill's
# the kernels a configuration can name (``KERNEL``)
GEMV, GEMV_TILED, MMA, ROWS, DENSE, GEMM, INT4_MMA = range(7)
INT4_MMA_MIN_GROUP = 64  # its dots run over K = group / 4 codes, and tensor cores take K >= 16
INT4_MMA_FIRST_MAX_GROUP = 256  # a step holds one whole group: the untimed choice only where that was measured


def _bucket(m: int, n: int, k: int, group: int) -> tuple[int, int, int, int]:
    return next_power_of_2(m), next_power_of_2(n), next_power_of_2(k), group


def candidates(fmt: str, m: int, n: int, k: int, group: int,
               device: torch.device | None = None) -> list[autotune.Config]:
    """2-16 rows: the decode-in-prologue GEMM (output-feature block, K block, warps, stages; the K split is derived
    at launch so that (n-blocks x splits) gives every multiprocessor about four programs) with the heuristic first,
    the earlier tensor-core kernel, the one-row kernel once per row (up to 4 rows: measured slower than the tensor
    cores from 8 rows on, RESULTS.md), dequantise + dense matmul, and for int4 :func:`int4_mma_candidates`.

    On an NVIDIA GPU, for groups of 64-256, the int4 tensor-core kernel comes first, so it is also what runs where
    nothing is timed. With tuning turned off it ran 1.7-2.5x bf16 on an 8B model's layers at 2-16 rows where the
    GEMM gave 1.25-1.6x (H100; RESULTS.md, issue 24), its K split the one that gives every multiprocessor about
    four programs: on 132 of them 8 for q/o, k/v and down, 2 for gate/up merged, 1 for the LM head (the tuner chose
    4-8, 8, 1-2 and 1 on those layers of an H100 and an H200). In a CUDA graph captured before any eager call of
    the shape, no kernel can split K (its workspace cannot be made during a capture), so it runs unsplit there, as
    the GEMM would; that case was not timed. Elsewhere (ROCm, the interpreter) it decodes with integer operations,
    unmeasured, and stays a candidate behind the GEMM."""
    configs = []
    for block_n, block_k, warps, stages in ((32, 256, 4, 3), (64, 128, 4, 3), (16, 256, 4, 3), (32, 128, 4, 4),
                                            (64, 256, 8, 3)):
        configs.append({"KERNEL": GEMM, "BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": _gemm_block_k(fmt, block_k, k),
                        "num_warps": warps, "num_stages": stages})
    for block_n, block_k, warps, stages in ((64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3)):
        configs.append({"KERNEL": GEMM, "WEIGHT_A": True, "BLOCK_M": 16, "BLOCK_N": block_n,
                        "BLOCK_K": _gemm_block_k(fmt, block_k, k), "num_warps": warps, "num_stages": stages})
    configs.append({"KERNEL": MMA, "BLOCK_N": 32, "BLOCK_K": _block_k(fmt, 256, k, group), "num_warps": 4})
    if words_fit(fmt, k) and m <= 4:
        for block_n, block_w, warps in ((8, 128, 4), (4, 256, 4), (4, 128, 4)):
            configs.append({"KERNEL": ROWS, "BLOCK_N": block_n, "BLOCK_W": block_w, "num_warps": warps})
    configs.append({"KERNEL": DENSE})
    mma = int4_mma_candidates(fmt, n, k, group)
    if mma and group <= INT4_MMA_FIRST_MAX_GROUP and device is not None and nvidia(device):
        return autotune.distinct([int4_mma_heuristic(n, k, group, multiprocessor_count(device))] + mma + configs)
    return autotune.distinct(configs + mma)


def int4_mma_heuristic(n: int, k: int, group: int, multiprocessors: int) -> autotune.Config:
    """The int4 tensor-core kernel's untimed configuration: 128 output features, 4 warps, the next group's scales
    ahead, and K split so that the programs number about four per multiprocessor (a power of two from 1 to 8, and
    at most half the groups): one of :func:`int4_mma_candidates`' configurations."""
    blocks = -(-n // 128)
    split = max(1, min(8, max(1, k // group) // 2, -(-4 * multiprocessors // blocks)))
    return _int4_mma_config(128, 4, 1, 1 << (split.bit_length() - 1))


def _int4_mma_config(block_n: int, warps: int, ahead: int, split: int) -> autotune.Config:
    return {"KERNEL": INT4_MMA, "BLOCK_N": block_n, "num_warps": warps, "PREFETCH": ahead, "SPLIT": split,
            "num_stages": 3}


def int4_mma_candidates(fmt: str, n: int, k: int, group: int) -> list[autotune.Config]:
    """int4 on the tensor cores, 1-16 rows (``lowbit_int4_mma``): output features per program, warps, the next
    group's scales loaded ahead, K split. The fastest of each layer of an 8B model on an H200 were among these
    (128 features, 4 warps, ahead, split 2-8; 64 features without; RESULTS.md, issue 24)."""
    if fmt != "int4" or group < INT4_MMA_MIN_GROUP:
        return []
    groups = max(1, k // group)
    shapes = ((128, 4, 1, 8), (128, 4, 1, 4), (128, 4, 1, 2), (128, 4, 1, 1), (64, 4, 0, 8), (64, 4, 0, 4),
              (128, 8, 0, 8))
    return autotune.distinct([_int4_mma_config(block_n, warps, ahead, max(1, min(split, groups // 2)))
                              for block_n, warps, ahead, split in shapes])


def _prefill_bucket(m: int, n: int, k: int, group: int) -> tuple[int, int, int, int]:
    return autotune.coarse(m, 32, 8192), next_power_of_2(n), next_power_of_2(k), group


def prefill_candidates(fmt: str, m: int, n: int, k: int, group: int) -> list[autotune.Config]:
    """More than 16 rows: dequantise + the vendor matmul first (the baseline), then the decode-in-prologue GEMM's
    tiles (rows, output features, K block, warps, stages; row tiles grouped by 8 for L2 reuse)."""
    configs: list[autotune.Config] = [{"KERNEL": DENSE}]
    for block_m, block_n, block_k, warps, stages in ((128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
                                                     (128, 256, 64, 8, 3), (128, 128, 128, 8, 3)):
        configs.append({"KERNEL": GEMM, "BLOCK_M": min(block_m, max(16, next_power_of_2(m))), "BLOCK_N": block_n,
                        "BLOCK_K": _gemm_block_k(fmt, block_k, k), "num_warps": warps, "num_stages": stages})
    # the weights as the dot's A operand (``WEIGHT_A``): output-feature tiles of 64 or more (wgmma's A rows)
    for block_m, block_n, block_k, warps, stages in ((128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3),
                                                     (128, 128, 128, 8, 3), (256, 128, 64, 8, 3)):
        configs.append({"KERNEL": GEMM, "WEIGHT_A": True, "BLOCK_M": min(block_m, max(16, next_power_of_2(m))),
                        "BLOCK_N": block_n, "BLOCK_K": _gemm_block_k(fmt, block_k, k), "num_warps": warps,
                        "num_stages": stages})
    return autotune.distinct(configs)


def _gemm_block_k(fmt: str, block_k: int, k: int) -> int:
    """``gemm_kernel``'s K block: a power of two of at least 32 (every 4-bit group divides it or is divided by it)."""
    return min(block_k, max(32, next_power_of_2(k)))


def _gemv_bucket(n: int, k: int, group: int) -> tuple[int, int, int]:
    return next_power_of_2(n), next_power_of_2(k), group


def _block_k(fmt: str, block_k: int, k: int, group: int) -> int:
    """A K block for ``k`` columns: int4 needs one group per block (BLOCK_K divides the group); the fp4 blocks
    (16, 32) divide any BLOCK_K >= 32; per-channel formats take any."""
    block_k = min(block_k, max(32, next_power_of_2(k)))
    return min(block_k, group) if fmt == "int4" else block_k


def words_fit(fmt: str, k: int) -> bool:
    """Whether rows of ``k`` codes are whole int32 words (what ``gemv_kernel`` reads); 4-bit groups always are."""
    return fmt not in PER_CHANNEL or k % 4 == 0


def gemv_candidates(fmt: str, n: int, k: int, group: int) -> list[autotune.Config]:
    """One row: ``gemv_kernel``'s output features and words per tile, warps, K split and prefetch (the heuristic
    first: small blocks of features where they are few, so that every multiprocessor has programs), then the tiled
    kernel's, and for int4 :func:`int4_mma_candidates`. Split K where the output features give fewer than ~4
    programs per multiprocessor (k/v and q/o
    projections: 128-512 programs for 132 SMs) and along long rows (the down projection).

    Programs of one or two warps with 16-64 rows: a thread then holds one word column for many rows and loads that
    column's activations once for all of them. With 4 warps over 128 words the activation gathers (eight strided
    loads per word column, one per code position) kept L1 at 75% of its throughput while DRAM ran at 35% (ncu, int4
    lm_head); one warp over 32 rows x 32 words ran that layer 1.38x faster (RESULTS.md, issue 24)."""
    configs = []
    if words_fit(fmt, k):
        if n <= 2048:
            shapes = ((4, 256, 4, 1, 0), (4, 128, 4, 4, 0), (4, 128, 4, 2, 1), (2, 128, 4, 4, 0), (8, 64, 4, 8, 0),
                      (4, 64, 2, 8, 0), (8, 128, 4, 4, 1), (8, 128, 4, 1, 0), (16, 64, 1, 4, 0), (8, 64, 1, 8, 0),
                      (16, 32, 1, 8, 0), (8, 128, 2, 4, 0))
        else:
            shapes = ((8, 128, 4, 1, 0), (8, 128, 4, 1, 1), (8, 128, 4, 2, 0), (8, 128, 4, 4, 0), (4, 128, 4, 2, 1),
                      (16, 128, 4, 1, 1), (16, 64, 4, 2, 1), (4, 256, 4, 1, 0), (8, 256, 8, 1, 1),
                      (16, 128, 2, 1, 0), (16, 128, 2, 1, 1), (32, 128, 4, 1, 0), (32, 64, 2, 1, 0), (16, 64, 1, 1, 0),
                      (32, 32, 1, 1, 0), (8, 128, 1, 1, 0), (64, 32, 1, 1, 0), (32, 32, 1, 4, 0), (16, 64, 1, 4, 0))
        words = max(1, k // (4 if fmt in PER_CHANNEL else 8))
        for block_n, block_w, warps, split, prefetch in shapes:
            block_w = min(block_w, next_power_of_2(words))
            split = min(split, max(1, words // block_w))
            configs.append({"KERNEL": GEMV, "BLOCK_N": block_n, "BLOCK_W": block_w, "num_warps": warps,
                            "SPLIT": split, "PREFETCH": prefetch})
    return autotune.distinct(configs + tiled_candidates(fmt, n, k, group) + int4_mma_candidates(fmt, n, k, group))


def tiled_candidates(fmt: str, n: int, k: int, group: int) -> list[autotune.Config]:
    """``gemv4_kernel``/``gemv8_kernel``: rows per program, K block, warps and pipeline stages. Few rows (k/v
    projections) take long K blocks so that enough bytes are in flight."""
    if n <= 2048:
        shapes = ((2, 2048, 4, 3), (4, 2048, 8, 3), (1, 2048, 4, 3), (2, 4096, 8, 3), (4, 1024, 4, 3), (2, 2048, 4, 4))
    else:
        shapes = ((4, 1024, 4, 3), (2, 2048, 4, 3), (4, 2048, 8, 3), (2, 1024, 2, 3), (4, 1024, 4, 4), (8, 1024, 8, 3))
    return [{"KERNEL": GEMV_TILED, "BLOCK_N": block_n, "BLOCK_K": min(block_k, max(32, next_power_of_2(k))),
             "num_warps": warps, "num_stages": stages} for block_n, block_k, warps, stages in shapes]


TUNED = {fmt: autotune.Tunable(f"lowbit_matmul.{fmt}", ("m", "n", "k", "group"), _bucket,
                                functools.partial(candidates, fmt), per_device=True) for fmt in FORMAT_IDS}
TUNED_GEMV = {fmt: autotune.Tunable(f"lowbit_gemv.{fmt}", ("n", "k", "group"), _gemv_bucket,
                                     functools.partial(gemv_candidates, fmt)) for fmt in FORMAT_IDS}
TUNED_PREFILL = {fmt: autotune.Tunable(f"lowbit_prefill.{fmt}", ("m", "n", "k", "group"), _prefill_bucket,
                                        functools.partial(prefill_candidates, fmt)) for fmt in FORMAT_IDS}
