"""Host cost of one forward + backward of torchport's ops where the device's time is nil (tiny inputs), against
PyTorch's own fused LayerNorm forward + backward on the same input: the launch path's price per call.

Every row is the median over ``--repeats`` runs of the mean time per call over ``--calls`` calls, all in one
process, so the rows compare with each other (the absolute figures depend on the machine and its load). On CUDA
(default when present) it also times liger-kernel's RMSNorm when installed; ``--device cpu`` and ``--device npu``
(the simulated NPU) measure the Python side of the path on any machine. ``--profile`` adds a cProfile of
torchport's RMSNorm step, sorted by own time. Writes JSON with ``--json``.

    PYTHONPATH=src python benchmarks/kernel_host_overhead.py --device cpu --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import torchport


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # the simulated NPU runs on the host: nothing to wait for
        torch.accelerator.synchronize(device)


def per_call_us(fn: Callable[[], None], device: torch.device, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean host time of one call of ``fn``, in microseconds."""
    for _ in range(20):
        fn()
    _sync(device)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def cases(device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    """The tiny forward + backward steps: a 4 x 64 input (4 x 96 logits), one upstream gradient."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()

    x, w, b = leaf(4, 64), leaf(64), leaf(64)
    dy = torch.randn(4, 64, generator=gen).to(device, dtype)
    q, k = leaf(1, 2, 4, 16), leaf(1, 1, 4, 16)
    cos, sin = (t.to(device, dtype) for t in torchport.kernels.spec.rope_tables(4, 16))
    logits, target = leaf(4, 96), torch.tensor([1, 5, -100, 7], device=device)
    kernels = torchport.kernels
    return {
        "torch layer_norm fwd+bwd": lambda: F.layer_norm(x, (64,), w, b).backward(dy),
        "torchport rms_norm fwd+bwd": lambda: kernels.rms_norm(x, w).backward(dy),
        "torchport layer_norm fwd+bwd": lambda: kernels.layer_norm(x, w, b).backward(dy),
        "torchport swiglu fwd+bwd": lambda: kernels.swiglu(x, b.expand(4, 64)).backward(dy),
        "torchport rope fwd+bwd": lambda: sum(o.sum() for o in kernels.rope(q, k, cos, sin)).backward(),
        "torchport cross_entropy fwd+bwd": lambda: kernels.cross_entropy(logits, target).backward(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda, cpu, or npu (simulated unless torch_npu finds one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile torchport's RMSNorm step")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.device == "npu" and not hasattr(torch, "npu"):
        from torchport.testing import simulate_npu

        simulate_npu()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type != "cuda":
        # host-side arithmetic on tiny tensors: one thread, or the OpenMP pool's wake-ups (milliseconds on a loaded
        # machine) swamp the per-call cost being measured
        torch.set_num_threads(1)
    steps = cases(device, dtype)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        LigerRMSNormFunction = None
    if device.type == "cuda" and LigerRMSNormFunction is not None:
        x = torch.randn(4, 64, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(64, device=device, dtype=dtype, requires_grad=True)
        steps["liger rms_norm fwd+bwd"] = lambda: LigerRMSNormFunction.apply(x, w, 1e-6).backward(torch.ones_like(x))
    rows = {name: per_call_us(fn, device, args.calls, args.repeats) for name, fn in steps.items()}
    base = rows["torch layer_norm fwd+bwd"]
    print(f"host time per call on {device} ({args.dtype}, tiny inputs; median of {args.repeats} x {args.calls} calls)")
    for name, us in rows.items():
        print(f"  {name:34} {us:8.1f} us   {us / base:5.2f}x torch layer_norm")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        per_call_us(steps["torchport rms_norm fwd+bwd"], device, args.calls, 1)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "dtype": args.dtype, "us_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()
