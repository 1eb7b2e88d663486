"""Host cost of one RMSNorm forward + backward where GPU time is nil (a 4x64 input): torchport, eager, liger-kernel.

It shows how much of a step at benchmark sizes is the host's launch work rather than the kernels, then profiles
torchport's step with cProfile. CUDA only; liger-kernel is optional.

    PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/kernel_host_overhead.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch

import torchport


def per_step_us(fn: Callable[[], None], steps: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(4, 64, dtype=dt, device=dev, requires_grad=True)
    w = torch.randn(64, dtype=dt, device=dev, requires_grad=True)
    dy = torch.randn(4, 64, dtype=dt, device=dev)

    def eager() -> None:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        (w * h.to(dt)).backward(dy)

    cases = {
        "torchport fwd+bwd": lambda: torchport.kernels.rms_norm(x, w).backward(dy),
        "torchport fwd": lambda: torchport.kernels.rms_norm(x, w),
        "eager fwd+bwd": eager,
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        cases["liger fwd+bwd"] = lambda: LigerRMSNormFunction.apply(x, w, 1e-6).backward(dy)
    except ImportError as exc:
        print(f"liger-kernel not measured: {exc}")
    for name, fn in cases.items():
        print(f"{name}: {per_step_us(fn):.1f} us/step")
    profile = cProfile.Profile()
    profile.enable()
    per_step_us(cases["torchport fwd+bwd"])
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())


if __name__ == "__main__":
    main()
