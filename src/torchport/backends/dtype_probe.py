"""Dtype probing: whether float32, bfloat16 and float16 compute correctly on a device, found by running a small
matmul + softmax in each and comparing it with a float64 host result. Backends cache the answers
(:meth:`torchport.backends.Backend.dtype_probes`) and decide their preferred and autocast dtypes from them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .base import Backend

__all__ = ["PROBED_DTYPES", "TOLERANCE", "DtypeProbe", "probe"]

logger = logging.getLogger("torchport")

PROBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest max-abs error of softmax(a @ b / 8) on 64x96x80 normal inputs against a float64 host result that still
# counts as working. Measured on CPU (torch 2.13): fp32 6.4e-7, bf16 3.4e-3, fp16 2.8e-4; the bounds leave a wide margin for
# other accumulation orders while catching a dtype that silently computes garbage or saturates.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclasses.dataclass(frozen=True)
class DtypeProbe:
    """The result of running a small matmul + softmax in one dtype on one device."""

    dtype: torch.dtype
    works: bool
    max_error: float | None
    ms: float | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "works": self.works,
            "max_error": self.max_error,
            "ms": self.ms,
            "error": self.error,
        }


def probe(backend: Backend, dtype: torch.dtype, index: int) -> DtypeProbe:
    """Run a small matmul + softmax in ``dtype`` on device ``index`` of ``backend`` and compare it with a float64
    host result: whether the dtype computes correctly there, its error and time.

    Example:
        >>> probe(get_backend("cpu"), torch.bfloat16, 0).works
        True
    """
    # host tensors, even inside a ``with torch.device(...)`` block that sets another default device
    gen = torch.Generator().manual_seed(1234)
    a = torch.randn(64, 96, generator=gen, device="cpu")
    b = torch.randn(96, 80, generator=gen, device="cpu")
    expected = torch.softmax(a.double() @ b.double() / 8, dim=-1)
    device = backend.device(index)
    try:
        x, y = a.to(device, dtype), b.to(device, dtype)
        torch.softmax(x @ y / 8, dim=-1)  # warm-up: first launches compile or load kernels
        backend.synchronize(index)
        start = time.perf_counter()
        out = torch.softmax(x @ y / 8, dim=-1)
        backend.synchronize(index)
        ms = (time.perf_counter() - start) * 1e3
        error = (out.to("cpu", torch.float64) - expected).abs().max().item()
    except Exception as exc:  # a dtype the device lacks fails in many ways; all of them mean "does not work"
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        logger.debug("dtype probe %s on %s failed: %s", dtype, device, reason)
        return DtypeProbe(dtype, False, None, None, reason)
    works = math.isfinite(error) and error <= TOLERANCE[dtype]
    note = None if works else f"max error {error:.3g} exceeds {TOLERANCE[dtype]:g}"
    return DtypeProbe(dtype, works, error, ms, note)
