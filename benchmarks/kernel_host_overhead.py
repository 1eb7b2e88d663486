"""Host cost of one forward + backward of torchport's ops where the device's time is nil (tiny inputs), against
PyTorch's own fused LayerNorm forward + backward on the same input: the launch path's price per call.

Every row is the median over ``--repeats`` runs of the mean time per call over ``--calls`` calls, all in one
process, so the rows compare with each other (the absolute figures depend on the machine and its load). On CUDA
(default when present) it also times liger-kernel's RMSNorm when installed; ``--device cpu`` and ``--device npu``
(the simulated NPU) measure the Python side of the path on any machine. ``--profile`` adds a cProfile of
torchport's RMSNorm step, sorted by own time; ``--pieces`` (CUDA) times the pieces of that step one by one: a
Triton launch through ``kernel[grid]``, through torchport's bound launcher (``kernels/triton/launch.py``) and
through the compiled kernel alone, an allocation, one ATen launch, an autograd round trip of a no-op Function,
PyTorch's LayerNorm and torchport's RMSNorm forward without and with autograd, and each one's backward alone,
through the autograd engine (gradients accumulated into the leaves) and as its node called directly on the calling
thread (the engine runs a CUDA graph's nodes on a device thread of its own), and fwd + bwd with the engine's
device threads off (``torch.autograd.set_multithreading_enabled(False)``). Writes JSON with ``--json``.

    PYTHONPATH=src python benchmarks/kernel_host_overhead.py --device cpu --profile
    PYTHONPATH=src python benchmarks/kernel_host_overhead.py --device cuda --pieces
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
    """The tiny forward + backward steps: a 4 x 64 input (4 x 96 logits), an upstream gradient per output."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()

    x, w, b = leaf(4, 64), leaf(64), leaf(64)
    dy = torch.randn(4, 64, generator=gen).to(device, dtype)
    q, k = leaf(1, 2, 4, 16), leaf(1, 1, 4, 16)
    dq, dk = (torch.randn(t.shape, generator=gen).to(device, dtype) for t in (q, k))
    cos, sin = (t.to(device, dtype) for t in torchport.kernels.spec.rope_tables(4, 16))
    logits, target = leaf(4, 96), torch.tensor([1, 5, -100, 7], device=device)
    kernels = torchport.kernels
    return {
        "torch layer_norm fwd+bwd": lambda: F.layer_norm(x, (64,), w, b).backward(dy),
        "torchport rms_norm fwd+bwd": lambda: kernels.rms_norm(x, w).backward(dy),
        "torchport layer_norm fwd+bwd": lambda: kernels.layer_norm(x, w, b).backward(dy),
        "torchport swiglu fwd+bwd": lambda: kernels.swiglu(x, b.expand(4, 64)).backward(dy),
        "torchport geglu fwd+bwd": lambda: kernels.geglu(x, b.expand(4, 64)).backward(dy),
        # both outputs' upstream gradients given, as LayerNorm's row gives its one: no reduction ops in the step
        "torchport rope fwd+bwd": lambda: torch.autograd.backward(kernels.rope(q, k, cos, sin), (dq, dk)),
        "torchport cross_entropy fwd+bwd": lambda: kernels.cross_entropy(logits, target).backward(),
    }


def pieces(device: torch.device, dtype: torch.dtype, calls: int, repeats: int) -> dict[str, float]:
    """Host time of each piece of torchport's RMSNorm step on a 4 x 64 input, in microseconds (CUDA)."""
    from triton.runtime.driver import driver

    from torchport.kernels.triton import norm
    from torchport.kernels.triton.launch import Kernel

    x = torch.randn(4, 64, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(64, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(64, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(4, 64, device=device, dtype=dtype)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    y, rstd = torch.empty(4, 64, device=device, dtype=dtype), torch.empty(4, device=device)
    args = (xd, wd, wd, y, rstd, rstd, 4, 64, 64, 64, 1e-6, 0.0)
    meta = {"IS_RMS": True, "HAS_W": True, "HAS_B": False, "BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4}
    compiled = norm._fwd_kernel[(1,)](*args, **meta)
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    bound = Kernel(norm._fwd_kernel)
    constexprs = tuple(meta[p.name] for p in norm._fwd_kernel.params if p.is_constexpr)

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, g):
            return g, None

    kernels = torchport.kernels
    # The backward alone: through the autograd engine (which runs a CUDA graph's nodes on its device thread and,
    # for a Python node, takes the GIL there), and the same node called directly on this thread.
    ours, theirs = kernels.rms_norm(x, w), F.layer_norm(x, (64,), w, b)
    ours_node = getattr(ours.grad_fn, "apply", ours.grad_fn)  # a Python Function's node runs its backward by apply
    xc, wc = x.detach().cpu().requires_grad_(), w.detach().cpu().requires_grad_()
    dyc = dy.cpu()
    steps = {
        "triton kernel[grid](...)": lambda: norm._fwd_kernel[(1,)](*args, **meta),
        "torchport launch.Kernel.launch": lambda: bound.launch((1,), *args, **meta),
        "CompiledKernel.run alone": lambda: compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata,
                                                         None, None, None, *args, *constexprs),
        "torch.empty(4, 64)": lambda: torch.empty((4, 64), device=device),
        "current device and stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
        "one ATen launch (add_)": lambda: y.add_(1.0),
        "y.sum(0)": lambda: y.sum(0),
        "no-op autograd.Function fwd+bwd": lambda: Noop.apply(x, w).backward(dy),
        "x * 1 fwd+bwd": lambda: (x * 1.0).backward(dy),
        "torch layer_norm fwd, no grad": lambda: F.layer_norm(xd, (64,), wd, bd),
        "torch layer_norm fwd+bwd": lambda: F.layer_norm(x, (64,), w, b).backward(dy),
        "torchport rms_norm fwd, no grad": lambda: kernels.rms_norm(xd, wd),
        "torchport rms_norm fwd, with grad": lambda: kernels.rms_norm(x, w),
        "torchport rms_norm fwd+bwd": lambda: kernels.rms_norm(x, w).backward(dy),
        "no-op autograd.Function fwd+bwd, CPU tensors": lambda: Noop.apply(xc, wc).backward(dyc),
        "x * 1 fwd+bwd, CPU tensors": lambda: (xc * 1.0).backward(dyc),
        "torch layer_norm bwd through the engine": lambda: theirs.backward(dy, retain_graph=True),
        "torch layer_norm bwd node called directly": lambda: theirs.grad_fn(dy),
        "torchport rms_norm bwd through the engine": lambda: ours.backward(dy, retain_graph=True),
        "torchport rms_norm bwd node called directly": lambda: ours_node(dy),
        "torchport rms_norm fwd+bwd, retain_graph": lambda: kernels.rms_norm(x, w).backward(dy, retain_graph=True),
        "torchport rms_norm fwd + autograd.grad": lambda: torch.autograd.grad(kernels.rms_norm(x, w), (x, w), dy),
        "torch layer_norm fwd + autograd.grad": lambda: torch.autograd.grad(F.layer_norm(x, (64,), w, b), (x, w, b),
                                                                            dy),
    }
    # The same steps with the engine's device threads off: every node runs on the calling thread.
    single = {
        "torch layer_norm fwd+bwd, autograd multithreading off": steps["torch layer_norm fwd+bwd"],
        "torchport rms_norm fwd+bwd, autograd multithreading off": steps["torchport rms_norm fwd+bwd"],
        "no-op autograd.Function fwd+bwd, autograd multithreading off": steps["no-op autograd.Function fwd+bwd"],
    }
    times = {name: per_call_us(fn, device, calls, repeats) for name, fn in steps.items()}
    with torch.autograd.set_multithreading_enabled(False):
        times.update({name: per_call_us(fn, device, calls, repeats) for name, fn in single.items()})
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda, cpu, or npu (simulated unless torch_npu finds one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile torchport's RMSNorm step")
    parser.add_argument("--pieces", action="store_true", help="time the pieces of torchport's RMSNorm step (CUDA)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.device == "npu" and not hasattr(torch, "npu"):
        from torchport.testing import simulate_npu

        simulate_npu()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.pieces and device.type != "cuda":
        parser.error(f"--pieces times Triton's compiled launcher: it needs --device cuda, not {device.type}")
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
    parts = pieces(device, dtype, args.calls, args.repeats) if args.pieces else {}
    if parts:
        print(f"pieces of torchport's RMSNorm step on {device} (median of {args.repeats} x {args.calls} calls)")
        for name, us in parts.items():
            print(f"  {name:34} {us:8.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "dtype": args.dtype, "us_per_call": rows, "pieces_us": parts}, f,
                      indent=1)


if __name__ == "__main__":
    main()
