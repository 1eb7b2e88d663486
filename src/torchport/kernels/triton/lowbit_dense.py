"""The low-bit matmul's dense route (the ``DENSE`` choice of :mod:`.lowbit_tuning`, prefill's usual one): the weight
dequantised into the activation dtype by ``dequantize_kernel`` in one pass over its codes, then the vendor matmul;
and the views of a format's tensors (:func:`as_bytes`, :func:`kernel_group`) that every low-bit launch of
:mod:`.lowbit` passes to its kernel, the dense route's included.

At 2048 rows a dense matmul is bound by the tensor cores, so what the route adds is one write of the bf16 weight
per call (2 bytes a weight: 15 GB for an 8B model's linear layers), which the write rate of the device bounds
(~2.95 TB/s on an H200); the kernel runs at 1.12-1.25x that floor. A GEMM with the decoding inside it would avoid
the write, but on an H200 at 2048 rows a Triton bf16 GEMM (TMA, six tiles) ran at 0.78-0.89x cuBLAS's speed on the
8B model's layer shapes before any decoding, and at 1.44-1.61x the dense route's time with int4 decoded in its
loop (RESULTS.md, issue 24), so the route stays dequantise + cuBLAS.

A weight whose dense copy would pass :data:`CHUNK_BYTES` (an LM head) is dequantised and multiplied in slices of
output features, each written into its columns of the output, so that the copy never exists whole.
"""

from __future__ import annotations

from typing import Any

import torch

from . import cdiv, lowbit_kernels as kernels, multiprocessor_count, nvidia
from .launch import Kernel, Prepared
from .lowbit_decode import FORMAT_IDS
from .lowbit_tuning import PER_CHANNEL

__all__ = ["CHUNK_ALIGN", "CHUNK_BYTES", "DensePlan", "Dequantizer", "as_bytes", "dense", "dequantize",
           "dequantize_launch", "kernel_group", "whole"]

# The largest dequantised weight made in one piece (bytes), and the slice granularity in output features
CHUNK_BYTES = 128 * 2**20
CHUNK_ALIGN = 128
_DEQUANTIZE_KERNEL = Kernel(kernels.dequantize_kernel)


def as_bytes(fmt: str, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 codes (fp8) and block scales (nvfp4) as their bytes: the kernels decode the bits themselves."""
    if fmt == "fp8":
        q = q.view(torch.uint8)
    if fmt == "nvfp4":
        scale = scale.view(torch.uint8)
    return q, scale


def kernel_group(fmt: str, group: int) -> int:
    """The kernels' ``GROUP``: per-channel formats pass one constant, not one compile per width."""
    return 1 if fmt in PER_CHANNEL else group


def _rows_whole(k: int, itemsize: int) -> int:
    """How many output features of ``k`` inputs fit in :data:`CHUNK_BYTES` of dense weight."""
    return CHUNK_BYTES // max(1, k * itemsize)


def whole(n: int, k: int, itemsize: int) -> bool:
    """Whether an ``(n, k)`` dense weight of ``itemsize`` bytes a value is made in one piece (not sliced)."""
    return n <= _rows_whole(k, itemsize)


def dense(x: torch.Tensor, t: dict[str, Any], fmt: str, group: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Dequantise + the vendor matmul; past :data:`CHUNK_BYTES` of dense weight, slice by slice of output
    features. On an H100 at 2048 rows the 128256 x 4096 LM head in 16384-feature slices peaked at 629 MiB above its
    inputs instead of 1503 (the 501 MiB output included), at -2% to +8% of the whole weight's time by format; the
    other layers of an 8B model stay whole (RESULTS.md, issue 24)."""
    n, k = t["qweight"].shape[0], x.shape[1]
    rows = _rows_whole(k, x.element_size())
    if n <= rows:
        return torch.nn.functional.linear(x, dequantize(t, fmt, group, x.dtype), bias)
    rows = max(CHUNK_ALIGN, rows // CHUNK_ALIGN * CHUNK_ALIGN)
    y = x.new_empty((x.shape[0], n))
    for start in range(0, n, rows):
        part = {name: v[start:start + rows] if v.dim() and v.shape[0] == n else v for name, v in t.items()}
        w = dequantize(part, fmt, group, x.dtype)
        out = y[:, start:start + rows]
        if bias is None:
            torch.mm(x, w.t(), out=out)
        else:
            torch.addmm(bias[start:start + rows].to(x.dtype), x, w.t(), out=out)
        del w  # the next slice reuses its memory
    return y


class DensePlan:
    """The dense route of one weight, planned: its dequantise launch bound once, then the vendor matmul."""

    __slots__ = ("_dequantize",)

    def __init__(self, dequantizer: Dequantizer) -> None:
        self._dequantize = dequantizer

    def __call__(self, x: torch.Tensor, t: dict[str, Any], bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, self._dequantize(), bias)


class Dequantizer:
    """The dequantise launch of one weight's tensors into ``dtype``: its arguments built once; once its kernel has
    been launched, launched through :class:`.launch.Prepared` (a fresh output is the one argument that changes)."""

    __slots__ = ("_device", "_dtype", "_grid", "_head", "_meta", "_prepared", "_shape", "_tail")

    def __init__(self, t: dict[str, Any], fmt: str, group: int, dtype: torch.dtype) -> None:
        self._shape, self._device, self._grid, self._head, self._tail, self._meta = dequantize_launch(t, fmt, group)
        self._dtype = dtype
        self._prepared: Prepared | None = None

    def __call__(self) -> torch.Tensor:
        w = torch.empty(self._shape, dtype=self._dtype, device=self._device)
        args = (*self._head, w, *self._tail)
        prepared = self._prepared
        if prepared is not None and w.data_ptr() % 16 == 0 and prepared.launch(args):
            return w
        _DEQUANTIZE_KERNEL.launch(self._grid, *args, **self._meta)
        if prepared is None:
            self._prepared = _DEQUANTIZE_KERNEL.prepare(self._grid, *args, **self._meta)
        return w


def dequantize_launch(t: dict[str, Any], fmt: str, group: int) -> tuple[tuple[int, int], torch.device,
                                                                         tuple[int, int], tuple[Any, ...],
                                                                         tuple[Any, ...], dict[str, Any]]:
    """(weight shape, device, grid, runtime arguments before the output, those after it, constexprs) of the
    dequantise kernel, for a contiguous output (its row stride is in_features)."""
    q, scale = t["qweight"], t["scale"]
    n = q.shape[0]
    k = q.shape[1] * (1 if fmt in PER_CHANNEL else 2)
    q, scale = as_bytes(fmt, q, scale)
    block_n = 16
    # A whole number of groups per program. 4-bit tiles of 16 x 512 (nvfp4 on 8 warps) wrote the dense weight 7-13%
    # faster than 16 x 128 on an H200 where they still make 8 programs per multiprocessor, and 2-17% slower where
    # they make fewer (1024 x 4096: 512 programs); RESULTS.md, issue 24. Measured on NVIDIA only (the interpreter
    # takes them too, so that CI runs that launch)
    block_k = 256 if fmt in PER_CHANNEL else max(group, 128)
    measured = nvidia(q.device) or q.device.type == "cpu"
    if measured and fmt not in PER_CHANNEL and k >= 512:
        if cdiv(n, block_n) * cdiv(k, 512) >= 8 * multiprocessor_count(q.device):
            block_k = max(group, 512)
    head = (q, scale, t.get("offset", scale), t.get("global_scale", scale))
    tail = (n, k, q.stride(0), scale.stride(0), k)
    meta = dict(FORMAT=FORMAT_IDS[fmt], GROUP=kernel_group(fmt, group), BLOCK_N=block_n, BLOCK_K=block_k,
                num_warps=8 if fmt == "nvfp4" and block_k >= 512 else 4)
    return (n, k), q.device, (cdiv(n, block_n), cdiv(k, block_k)), head, tail, meta


def dequantize(t: dict[str, Any], fmt: str, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``(out_features, in_features)`` weight in ``dtype``, in one pass over the codes."""
    shape, device, grid, head, tail, meta = dequantize_launch(t, fmt, group)
    w = torch.empty(shape, dtype=dtype, device=device)
    _DEQUANTIZE_KERNEL.launch(grid, *head, w, *tail, **meta)
    return w
