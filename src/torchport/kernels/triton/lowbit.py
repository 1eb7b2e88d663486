"""Low-bit weight matmul in Triton: ``y = x @ dequantise(W).T (+ bias)``, which kernel runs and how it is launched.

Decode is bound by reading the weight: an 8B-shaped Llama reads 15.0 GB of bf16 linear weights per token, 7.5 GB in
int8/fp8 and about 4 GB in 4-bit formats, which is the whole speed-up low-bit weights can give at batch 1 (5.0 ms
-> 1.3 ms per token at the H100's 3 TB/s). The kernels (:mod:`.lowbit_kernels`) read each code byte once and
decode it in registers:

* one row (batch-1 decode): a kernel on the CUDA cores, codes read as int32 words and decoded with few integer
  operations per code (``gemv_kernel``), K split over ``SPLIT`` programs where the output features alone give
  too few (the partials summed by the last program of each tile: :func:`.lowbit_decode.split_sum`), the next
  tile's words loaded ahead (``PREFETCH``); the previous tiling (``gemv4_kernel``/``gemv8_kernel``) stays a
  candidate of the autotuner;
* 2 to 16 rows: the autotuner picks per shape bucket among the decode-in-prologue tensor-core GEMM
  (``gemm_kernel``, 16-row tiles, K split), the earlier tensor-core kernel, the one-row kernel launched once for
  every row (up to 4 rows; the rows of one weight block share its bytes through L2), and dequantise + dense matmul;
* int4 at 1 to 16 rows, a candidate in both lists: ``int4_mma_kernel`` (:mod:`.lowbit_int4_mma`), the weight as
  the tensor cores' register operand with two codes decoded by one ``lop3``, which costs 16 rows about what it costs
  one;
* more rows (prefill): ``gemm_kernel`` with large tiles, or the dense route (:mod:`.lowbit_dense`: the weight
  dequantised into the activation dtype in one pass, then the vendor matmul; ``QuantizedLinear.cache_dequantized``
  keeps that weight between calls), which the tuner keeps at 2048 rows.

``gemm_kernel`` is a candidate in two orientations: the activations as the dot's A operand, or (``WEIGHT_A``) the
decoded weights, which Hopper's tensor cores take from registers (RESULTS.md, issue 24: up to 25% faster at 2048
rows, a few % at 16 rows on some layers).

Launch configurations are autotuned per shape bucket (:mod:`.autotune`, which times each candidate with L2 cleared:
a decode step reads every weight once, from DRAM); the candidates and buckets are in :mod:`.lowbit_tuning`, where
``KERNEL`` in a configuration names the kernel (``GEMV``, ``GEMV_TILED``, ``MMA``, ``ROWS``, ``DENSE``, ``GEMM``,
``INT4_MMA``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import autotune, cdiv, lowbit_kernels as kernels, multiprocessor_count, nvidia
from ..checks import capturing
from .lowbit_decode import FORMAT_IDS, MAGIC_BITS, SIGN_BITS
from .lowbit_gemm import gemm_kernel
from .lowbit_gemv import gemv_kernel
from .lowbit_int4_mma import int4_mma_kernel
from .lowbit_tuning import (DECODE_ROWS, DENSE, GEMM, GEMV, GEMV_TILED, INT4_MMA, MMA, PER_CHANNEL, ROWS, TUNED,
                            TUNED_GEMV, TUNED_PREFILL, tiled_candidates, words_fit)
from .launch import Kernel, Prepared
from . import lowbit_dense
from .lowbit_dense import as_bytes, dequantize, kernel_group

__all__ = ["DECODE_ROWS", "FORMAT_IDS", "Planned", "dequantize", "matmul", "plan", "supports"]

Launch = Callable[..., torch.Tensor]  # (config, x, t, fmt, group, bias) -> y
Planned = Callable[[torch.Tensor, dict[str, Any], torch.Tensor | None], torch.Tensor]  # (x, t, bias) -> y

# The launchers bind each compiled specialisation once (launch.py): Triton's own launch path cost 32-85 us of host
# time per one-row call on an H100 host, more than the 5-30 us the kernels run (RESULTS.md, issue 24).
(_MATMUL_KERNEL, _GEMM_KERNEL, _GEMV_KERNEL, _GEMV4_KERNEL, _GEMV8_KERNEL, _INT4_MMA_KERNEL) = map(
    Kernel, (kernels.matmul_kernel, gemm_kernel, gemv_kernel, kernels.gemv4_kernel, kernels.gemv8_kernel,
             int4_mma_kernel))


def supports(fmt: str, group: int, k: int) -> str | None:
    """Why the kernels cannot take this layout (None when they can): Triton tiles are powers of two."""
    if fmt in PER_CHANNEL:
        return None
    if group & (group - 1) or group < (32 if fmt == "int4" else 16):
        return f"the Triton kernels need a power-of-two group of at least 32 for {fmt}; this layer has {group}"
    return None

def _split_k(block_n: int, block_k: int, m_blocks: int, n: int, k: int, device: torch.device) -> int:
    programs = m_blocks * cdiv(n, block_n)
    target = 4 * multiprocessor_count(device)
    split = 1
    while programs * split * 2 <= target and k // (split * 2) >= 4 * block_k:
        split *= 2
    return split


_WORKSPACES: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, parts: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float32 partial sums (``parts`` values) and int32 tile counters (``tiles``, zero between launches) for a
    split-K launch: one pair per size, kept for the process, so that CUDA graphs replaying a launch keep valid
    addresses (launches of one size on concurrent streams would share it: decode runs on one stream). None while
    a graph is being captured and the pair does not exist yet (its zero-fill would only run at replay)."""
    key = (device, parts, tiles)
    buffers = _WORKSPACES.get(key)
    if buffers is None:
        if capturing(device):
            return None
        buffers = (torch.empty(parts, dtype=torch.float32, device=device),
                   torch.zeros(tiles, dtype=torch.int32, device=device))
        _WORKSPACES[key] = buffers
    return buffers


def _launch(config: autotune.Config, x: torch.Tensor, t: dict[str, Any], fmt: str, group: int,
            bias: torch.Tensor | None) -> torch.Tensor:
    kernel = config.get("KERNEL", MMA)
    if kernel == ROWS and words_fit(fmt, x.shape[1]):
        return _launch_words(config, x, t, fmt, group, bias)
    if kernel == DENSE:
        return lowbit_dense.dense(x, t, fmt, group, bias)
    if kernel == GEMM:
        return _launch_gemm(config, x, t, fmt, group, bias)
    if kernel == INT4_MMA:
        return _launch_int4_mma(config, x, t, group, bias)
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
    q, scale = as_bytes(fmt, q, scale)
    _MATMUL_KERNEL.launch(
        (cdiv(n, block_n), split, m_blocks),
        x, q, scale, t.get("offset", scale), t.get("global_scale", scale), scale if bias is None else bias, y,
        m, n, k, k_split, x.stride(0), q.stride(0), scale.stride(0), y.stride(0),
        FORMAT=FORMAT_IDS[fmt], GROUP=kernel_group(fmt, group), HAS_BIAS=bias is not None, ATOMIC=atomic,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=x.device.type == "cpu",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=config["num_warps"],
    )
    return y.to(x.dtype) if atomic else y


def _split_ranges(split: int, total: int, block: int) -> tuple[int, int]:
    """(splits, elements per split): ``total`` cut into at most ``split`` ranges, each a multiple of ``block``."""
    per = cdiv(cdiv(total, split), block) * block
    return cdiv(total, per), per


def _split_workspace(y: torch.Tensor, split: int, per: int, total: int,
                     tiles: int) -> tuple[int, int, tuple[torch.Tensor, torch.Tensor]]:
    """(splits, elements per split, (partials, counters)) for a launch writing ``y``: the workspace of
    :func:`_workspace` when K is split, else no split and ``y`` in the workspace's place (the kernels read neither)."""
    buffers = _workspace(y.device, split * y.numel(), tiles) if split > 1 else None
    if buffers is None:
        return 1, total, (y, y)
    return split, per, buffers


def _launch_gemm(config: autotune.Config, x: torch.Tensor, t: dict[str, Any], fmt: str, group: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``gemm_kernel``: the K split derived as for the tensor-core kernel (none for prefill's many row tiles)."""
    m, k = x.shape
    q, scale = as_bytes(fmt, t["qweight"], t["scale"])
    n = q.shape[0]
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    y = x.new_empty((m, n))
    split, k_split, buffers = _split_workspace(
        y, *_split_ranges(_split_k(block_n, block_k, cdiv(m, block_m), n, k, x.device), k, block_k), k, tiles)
    _GEMM_KERNEL.launch(
        (tiles, split),
        x, q, scale, t.get("offset", scale), t.get("global_scale", scale), scale if bias is None else bias, y,
        *buffers, m, n, k, k_split, x.stride(0), q.stride(0), scale.stride(0), y.stride(0),
        FORMAT=FORMAT_IDS[fmt], GROUP=kernel_group(fmt, group), HAS_BIAS=bias is not None, SPLIT=split,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=x.device.type == "cpu",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, WEIGHT_A=bool(config.get("WEIGHT_A", False)),
        num_warps=config["num_warps"], num_stages=config.get("num_stages", 3),
    )
    return y


def _launch_words(config: autotune.Config, x: torch.Tensor, t: dict[str, Any], fmt: str, group: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``gemv_kernel``: one program per row of ``x``, block of output features and K range (rows fastest, so that
    the rows of one block run side by side and read its codes from L2)."""
    return _WordsPlan(config, x, t, fmt, group, bias).launch(x, bias)


def _launch_int4_mma(config: autotune.Config, x: torch.Tensor, t: dict[str, Any], group: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """``int4_mma_kernel``: up to 16 rows in one program per block of output features and K range (a whole number
    of groups); the ``lop3`` decode on NVIDIA GPUs with 16-bit activations, integer decoding elsewhere."""
    m, k = x.shape
    words = t["qweight"].view(torch.int32)
    scale = t["scale"]
    n, n_words = words.shape
    block_n = config["BLOCK_N"]
    y = x.new_empty((m, n))
    tiles = cdiv(n, block_n)
    split, w_split, buffers = _split_workspace(y, *_split_ranges(config.get("SPLIT", 1), n_words, group // 8),
                                               n_words, tiles)
    _INT4_MMA_KERNEL.launch(
        (tiles, split),
        x, words, scale, t["offset"], scale if bias is None else bias, y, *buffers, m, n, k, w_split, x.stride(0),
        words.stride(0), scale.stride(0), y.stride(0), GROUP=group, HAS_BIAS=bias is not None,
        ASM=nvidia(x.device) and x.dtype in (torch.bfloat16, torch.float16), EVEN=n % block_n == 0,
        PREFETCH=bool(config.get("PREFETCH", 0)), SPLIT=split,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=x.device.type == "cpu", BLOCK_N=block_n,
        BLOCK_M=DECODE_ROWS, num_warps=config["num_warps"], num_stages=config.get("num_stages", 3),
    )
    return y


def _launch_gemv(config: autotune.Config, x: torch.Tensor, t: dict[str, Any], fmt: str, group: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    if config.get("KERNEL") == INT4_MMA:
        return _launch_int4_mma(config, x, t, group, bias)
    if config.get("KERNEL", GEMV_TILED) == GEMV:
        if words_fit(fmt, x.shape[1]):
            return _launch_words(config, x, t, fmt, group, bias)
        config = tiled_candidates(fmt, t["qweight"].shape[0], x.shape[1], group)[0]
    k = x.shape[1]
    q, scale = as_bytes(fmt, t["qweight"], t["scale"])
    n = q.shape[0]
    y = x.new_empty((1, n))
    grid = (cdiv(n, config["BLOCK_N"]),)
    if fmt in PER_CHANNEL:
        _GEMV8_KERNEL.launch(
            grid,
            x, q, scale, scale if bias is None else bias, y, n, k, q.stride(0), scale.stride(0),
            FORMAT=FORMAT_IDS[fmt], HAS_BIAS=bias is not None, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )
    else:  # groups are powers of two >= 16 (supports()), so whole int32 words of codes lie inside one group
        words = q.view(torch.int32)
        _GEMV4_KERNEL.launch(
            grid,
            x, words, scale, t.get("offset", scale), t.get("global_scale", scale), scale if bias is None else bias, y,
            n, k, words.stride(0), scale.stride(0), FORMAT=FORMAT_IDS[fmt], GROUP=group,
            HAS_BIAS=bias is not None, BLOCK_N=config["BLOCK_N"], BLOCK_K=max(config["BLOCK_K"], group),
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )
    return y


def _route(fmt: str, m: int, n: int, k: int, group: int) -> tuple[autotune.Tunable, tuple[int, ...], Launch]:
    """Where a call of ``m`` rows is tuned and which launcher takes its configuration."""
    if m == 1:
        return TUNED_GEMV[fmt], (n, k, group), _launch_gemv
    return (TUNED if m <= DECODE_ROWS else TUNED_PREFILL)[fmt], (m, n, k, group), _launch


def matmul(x: torch.Tensor, t: dict[str, Any], fmt: str, group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantise(t).T + bias`` for 2-D ``x`` with a contiguous last dimension: one row on the CUDA cores;
    2-16 rows and more (prefill) as the autotuner chose for the shape.

    ``t`` holds the format's tensors (``qweight``, ``scale`` and, by format, ``offset`` / ``global_scale``), all
    contiguous; ``group`` is the format's group size (``in_features`` for per-channel formats).
    """
    m, k = x.shape
    tunable, sizes, launch = _route(fmt, m, t["qweight"].shape[0], k, group)
    config = tunable.lookup(x.device, x.dtype, *sizes)
    if config is None:
        config = tunable.tune(x.device, x.dtype, sizes, lambda c: launch(c, x, t, fmt, group, bias))
    return launch(config, x, t, fmt, group, bias)


def plan(x: torch.Tensor, t: dict[str, Any], fmt: str, group: int, bias: torch.Tensor | None) -> Planned | None:
    """:func:`matmul` for ``x``'s shape and dtype and these tensors, decided once: a callable ``(x, t, bias) -> y``
    that launches what ``matmul`` would launch now, for inputs of the same shape, dtype and device and the same
    tensor objects ``t`` (their values may change in place). None until the autotuner has chosen for the shape
    (call :func:`matmul` first). The dense route's dequantise launch and the one-row kernel's launch
    (``gemv_kernel``, the decode's usual choice) are bound to the weight's tensors; a call with a bias where the
    plan had none (or the reverse, or another dtype), or ``x`` with another row stride, launches as ``matmul``
    does.

    Example:
        >>> run = plan(x, t, "int4", 128, bias)   # after matmul(x, t, "int4", 128, bias) has run once
        >>> y = run(x, t, bias)               # == matmul(x, t, "int4", 128, bias)
    """
    m, k = x.shape
    n = t["qweight"].shape[0]
    tunable, sizes, launch = _route(fmt, m, n, k, group)
    config = tunable.lookup(x.device, x.dtype, *sizes)
    if config is None:
        return None
    if launch is _launch and config.get("KERNEL") == DENSE and lowbit_dense.whole(n, k, x.element_size()):
        return lowbit_dense.DensePlan(lowbit_dense.Dequantizer(t, fmt, group, x.dtype))
    words = (launch is _launch_gemv and config.get("KERNEL", GEMV_TILED) == GEMV) or \
        (launch is _launch and config.get("KERNEL", MMA) == ROWS)
    if words and words_fit(fmt, k) and not capturing(x.device):  # a capture may not make the K split's workspace
        return _WordsPlan(config, x, t, fmt, group, bias)
    return functools.partial(_configured, launch, config, fmt, group)


def _configured(launch: Launch, config: autotune.Config, fmt: str, group: int, x: torch.Tensor, t: dict[str, Any],
                bias: torch.Tensor | None) -> torch.Tensor:
    return launch(config, x, t, fmt, group, bias)


class _WordsPlan:
    """``gemv_kernel`` for one weight and row count: its grid, K split (none while a CUDA graph is captured before
    the workspace exists), workspace and arguments built once. :meth:`launch` launches it once (``_launch_words``);
    as a plan (:func:`plan`) it is called again and again, and once launched, launches through
    :class:`.launch.Prepared` while the activations and bias sit on 16-byte boundaries (the specialisation it was
    prepared for)."""

    __slots__ = ("_bias_dtype", "_config", "_fmt", "_grid", "_group", "_meta", "_parts", "_prepared", "_scale",
                 "_shape", "_static", "_tail", "_x_stride")

    def __init__(self, config: autotune.Config, x: torch.Tensor, t: dict[str, Any], fmt: str, group: int,
                 bias: torch.Tensor | None) -> None:
        m, k = x.shape
        q, scale = as_bytes(fmt, t["qweight"], t["scale"])
        n = q.shape[0]
        words = q.view(torch.int32)
        n_words = words.shape[1]
        block_n, block_w = config["BLOCK_N"], config["BLOCK_W"]
        tiles = cdiv(n, block_n)
        split, per = _split_ranges(config.get("SPLIT", 1), n_words, block_w)
        parts = _workspace(x.device, split * m * n, m * tiles) if split > 1 else None  # as _split_workspace
        if parts is None:
            split, per = 1, n_words
        self._config, self._fmt, self._group = config, fmt, group
        self._bias_dtype = None if bias is None else bias.dtype  # the specialisation's: no bias, or one of this dtype
        self._shape, self._x_stride, self._parts = (m, n), x.stride(0), parts
        self._grid = (m, tiles, split)
        self._static = (words, scale, t.get("offset", scale), t.get("global_scale", scale))
        self._scale = scale  # what the kernel gets in the bias's place when there is none (it reads nothing there)
        self._tail = (m, n, k, per, x.stride(0), words.stride(0), scale.stride(0), n, MAGIC_BITS, SIGN_BITS)
        even = n % block_n == 0 and n_words % per == 0 and per % block_w == 0
        self._meta = dict(FORMAT=FORMAT_IDS[fmt], GROUP=kernel_group(fmt, group), HAS_BIAS=bias is not None,
                          EVEN=even, SPLIT=split, PREFETCH=bool(config.get("PREFETCH", 0)), BLOCK_N=block_n,
                          BLOCK_W=block_w, num_warps=config["num_warps"])
        self._prepared: Prepared | None = None

    def _args(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, tuple[Any, ...]]:
        y = x.new_empty(self._shape)
        parts = self._parts or (y, y)  # no K split: the kernel reads no workspace
        return y, (x, *self._static, self._scale if bias is None else bias, y, *parts, *self._tail)

    def launch(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """One launch through :meth:`.launch.Kernel.launch`, for the ``x`` and ``bias`` the plan was made for."""
        y, args = self._args(x, bias)
        _GEMV_KERNEL.launch(self._grid, *args, **self._meta)
        return y

    def __call__(self, x: torch.Tensor, t: dict[str, Any], bias: torch.Tensor | None) -> torch.Tensor:
        if (None if bias is None else bias.dtype) != self._bias_dtype or x.stride(0) != self._x_stride:
            return _WordsPlan(self._config, x, t, self._fmt, self._group, bias).launch(x, bias)
        y, args = self._args(x, bias)
        aligned = x.data_ptr() % 16 == 0 and (bias is None or bias.data_ptr() % 16 == 0)
        prepared = self._prepared
        if prepared is not None and aligned and prepared.launch(args):
            return y
        _GEMV_KERNEL.launch(self._grid, *args, **self._meta)
        if prepared is None and aligned:
            self._prepared = _GEMV_KERNEL.prepare(self._grid, *args, **self._meta)
        return y
