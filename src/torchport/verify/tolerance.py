"""Default tolerances of :func:`torchport.verify.compare`, per dtype the target computes in.

A row passes when its relative error ‖out − ref‖₂ / ‖ref‖₂ is at most ``rtol``, or when every element is within
``atol`` of the reference (the floor for outputs near zero, where a relative error means nothing).

The rtol values leave room above the largest relative error measured against a float64 CPU reference on healthy
models (an MLP of 4 Linear-LayerNorm-GELU blocks, a small CNN with BatchNorm, a 2-layer GPT-2 from config;
batch 2 to 8; torch 2.13 on CPU and on the simulated NPU). Gradients (``backward=True``) come out several times worse than
forward outputs, because weight gradients are sums over the batch with cancellation:

=========  =================  ==================  =====  =====
dtype      largest, forward   largest, gradients  rtol   atol
=========  =================  ==================  =====  =====
float64    (unit round 1e-16)                     1e-10  1e-12
float32    3.8e-7             3.5e-6              1e-4   1e-6
float16    7.8e-4             9.4e-3              2e-2   1e-4
bfloat16   6.8e-3             2.1e-2              1e-1   1e-3
=========  =================  ==================  =====  =====

A bug that shifts one layer's unit-scale output by 1e-2 (relative error ~1e-2) is caught in float32 with a wide
margin, but hides inside float16's and bfloat16's own rounding at these defaults: check suspected small errors in
float32, or pass a tighter ``rtol``. Deep models accumulate more error than these small ones; ``rtol``/``atol``
given to :func:`compare` replace the defaults.
"""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "tolerance"]

#: dtype -> (rtol, atol)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-4, 1e-6),
    torch.float16: (2e-2, 1e-4),
    torch.bfloat16: (1e-1, 1e-3),
}


def tolerance(dtype: torch.dtype, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    """(rtol, atol) for a target dtype, the table's values where ``rtol``/``atol`` are None.

    Example:
        >>> tolerance(torch.bfloat16)
        (0.1, 0.001)
    """
    for name, given in (("rtol", rtol), ("atol", atol)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, (int, float)) or given < 0):
            raise ValueError(f"{name}={given!r} is not a tolerance; give a number >= 0, or None for the default")
    if rtol is not None and atol is not None:
        return float(rtol), float(atol)
    if dtype not in TOLERANCES:
        known = ", ".join(str(d).removeprefix("torch.") for d in TOLERANCES)
        raise ValueError(
            f"no default tolerance for {str(dtype).removeprefix('torch.')}; pass rtol= and atol= "
            f"(defaults exist for {known})"
        )
    default_rtol, default_atol = TOLERANCES[dtype]
    return (default_rtol if rtol is None else float(rtol)), (default_atol if atol is None else float(atol))
