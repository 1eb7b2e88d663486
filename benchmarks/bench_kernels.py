"""Fused kernels against their peers: RMSNorm, LayerNorm, SwiGLU, GeGLU, RoPE, cross-entropy, linear + CE, and every
other op of torchport.kernels (against its reference).

For each op, in one process on one device: eager PyTorch written as HF modeling code writes it, torch.compile of
that same function, liger-kernel (when importable) and torchport.kernels (forced to its Triton kernels on CUDA;
in-place variants as a second row). Each contender is checked against a float32 reference before it is timed.
Reports median ms of one forward + backward, achieved GB/s against the fewest bytes the op must move, % of the
device-to-device copy bandwidth measured in the same run, and peak memory. Prints a table per op, writes JSON and
a PNG chart.

    python benchmarks/bench_kernels.py                                  # the shapes of ../shared/BENCHMARKS.md
    python benchmarks/bench_kernels.py --ops rms_norm,rope --contenders eager,liger,torchport
    python benchmarks/bench_kernels.py --small                          # CPU smoke run, seconds
    python benchmarks/bench_kernels.py --sweep                          # 8192 rows, sizes 256 ... 262144 (GPU time)

Targets (issue 5), torchport against the fastest of eager, torch.compile and liger-kernel in the same run:
RMSNorm >= 2.0x, LayerNorm >= 1.5x, SwiGLU, GeGLU, RoPE >= 1.2x; peak memory <= the lowest of the three.
Issue 6: cross-entropy >= 1.8x; linear + cross-entropy no slower than eager, peak memory <= liger's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kernel_peers import (  # noqa: E402
    cce, cross_entropy_eager, geglu_eager, layer_norm_eager, linear_cross_entropy_eager, liger, rms_norm_eager, rope_eager,
    swiglu_eager)
from kernel_report import PEERS, _finite, device_name, git_commit, judge, plot, print_table, versions  # noqa: E402,F401
from kernel_sweep import SIZES as SWEEP_SIZES, SWEEP_OPS, run_sweep  # noqa: E402
from kernel_timing import Device, kernel_mode  # noqa: E402

# The ops, their input shapes (sizes "benchmark" and, for --small, "smoke"), inputs and the fewest bytes (and, for
# matmuls, FLOPs) one forward + backward must move come from each op's spec in torchport/kernels/<op>.py; the
# peers (kernel_peers.py: eager as HF modeling code writes it, liger-kernel) and the targets are this benchmark's
# own. An op without an eager version there is compared with torchport's reference.


def _torchport(op: Op, in_place: bool) -> Callable:
    """torchport's public function for ``op`` (its spec's), with ``in_place=True`` for the in-place row."""
    if op.name == "fused_linear_cross_entropy":
        # a float32 loss, as eager's (and Hugging Face's) upcast logits give and liger returns; same cost
        return lambda h, w, t: op.call(h, w, t, loss_dtype=torch.float32)
    return (lambda *args: op.call(*args, in_place=True)) if in_place else op.call


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    title: str
    shape: tuple[int, ...]        # the spec's "benchmark" size
    small: tuple[int, ...]        # --small: its "smoke" size
    make: Callable                # (dims, dtype, device, generator) -> (args, upstream grads)
    eager: Callable
    bytes_moved: Callable
    flops: Callable | None
    target: float                 # speedup over the fastest peer
    arg_names: tuple[str, ...]
    out_names: tuple[str, ...]
    differentiable: int           # the leading arguments that need a gradient (RoPE: q, k; not cos, sin)
    in_place: bool                # torchport has an in_place=True variant
    call: Callable                # torchport's public function

    def describe(self, dims: tuple[int, ...]) -> str:
        if self.name == "rope":
            b, hq, hk, s, d = dims
            return f"{self.title} q {b}×{hq}×{s}×{d}, k {b}×{hk}×{s}×{d}"
        if self.name == "fused_linear_cross_entropy":
            n, h, v = dims
            return f"{self.title} {n} tokens, {h} → {v}"
        return f"{self.title} {'×'.join(map(str, dims))}"


# op -> (eager version, target speedup over the fastest peer, output names). Targets: RMSNorm >= 2.0x, LayerNorm
# >= 1.5x, SwiGLU, GeGLU, RoPE >= 1.2x; cross-entropy >= 1.8x; linear + CE no slower than eager (1.0x) with peak
# memory <= liger's.
PEER_OPS: dict[str, tuple[Callable, float, tuple[str, ...]]] = {
    "rms_norm": (rms_norm_eager, 2.0, ("y",)),
    "layer_norm": (layer_norm_eager, 1.5, ("y",)),
    "swiglu": (swiglu_eager, 1.2, ("y",)),
    "geglu": (geglu_eager, 1.2, ("y",)),
    "rope": (rope_eager, 1.2, ("q", "k")),
    "cross_entropy": (cross_entropy_eager, 1.8, ("loss",)),
    "fused_linear_cross_entropy": (linear_cross_entropy_eager, 1.0, ("loss",)),
}


def _inputs(spec: Any) -> Callable:
    def make(dims, dtype, device, gen):
        host = spec.make(gen, *dims)
        args = tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in host)
        with torch.no_grad(), kernel_mode("reference"):
            outs = _as_tuple(spec.call(*args))
        grads = tuple(torch.ones((), dtype=dtype, device=device) if o.dim() == 0
                      else torch.randn(o.shape, generator=gen, device=gen.device).to(device, dtype) for o in outs)
        return args, grads
    return make


def _reference_of(spec: Any) -> Callable:
    import torchport

    def eager(*args):
        with torchport.settings.override(kernels=f"{spec.name}=reference"):
            return spec.call(*args)
    return eager


def _ops() -> dict[str, Op]:
    import inspect

    from torchport.kernels.registry import list_specs

    specs = list_specs()
    ops = {}
    for name, spec in sorted(specs.items(), key=lambda item: list(PEER_OPS).index(item[0]) if item[0] in PEER_OPS
                             else len(PEER_OPS)):
        eager, target, outs = PEER_OPS.get(name, (_reference_of(spec), 1.0, ("out",)))
        count = len(spec.make(None, *spec.sizes["test"]))
        arg_names = tuple(list(inspect.signature(spec.call).parameters)[:count])
        ops[name] = Op(name, spec.title, spec.sizes["benchmark"], spec.sizes["smoke"], _inputs(spec), eager,
                       spec.bytes_moved, spec.flops, target, arg_names, outs, spec.differentiable, spec.in_place,
                       spec.call)
    return ops


OPS = _ops()

CONTENDERS = ("eager", "compile", "liger", "cce", "torchport", "torchport-inplace")
LABELS = {"eager": "eager", "compile": "torch.compile", "liger": "liger-kernel", "cce": "cut-cross-entropy",
          "torchport": "torchport",
          "torchport-inplace": "torchport in-place"}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --- measuring -----------------------------------------------------------------------------------------------------
def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _fresh(args: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]):
    """Copies of the inputs (leaves that need grad, except cos/sin) and upstream grads: in-place contenders
    overwrite them."""
    copies = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
    return copies, tuple(g.clone() for g in grads)


def reference(op: Op, args, grads) -> list[torch.Tensor]:
    """Outputs then input gradients of the eager function in float32."""
    ref_args = [a.detach().float().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in args]
    outs = _as_tuple(op.eager(*ref_args))
    torch.autograd.backward(outs, [g.float() for g in grads])
    return [o.detach() for o in outs] + [a.grad for a in ref_args if a.requires_grad]


def check(op: Op, fn: Callable, base_args, base_grads, ref: list[torch.Tensor]) -> tuple[dict[str, float], bool]:
    """‖a − b‖ / ‖b‖ of every output and input gradient against the float32 reference, and whether the call
    overwrote its inputs or upstream gradient."""
    args, grads = _fresh(base_args, base_grads)
    live = _as_tuple(fn(*args))
    outs = [o.detach().to(torch.float32, copy=True) for o in live]
    torch.autograd.backward(live, grads)
    names = list(op.out_names) + [f"d{n}" for n, a in zip(op.arg_names, args) if a.requires_grad]
    got = outs + [a.grad for a in args if a.requires_grad]
    # in-place contenders write gradients over their inputs or the upstream gradient: time them on fresh copies
    overwritten = any(not torch.equal(mine, base) for mine, base in zip(args + grads, base_args + base_grads))
    errors = {}
    for name, a, b in zip(names, got, ref):
        if a is None:
            errors[name] = math.inf
            continue
        a = a.to(torch.float32)
        errors[name] = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))
    return errors, overwritten


def measure(op: Op, name: str, fn: Callable, base_args, base_grads, ref, dev: Device, tol: float) -> dict:
    row: dict[str, Any] = {"contender": name, "label": LABELS[name], "status": "ok"}
    try:
        errors, overwrites = check(op, fn, base_args, base_grads, ref)
        row["rel_err"] = max(errors.values())
        row["rel_err_each"] = errors
        if not row["rel_err"] <= tol:  # also catches NaN
            row["status"] = "FAIL"
        shown = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
        print(f"  {LABELS[name]:<19} check: {shown} -> {row['status']}")
        args, grads = _fresh(base_args, base_grads)
        leaves = [a for a in args if a.requires_grad]

        def step() -> None:
            torch.autograd.backward(_as_tuple(fn(*args)), grads)

        def restore() -> None:
            with torch.no_grad():
                for mine, base in zip(args + grads, base_args + base_grads):
                    mine.copy_(base)

        row["peak_mib"] = dev.peak_mib(step, leaves)
        if row["peak_mib"] is not None:  # what the op holds beyond the gradients it must return
            grad_bytes = sum(a.numel() * a.element_size() for a in leaves)
            row["beyond_grads_mib"] = row["peak_mib"] - grad_bytes / 2**20
        row["overwrites_inputs"] = overwrites
        row["median_ms"] = dev.median_ms(step, leaves, restore if overwrites else None)
        if not overwrites:
            try:
                row["gpu_ms"] = dev.graph_ms(step, leaves)
            except Exception as exc:  # noqa: BLE001 - not capturable in a CUDA graph: no GPU-only figure
                row["gpu_ms_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                print(f"  {LABELS[name]:<19} no CUDA-graph time: {row['gpu_ms_error']}")
    except Exception as exc:  # noqa: BLE001 - a contender that cannot run is a row, not the end of the run
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        row.update(status="error", error=message)
        print(f"  {LABELS[name]:<19} error: {message}")
    return row


def contender_fn(op: Op, name: str) -> tuple[Callable | None, str | None]:
    """The function for one contender, or None and the reason it cannot run here."""
    try:
        if name == "eager":
            return op.eager, None
        if name == "compile":
            return torch.compile(op.eager), None
        if name == "liger":
            return liger(op.name), None
        if name == "cce":  # linear + CE only
            return (cce(op.name), None) if op.name == "fused_linear_cross_entropy" else (None, None)
        if name == "torchport":
            return _torchport(op, in_place=False), None
        if name == "torchport-inplace":
            return (_torchport(op, in_place=True), None) if op.in_place else (None, None)
    except Exception as exc:  # noqa: BLE001 - reported as the contender's row
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    raise ValueError(name)


def bench_op(op: Op, dims, contenders, dtype, dev: Device, ceiling_gbps: float, mode: str) -> dict:
    gen = torch.Generator(device=dev.device).manual_seed(0)
    args, grads = op.make(dims, dtype, dev.device, gen)
    for a in args[:op.differentiable]:
        a.requires_grad_(True)
    nbytes = op.bytes_moved(*args)
    ref = reference(op, args, grads)
    print(f"{op.describe(dims)}, {str(dtype).removeprefix('torch.')}: {nbytes / 1e6:.1f} MB moved at the least, "
          f"{nbytes / ceiling_gbps / 1e6:.4f} ms at the copy ceiling")
    rows = []
    for name in contenders:
        fn, error = contender_fn(op, name)
        if fn is None and error is None:
            continue  # no in-place variant of this op
        if error is not None:
            print(f"  {LABELS[name]:<19} error: {error}")
            rows.append({"contender": name, "label": LABELS[name], "status": "error", "error": error})
            continue
        scope = kernel_mode(mode) if name.startswith("torchport") else contextlib.nullcontext()
        with scope:
            rows.append(measure(op, name, fn, args, grads, ref, dev, TOLERANCE[dtype]))
        dev.synchronize()
    flops = op.flops(*args) if op.flops is not None else None
    for row in rows:
        if row.get("median_ms"):
            row["gbps"] = nbytes / (row["median_ms"] * 1e-3) / 1e9
            row["pct_ceiling"] = 100 * row["gbps"] / ceiling_gbps
            if flops:
                row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
                print(f"  {LABELS[row['contender']]:<19} {row['tflops']:.1f} TFLOP/s (the op spec's FLOP count)")
    judge(op, rows)
    return {"op": op.name, "title": op.describe(dims), "dims": list(dims), "bytes_moved": nbytes,
            "ideal_ms": nbytes / ceiling_gbps / 1e6, "target_speedup": op.target, "rows": rows}


# --- output --------------------------------------------------------------------------------------------------------

def torchport_choices(device: torch.device, mode: str) -> dict[str, str] | str:
    """The implementation torchport picks for each op on ``device`` under ``mode`` (or why that is unknown)."""
    try:
        import torchport.kernels

        with kernel_mode(mode):
            return {row["op"]: row["implementation"] for row in torchport.kernels.table([device])}
    except Exception as exc:  # noqa: BLE001 - informative only
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--contenders", default=None,
                        help=f"subset of {','.join(CONTENDERS)} (default: all; --sweep: torchport,liger)")
    parser.add_argument("--sweep", action="store_true", help="the memory-bound ops over sizes (kernel_sweep.py)")
    parser.add_argument("--sweep-sizes", default=",".join(map(str, SWEEP_SIZES)), help="--sweep: hidden sizes")
    parser.add_argument("--sweep-rows", type=int, default=8192, help="--sweep: rows")
    parser.add_argument("--small", action="store_true", help="small shapes and a 64 MiB copy: a CPU smoke run")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--device", default=None, help="default: torchport.device()")
    parser.add_argument("--mode", default=None,
                        help="TORCHPORT_KERNELS for the torchport rows (default: triton on CUDA, auto elsewhere)")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up per measurement, ms (100; --small 10)")
    parser.add_argument("--rep", type=float, default=None, help="repetitions per measurement, ms (500; --small 50)")
    parser.add_argument("--json", default=None, help="default: benchmarks/results/kernels.json (kernels_small.json)")
    parser.add_argument("--plot", default=None, help="default: benchmarks/results/kernels.png (kernels_small.png)")
    parser.add_argument("--flce-workspace-mib", type=float, default=None,
                        help="the fused linear cross-entropy's two passes' least workspace in MiB (default: the "
                             "module's, 48); for trying block sizes: more is larger matmuls and more memory")
    parser.add_argument("--flce-rows-mib", type=float, default=None,
                        help="the fused linear cross-entropy's whole-row workspace in MiB (default: the module's, "
                             "256); 0 runs the two passes always")
    args = parser.parse_args()
    for value, name in ((args.flce_workspace_mib, "WORKSPACE_BYTES"), (args.flce_rows_mib, "ROWS_WORKSPACE_BYTES")):
        if value is not None:
            if not value >= 0:
                parser.error(f"a workspace must be >= 0 MiB, got {value}")
            from torchport.kernels import linear_ce_plan

            setattr(linear_ce_plan, name, int(value * 2**20))

    if args.sweep and args.ops == ",".join(OPS):
        args.ops = ",".join(SWEEP_OPS)
    args.contenders = args.contenders or ("torchport,liger" if args.sweep else ",".join(CONTENDERS))
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    for given, valid, what in ((ops, OPS, "op"), (contenders, CONTENDERS, "contender")):
        unknown = [x for x in given if x not in valid]
        if unknown:
            parser.error(f"unknown {what}(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    suffix = "_small" if args.small else "_sweep" if args.sweep else ""
    json_path = args.json or os.path.join(HERE, "results", f"kernels{suffix}.json")
    plot_path = args.plot or os.path.join(HERE, "results", f"kernels{suffix}.png")
    if args.device is None:
        import torchport

        device = torchport.device()
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mode = args.mode or ("triton" if device.type == "cuda" else "auto")
    dtype = DTYPES[args.dtype]
    args.warmup = args.warmup if args.warmup is not None else (10 if args.small else 100)
    args.rep = args.rep if args.rep is not None else (50 if args.small else 500)
    dev = Device(device, args.warmup, args.rep)

    copy_bytes = (64 if args.small else 1024) * 2**20
    ceiling = dev.copy_gbps(copy_bytes)
    info = versions()
    choices = torchport_choices(device, mode)
    print(f"{device_name(device)}; " + ", ".join(f"{k} {v}" for k, v in info.items()) + f"; commit {git_commit()}")
    print(f"copy ceiling: {ceiling:.0f} GB/s ({copy_bytes // 2**20} MiB bf16 buffer, read + written)")
    shown = ", ".join(f"{k}={v}" for k, v in choices.items()) if isinstance(choices, dict) else choices
    print(f"torchport rows with TORCHPORT_KERNELS={mode}: {shown}\n")

    if args.sweep:
        meta = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "commit": git_commit(),
                "device": device_name(device), "versions": info, "dtype": args.dtype}
        run_sweep(sys.modules[__name__], ops, [int(x) for x in args.sweep_sizes.split(",")], args.sweep_rows,
                  contenders, dtype, dev, ceiling, mode, json_path, meta)
        return
    results = []
    for name in ops:
        op = OPS[name]
        dims = op.small if args.small else op.shape
        try:
            results.append(bench_op(op, dims, contenders, dtype, dev, ceiling, mode))
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory building the inputs: the other ops still run
            message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
            print(f"{op.describe(dims)}: {message}")
            results.append({"op": op.name, "title": op.describe(dims), "dims": list(dims), "error": message,
                             "bytes_moved": 0, "ideal_ms": 0.0, "target_speedup": op.target, "rows": []})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print()
    for result in results:
        if result["rows"]:
            print_table(result)

    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(_finite({
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "commit": git_commit(),
            "device": device_name(device), "versions": info, "dtype": args.dtype, "kernels_mode": mode,
            "torchport_implementations": choices, "copy_gbps": ceiling, "copy_bytes": copy_bytes,
            "warmup_ms": args.warmup, "rep_ms": args.rep,
            "timer": "triton.testing.do_bench median" if dev.do_bench else "synchronised host median",
            "ops": results}), f, indent=2)
    print(f"wrote {json_path}")
    plot(results, plot_path, f"{device_name(device)}, {args.dtype}, copy ceiling {ceiling:.0f} GB/s")


if __name__ == "__main__":
    main()
