"""Low-bit weight matmul in Triton: ``y = x @ dequantise(W).T (+ bias)``, which kernel runs and how it is launched.

Decode is bound by reading the weight: an 8B-shaped Llama reads 15.0 GB of bf16 linear weights per token, 7.5 GB in
int8/fp8 and about 4 GB in 4-bit formats, which is the whole speed-up low-bit weights can give at batch 1 (5.0 ms
-> 1.3 ms per token at the H100's 3 TB/s). The kernels (:mod:`.lowbit_kernels`) read each code byte once and
decode it in registers:

* one row (batch-1 decode): a kernel on the CUDA cores, no split of K, codes read as int32 words and decoded with
  few integer operations per code (``gemv_kernel``); the previous tiling (``gemv4_kernel``/``gemv8_kernel``) stays a
  candidate of the autotuner;
* 2 to 16 rows: the autotuner picks per shape bucket among the tensor-core kernel (split-K with float32 atomics
  when the output features alone give too few programs), the one-row kernel launched once for every row (the rows
  of one weight block run side by side and share its bytes through L2), and dequantise + dense matmul;
* more rows (prefill): the weight is dequantised into the activation dtype (one pass at ~2.4 TB/s) and the
  vendor matmul does the rest (``QuantizedLinear.cache_dequantized`` keeps that weight between calls).

Launch configurations are autotuned per shape bucket (:mod:`.autotune`); ``KERNEL`` in a configuration names the
kernel (``_GEMV``, ``_GEMV_TILED``, ``_MMA``, ``_ROWS``, ``_DENSE``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import autotune, cdiv, lowbit_kernels as kernels, multiprocessor_count, next_power_of_2
from .lowbit_kernels import FORMAT_IDS, MAGIC_BITS, SIGN_BITS

__all__ = ["FORMAT_IDS", "dequantize", "matmul", "supports"]

_PER_CHANNEL = ("int8", "fp8")
_GEMV, _GEMV_TILED, _MMA, _ROWS, _DENSE = range(5)  # the kernels a configuration can name (``KERNEL``)


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
    """2-16 rows: the tensor-core kernel's output-feature block, K block and warps (the heuristic first; the K split
    is derived at launch so that (n-blocks x splits) gives every multiprocessor about four programs), the one-row
    kernel once per row, and dequantise + dense matmul."""
    configs = []
    for block_n, block_k, warps in ((32, 256, 4), (16, 256, 4), (64, 128, 4), (32, 512, 8)):
        configs.append({"KERNEL": _MMA, "BLOCK_N": block_n, "BLOCK_K": _block_k(fmt, block_k, k, group),
                        "num_warps": warps})
    if _words_fit(fmt, k) and m <= 4:  # measured slower than the tensor cores from 8 rows on (RESULTS.md)
        for block_n, block_w, warps in ((8, 128, 4), (4, 256, 4)):
            configs.append({"KERNEL": _ROWS, "BLOCK_N": block_n, "BLOCK_W": block_w, "num_warps": warps})
    configs.append({"KERNEL": _DENSE})
    return autotune.distinct(configs)


def _gemv_bucket(n: int, k: int, group: int) -> tuple[int, int, int]:
    return next_power_of_2(n), next_power_of_2(k), group


def _block_k(fmt: str, block_k: int, k: int, group: int) -> int:
    """A K block for ``k`` columns: int4 needs one group per block (BLOCK_K divides the group); the fp4 blocks
    (16, 32) divide any BLOCK_K >= 32; per-channel formats take any."""
    block_k = min(block_k, max(32, next_power_of_2(k)))
    return min(block_k, group) if fmt == "int4" else block_k


def _words_fit(fmt: str, k: int) -> bool:
    """Whether rows of ``k`` codes are whole int32 words (what ``gemv_kernel`` reads); 4-bit groups always are."""
    return fmt not in _PER_CHANNEL or k % 4 == 0


def _gemv_candidates(fmt: str, n: int, k: int, group: int) -> list[autotune.Config]:
    """One row: ``gemv_kernel``'s output features and words per tile and warps (the heuristic first: small blocks of
    features where they are few, so that every multiprocessor has programs), then the tiled kernel's."""
    configs = []
    if _words_fit(fmt, k):
        shapes = ((4, 256, 4), (2, 256, 4), (8, 128, 4), (4, 128, 2)) if n <= 2048 else \
            ((8, 128, 4), (16, 128, 4), (4, 256, 4), (8, 256, 8), (16, 64, 4))
        words = max(1, k // (4 if fmt in _PER_CHANNEL else 8))
        configs += [{"KERNEL": _GEMV, "BLOCK_N": block_n, "BLOCK_W": min(block_w, next_power_of_2(words)),
                     "num_warps": warps} for block_n, block_w, warps in shapes]
    return autotune.distinct(configs + _tiled_candidates(fmt, n, k, group))


def _tiled_candidates(fmt: str, n: int, k: int, group: int) -> list[autotune.Config]:
    """``gemv4_kernel``/``gemv8_kernel``: rows per program, K block, warps and pipeline stages. Few rows (k/v
    projections) take long K blocks so that enough bytes are in flight."""
    if n <= 2048:
        shapes = ((2, 2048, 4, 3), (4, 2048, 8, 3), (1, 2048, 4, 3), (2, 4096, 8, 3), (4, 1024, 4, 3), (2, 2048, 4, 4))
    else:
        shapes = ((4, 1024, 4, 3), (2, 2048, 4, 3), (4, 2048, 8, 3), (2, 1024, 2, 3), (4, 1024, 4, 4), (8, 1024, 8, 3))
    return [{"KERNEL": _GEMV_TILED, "BLOCK_N": block_n, "BLOCK_K": min(block_k, max(32, next_power_of_2(k))),
             "num_warps": warps, "num_stages": stages} for block_n, block_k, warps, stages in shapes]


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
    kernel = config.get("KERNEL", _MMA)
    if kernel == _ROWS and _words_fit(fmt, x.shape[1]):
        return _launch_words(config, x, t, fmt, group, bias)
    if kernel == _DENSE:
        return torch.nn.functional.linear(x, dequantize(t, fmt, group, x.dtype), bias)
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
    kernels.matmul_kernel[(cdiv(n, block_n), split, m_blocks)](
        x, q, scale, t.get("offset", scale), t.get("global_scale", scale), scale if bias is None else bias, y,
        m, n, k, k_split, x.stride(0), q.stride(0), scale.stride(0), y.stride(0),
        FORMAT=FORMAT_IDS[fmt], GROUP=_kernel_group(fmt, group), HAS_BIAS=bias is not None, ATOMIC=atomic,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=x.device.type == "cpu",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=config["num_warps"],
    )
    return y.to(x.dtype) if atomic else y


def _launch_words(config: autotune.Config, x: torch.Tensor, t: dict[str, Any], fmt: str, group: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``gemv_kernel``: one program per row of ``x`` and block of output features (rows fastest, so that the rows
    of one block run side by side and read its codes from L2)."""
    m, k = x.shape
    q, scale = _as_bytes(fmt, t["qweight"], t["scale"])
    n = q.shape[0]
    words = q.view(torch.int32)
    block_n, block_w = config["BLOCK_N"], config["BLOCK_W"]
    y = x.new_empty((m, n))
    even = n % block_n == 0 and words.shape[1] % block_w == 0
    kernels.gemv_kernel[(m, cdiv(n, block_n))](
        x, words, scale, t.get("offset", scale), t.get("global_scale", scale), scale if bias is None else bias, y,
        n, k, x.stride(0), words.stride(0), scale.stride(0), y.stride(0), MAGIC_BITS, SIGN_BITS,
        FORMAT=FORMAT_IDS[fmt], GROUP=_kernel_group(fmt, group), HAS_BIAS=bias is not None, EVEN=even,
        BLOCK_N=block_n, BLOCK_W=block_w, num_warps=config["num_warps"],
    )
    return y


def _launch_gemv(config: autotune.Config, x: torch.Tensor, t: dict[str, Any], fmt: str, group: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    if config.get("KERNEL", _GEMV_TILED) == _GEMV:
        if _words_fit(fmt, x.shape[1]):
            return _launch_words(config, x, t, fmt, group, bias)
        config = _tiled_candidates(fmt, t["qweight"].shape[0], x.shape[1], group)[0]
    k = x.shape[1]
    q, scale = _as_bytes(fmt, t["qweight"], t["scale"])
    n = q.shape[0]
    y = x.new_empty((1, n))
    grid = (cdiv(n, config["BLOCK_N"]),)
    if fmt in _PER_CHANNEL:
        kernels.gemv8_kernel[grid](
            x, q, scale, scale if bias is None else bias, y, n, k, q.stride(0), scale.stride(0),
            FORMAT=FORMAT_IDS[fmt], HAS_BIAS=bias is not None, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )
    else:  # groups are powers of two >= 16 (supports()), so whole int32 words of codes lie inside one group
        words = q.view(torch.int32)
        kernels.gemv4_kernel[grid](
            x, words, scale, t.get("offset", scale), t.get("global_scale", scale), scale if bias is None else bias, y,
            n, k, words.stride(0), scale.stride(0), FORMAT=FORMAT_IDS[fmt], GROUP=group,
            HAS_BIAS=bias is not None, BLOCK_N=config["BLOCK_N"], BLOCK_K=max(config["BLOCK_K"], group),
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )
    return y


def matmul(x: torch.Tensor, t: dict[str, Any], fmt: str, group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantise(t).T + bias`` for 2-D ``x`` with a contiguous last dimension and up to 16 rows (the fused
    decode kernels: one row on the CUDA cores; 2-16 rows as the autotuner chose for the shape).

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
    kernels.dequantize_kernel[(cdiv(n, block_n), cdiv(k, block_k))](
        q, scale, t.get("offset", scale), t.get("global_scale", scale), w, n, k, q.stride(0), scale.stride(0),
        w.stride(0), FORMAT=FORMAT_IDS[fmt], GROUP=_kernel_group(fmt, group), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )
    return w
