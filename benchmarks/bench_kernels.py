"""Fused kernels against their peers: RMSNorm, LayerNorm, SwiGLU, GeGLU, RoPE, cross-entropy, linear + cross-entropy.

For each op, in one process on one device: eager PyTorch written as HF modeling code writes it, torch.compile of
that same function, liger-kernel (when importable) and torchport.kernels (forced to its Triton kernels on CUDA;
in-place variants as a second row). Each contender is checked against a float32 reference before it is timed.
Reports median ms of one forward + backward, achieved GB/s against the fewest bytes the op must move, % of the
device-to-device copy bandwidth measured in the same run, and peak memory. Prints a table per op, writes JSON and
a PNG chart.

    python benchmarks/bench_kernels.py                                  # the shapes of ../shared/BENCHMARKS.md
    python benchmarks/bench_kernels.py --ops rms_norm,rope --contenders eager,liger,torchport
    python benchmarks/bench_kernels.py --small                          # CPU smoke run, seconds

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
import platform
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))

# The fewest bytes each op must move for one forward + backward, e = bytes per element (bf16: 2). Weight and bias
# vectors (a few KiB against hundreds of MiB) are left out. These are the roofline numerators of BENCHMARKS.md.
#   RMSNorm    fwd: read x, write y; bwd: read x and dy, write dx                 5 * x.numel() * e
#   LayerNorm  the same five passes                                               5 * x.numel() * e
#   SwiGLU     fwd: read a, b, write c (3); bwd: read a, b, dc, write da, db (5)  8 * a.numel() * e
#   GeGLU      as SwiGLU                                                          8 * a.numel() * e
#   RoPE       fwd: read q, k, write q, k; bwd: read dq, dk, write dq, dk         4 * (q.numel() + k.numel()) * e
#              plus cos and sin, read once in each pass                           + 4 * cos.numel() * e
#   CE         fwd: read logits once; bwd: write d logits (the loss is a scalar)  2 * logits.numel() * e
#              (torchport's kernel computes d logits in the forward, reading each row a second time — from L2
#              when it fits; with loss.backward() the backward then moves nothing)
#   linear+CE  FLOP-bound, 3 matmuls of 2*N*H*V FLOPs (logits, d hidden, d weight): 6*N*H*V FLOPs; bytes here
#              are only the tensors read and written once: hidden, weight, their gradients
#                                                                               2 * (h.numel() + w.numel()) * e
#              (torchport's fused op runs 4 such matmuls, logits twice, to hold no more than its workspace; the
#              TFLOP/s printed for this op count the unfused op's 6*N*H*V for every contender)


def rms_norm_bytes(x: torch.Tensor, weight: torch.Tensor) -> int:
    return 5 * x.numel() * x.element_size()


def layer_norm_bytes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> int:
    return 5 * x.numel() * x.element_size()


def glu_bytes(gate: torch.Tensor, up: torch.Tensor) -> int:
    return 8 * gate.numel() * gate.element_size()


def rope_bytes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    return 4 * (q.numel() + k.numel()) * q.element_size() + 4 * cos.numel() * cos.element_size()


def cross_entropy_bytes(logits: torch.Tensor, target: torch.Tensor) -> int:
    return 2 * logits.numel() * logits.element_size()


def linear_cross_entropy_bytes(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> int:
    return 2 * (hidden.numel() + weight.numel()) * hidden.element_size()


def linear_cross_entropy_flops(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> int:
    return 6 * hidden.shape[0] * hidden.shape[1] * weight.shape[0]


# --- eager versions, as HF modeling code writes them ---------------------------------------------------------------

def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # LlamaRMSNorm.forward: statistics in float32, cast back before the weight
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * h.to(dtype)


def layer_norm_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, 1e-5)


def swiglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_eager(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # apply_rotary_pos_emb with unsqueeze_dim=1: cos, sin [batch, seq, dim] broadcast over heads
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def cross_entropy_eager(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # transformers' ForCausalLMLoss: upcast the logits, then F.cross_entropy with ignore_index=-100
    return F.cross_entropy(logits.float(), target, ignore_index=-100)


def linear_cross_entropy_eager(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=-100)


# --- inputs --------------------------------------------------------------------------------------------------------

def _randn(shape: Sequence[int], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(tuple(shape), dtype=torch.float32, device=device, generator=gen).to(dtype)


def norm_inputs(dims, dtype, device, gen, bias: bool):
    rows, hidden = dims
    x = _randn((rows, hidden), dtype, device, gen)
    weight = (1 + 0.1 * _randn((hidden,), torch.float32, device, gen)).to(dtype)
    args = [x, weight] + ([0.1 * _randn((hidden,), dtype, device, gen)] if bias else [])
    return tuple(args), (_randn((rows, hidden), dtype, device, gen),)


def glu_inputs(dims, dtype, device, gen):
    return (_randn(dims, dtype, device, gen), _randn(dims, dtype, device, gen)), (_randn(dims, dtype, device, gen),)


def rope_inputs(dims, dtype, device, gen):
    batch, q_heads, kv_heads, seq, head_dim = dims
    q = _randn((batch, q_heads, seq, head_dim), dtype, device, gen)
    k = _randn((batch, kv_heads, seq, head_dim), dtype, device, gen)
    # as LlamaRotaryEmbedding: one angle per position and frequency, emb = cat(freqs, freqs), then cos and sin
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    positions = torch.arange(seq, dtype=torch.float32, device=device).expand(batch, seq)
    freqs = positions[:, :, None] * inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    grads = (_randn(q.shape, dtype, device, gen), _randn(k.shape, dtype, device, gen))
    return (q, k, emb.cos().to(dtype), emb.sin().to(dtype)), grads


def _targets(rows: int, vocab: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    target[::16] = -100  # some padding, as a batch of uneven sequences has
    return target


def cross_entropy_inputs(dims, dtype, device, gen):
    rows, vocab = dims
    logits = 2 * _randn((rows, vocab), dtype, device, gen)
    return (logits, _targets(rows, vocab, device, gen)), (torch.ones((), dtype=dtype, device=device),)


def linear_cross_entropy_inputs(dims, dtype, device, gen):
    rows, hidden, vocab = dims
    h = _randn((rows, hidden), dtype, device, gen)
    w = (_randn((vocab, hidden), torch.float32, device, gen) / hidden**0.5).to(dtype)
    return (h, w, _targets(rows, vocab, device, gen)), (torch.ones((), dtype=dtype, device=device),)


# --- contenders ----------------------------------------------------------------------------------------------------

def _liger(op: str) -> Callable:
    """liger-kernel's autograd Function for ``op`` (0.8.5 signatures; apply() takes positional arguments only)."""
    if op == "rms_norm":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # liger's defaults, as its LigerRMSNorm module uses them: casting_mode="llama", in_place=True (dx into dy)
        return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", True)
    if op == "layer_norm":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
    if op == "swiglu":
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply  # backward writes da, db into a, b
    if op == "geglu":
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        return LigerGELUMulFunction.apply  # backward writes da, db into a, b
    if op == "rope":
        from liger_kernel.ops.rope import LigerRopeFunction

        return LigerRopeFunction.apply
    if op == "cross_entropy":
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, ...) -> 4-tuple;
        # it writes the gradient into the logits
        return lambda logits, t: LigerCrossEntropyFunction.apply(logits, t, None, -100, 0.0, 0.0, "mean")[0]
    if op == "fused_linear_cross_entropy":
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, ...)
        return lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(h, w, t, None, None, -100, 0.0, 0.0,
                                                                          "mean")[0]
    raise ValueError(op)


def _torchport(op: str, in_place: bool) -> Callable:
    from torchport import kernels

    if op == "rms_norm":
        return lambda x, w: kernels.rms_norm(x, w, eps=1e-6, **({"in_place": True} if in_place else {}))
    if op == "layer_norm":
        return lambda x, w, b: kernels.layer_norm(x, w, b, eps=1e-5)
    if op in ("swiglu", "geglu"):
        fn = getattr(kernels, op)
        return (lambda a, b: fn(a, b, in_place=True)) if in_place else fn
    if op == "rope":
        return kernels.rope
    if op == "cross_entropy":
        return (lambda x, t: kernels.cross_entropy(x, t, in_place=True)) if in_place else kernels.cross_entropy
    if op == "fused_linear_cross_entropy":
        # a float32 loss, as eager's (and Hugging Face's) upcast logits give and liger returns; same cost
        return lambda h, w, t: kernels.fused_linear_cross_entropy(h, w, t, loss_dtype=torch.float32)
    raise ValueError(op)


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    title: str
    shape: tuple[int, ...]        # BENCHMARKS.md
    small: tuple[int, ...]        # --small
    make: Callable                # (dims, dtype, device, generator) -> (args, upstream grads)
    eager: Callable
    bytes_moved: Callable
    target: float                 # speedup over the fastest peer
    arg_names: tuple[str, ...]
    out_names: tuple[str, ...]
    differentiable: int           # the leading arguments that need a gradient (RoPE: q, k; not cos, sin)
    in_place: bool                # torchport has an in_place=True variant

    def describe(self, dims: tuple[int, ...]) -> str:
        if self.name == "rope":
            b, hq, hk, s, d = dims
            return f"{self.title} q {b}×{hq}×{s}×{d}, k {b}×{hk}×{s}×{d}"
        if self.name == "fused_linear_cross_entropy":
            n, h, v = dims
            return f"{self.title} {n} tokens, {h} → {v}"
        return f"{self.title} {'×'.join(map(str, dims))}"


OPS = {op.name: op for op in (
    Op("rms_norm", "RMSNorm", (8192, 4096), (256, 512), lambda *a: norm_inputs(*a, bias=False), rms_norm_eager,
       rms_norm_bytes, 2.0, ("x", "weight"), ("y",), 2, True),
    Op("layer_norm", "LayerNorm", (8192, 4096), (256, 512), lambda *a: norm_inputs(*a, bias=True), layer_norm_eager,
       layer_norm_bytes, 1.5, ("x", "weight", "bias"), ("y",), 3, False),
    Op("swiglu", "SwiGLU", (8192, 14336), (256, 512), glu_inputs, swiglu_eager, glu_bytes, 1.2,
       ("gate", "up"), ("y",), 2, True),
    Op("geglu", "GeGLU", (8192, 14336), (256, 512), glu_inputs, geglu_eager, glu_bytes, 1.2,
       ("gate", "up"), ("y",), 2, True),
    Op("rope", "RoPE", (4, 32, 8, 2048, 128), (2, 4, 2, 64, 32), rope_inputs, rope_eager, rope_bytes, 1.2,
       ("q", "k", "cos", "sin"), ("q", "k"), 2, False),
    Op("cross_entropy", "cross-entropy", (8192, 128256), (256, 32003), cross_entropy_inputs, cross_entropy_eager,
       cross_entropy_bytes, 1.8, ("logits", "target"), ("loss",), 1, True),
    # target: no slower than eager (1.0×) with peak memory <= liger's
    Op("fused_linear_cross_entropy", "linear + CE", (8192, 4096, 128256), (256, 64, 1000), linear_cross_entropy_inputs,
       linear_cross_entropy_eager, linear_cross_entropy_bytes, 1.0, ("hidden", "weight", "target"), ("loss",), 2,
       False),
)}
CONTENDERS = ("eager", "compile", "liger", "torchport", "torchport-inplace")
PEERS = ("eager", "compile", "liger")
LABELS = {"eager": "eager", "compile": "torch.compile", "liger": "liger-kernel", "torchport": "torchport",
          "torchport-inplace": "torchport in-place"}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --- measuring -----------------------------------------------------------------------------------------------------

class Device:
    """Timing and peak memory on one device: Triton's do_bench on CUDA, a synchronised median elsewhere."""

    def __init__(self, device: torch.device, warmup_ms: float, rep_ms: float) -> None:
        self.device, self.warmup_ms, self.rep_ms = device, warmup_ms, rep_ms
        self.do_bench = None
        if device.type == "cuda":
            from triton.testing import do_bench

            self.do_bench = do_bench

    def synchronize(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def median_ms(self, fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor],
                  restore: Callable[[], None] | None = None) -> float:
        """Median ms of ``fn``; ``restore`` (untimed) rewrites inputs that ``fn`` overwrites before each call."""
        if self.do_bench is not None and restore is None:
            # clears the L2 cache before every repetition and the listed .grad, as a training step would find them
            return float(self.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, grad_to_none=list(grad_to_none),
                                       return_mode="median"))
        if self.device.type == "cuda":
            return self._cuda_events_ms(fn, grad_to_none, restore)
        import torchport

        def once() -> float:
            if restore is not None:
                restore()
            for t in grad_to_none:
                t.grad = None
            with torchport.Timer(self.device) as timer:
                fn()
            return timer.ms

        estimate = max(once(), 1e-3)
        for _ in range(min(100, max(1, int(self.warmup_ms / estimate)))):
            once()
        return statistics.median(once() for _ in range(min(1000, max(5, int(self.rep_ms / estimate)))))

    def _cuda_events_ms(self, fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor],
                        restore: Callable[[], None]) -> float:
        """do_bench's loop (L2 flush, .grad reset, CUDA events, median) with ``restore`` before each repetition, for
        contenders that write gradients over their inputs: timing them on their own gradients would, after a few
        hundred repetitions, time them on denormals and zeros."""
        flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=self.device)  # as do_bench: 256 MB

        def once(start: torch.cuda.Event, end: torch.cuda.Event) -> None:
            restore()
            for t in grad_to_none:
                t.grad = None
            flush.zero_()
            start.record()
            fn()
            end.record()

        def run(count: int) -> list[float]:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(count)]
            for start, end in events:
                once(start, end)
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) for start, end in events]

        estimate = max(statistics.median(run(5)), 1e-3)
        run(max(1, int(self.warmup_ms / estimate)))
        return statistics.median(run(max(1, int(self.rep_ms / estimate))))

    def graph_ms(self, fn: Callable[[], Any], grad_to_none: Sequence[torch.Tensor]) -> float | None:
        """Median ms of one replay of ``fn`` captured in a CUDA graph: the GPU time alone, without the host's
        launch overhead (which, at these sizes, is longer than the kernels on this machine's CPU). None off CUDA."""
        if self.device.type != "cuda":
            return None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                for t in grad_to_none:
                    t.grad = None
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t in grad_to_none:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()  # the .grad tensors made here are rewritten in place by every replay
        ms = float(self.do_bench(graph.replay, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))
        for t in grad_to_none:
            t.grad = None
        del graph
        return ms

    def peak_mib(self, fn: Callable[[], Any], grads_of: Sequence[torch.Tensor]) -> float | None:
        """Most memory allocated during one call beyond what was allocated before it (None on the CPU)."""
        if self.device.type == "cpu":
            return None
        for t in grads_of:
            t.grad = None
        self.synchronize()
        before = torch.accelerator.memory_allocated(self.device)
        torch.accelerator.reset_peak_memory_stats(self.device)
        fn()
        self.synchronize()
        peak = torch.accelerator.max_memory_allocated(self.device) - before
        for t in grads_of:
            t.grad = None
        return peak / 2**20

    def copy_gbps(self, nbytes: int) -> float:
        """Device-to-device copy bandwidth, counting bytes read plus written."""
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=self.device).normal_()
        dst = torch.empty_like(src)
        ms = self.median_ms(lambda: dst.copy_(src), ())
        return 2 * nbytes / (ms * 1e-3) / 1e9


@contextlib.contextmanager
def kernel_mode(mode: str) -> Iterator[None]:
    """Force torchport's kernel implementation, in code and in the environment: the CUDA autograd engine runs
    backward on its own thread, which sees the environment but not this thread's settings.override."""
    import torchport

    saved = os.environ.get("TORCHPORT_KERNELS")
    os.environ["TORCHPORT_KERNELS"] = mode
    try:
        with torchport.settings.override(kernels=mode):
            yield
    finally:
        if saved is None:
            del os.environ["TORCHPORT_KERNELS"]
        else:
            os.environ["TORCHPORT_KERNELS"] = saved


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
            return _liger(op.name), None
        if name == "torchport":
            return _torchport(op.name, in_place=False), None
        if name == "torchport-inplace":
            return (_torchport(op.name, in_place=True), None) if op.in_place else (None, None)
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
    flops = linear_cross_entropy_flops(*args) if op.name == "fused_linear_cross_entropy" else None
    for row in rows:
        if row.get("median_ms"):
            row["gbps"] = nbytes / (row["median_ms"] * 1e-3) / 1e9
            row["pct_ceiling"] = 100 * row["gbps"] / ceiling_gbps
            if flops:
                row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
                print(f"  {LABELS[row['contender']]:<19} {row['tflops']:.1f} TFLOP/s counting 6·N·H·V")
    judge(op, rows)
    return {"op": op.name, "title": op.describe(dims), "dims": list(dims), "bytes_moved": nbytes,
            "ideal_ms": nbytes / ceiling_gbps / 1e6, "target_speedup": op.target, "rows": rows}


def judge(op: Op, rows: list[dict]) -> None:
    """Speedup of each torchport row over the fastest passing peer, and the time and memory targets."""
    peers = [r for r in rows if r["contender"] in PEERS and r["status"] == "ok" and r.get("median_ms")]
    fastest = min(peers, key=lambda r: r["median_ms"], default=None)
    peaks = [r["peak_mib"] for r in peers if r.get("peak_mib") is not None]
    lowest = min(peaks, default=None)
    for row in rows:
        if not row["contender"].startswith("torchport") or not row.get("median_ms") or fastest is None:
            continue
        row["fastest_peer"] = fastest["label"]
        row["speedup"] = fastest["median_ms"] / row["median_ms"]
        graphed = [r for r in peers if r.get("gpu_ms")]
        if graphed and row.get("gpu_ms"):
            gpu_fastest = min(graphed, key=lambda r: r["gpu_ms"])
            row["gpu_fastest_peer"] = gpu_fastest["label"]
            row["gpu_speedup"] = gpu_fastest["gpu_ms"] / row["gpu_ms"]
        if row["status"] != "ok":
            row["time_target"] = "missed (FAIL)"
        elif row["speedup"] >= op.target:
            row["time_target"] = "met"
        else:
            row["time_target"] = f"missed, {row['speedup']:.2f}× < {op.target}×"
        if lowest is not None and row.get("peak_mib") is not None:
            row["lowest_peer_mib"] = lowest
            over = row["peak_mib"] - lowest
            row["memory_target"] = "met" if over <= 0 else f"missed by {over:.1f} MiB"


# --- output --------------------------------------------------------------------------------------------------------

def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_rows(result: dict) -> list[list[str]]:
    out = []
    for r in result["rows"]:
        target = ""
        if "speedup" in r:
            target = f"≥{result['target_speedup']:.1f}×: {r['time_target']}"
            if "gpu_speedup" in r:
                target += f" (GPU time {r['gpu_speedup']:.2f}×)"
            if "memory_target" in r:
                target += f"; ≤{r['lowest_peer_mib']:.0f} MiB: {r['memory_target']}"
        out.append([r["label"], _fmt(r.get("median_ms"), ".3f"), _fmt(r.get("gpu_ms"), ".3f"), _fmt(r.get("gbps"), ".0f"),
                    _fmt(r.get("pct_ceiling"), ".1f"), _fmt(r.get("peak_mib"), ".1f"), _fmt(r.get("rel_err"), ".1e"),
                    r["status"], _fmt(r.get("speedup"), ".2f"), target])
    return out


HEADERS = ["contender", "median ms", "GPU ms (graph)", "GB/s", "% ceiling", "peak MiB", "rel err", "status", "speedup", "target"]


def print_table(result: dict) -> None:
    title = (f"{result['title']} — fwd+bwd, {result['bytes_moved'] / 1e6:.1f} MB at the least, "
             f"{result['ideal_ms']:.4f} ms at the copy ceiling")
    errors = [f"  {r['label']}: {r['error']}" for r in result["rows"] if r["status"] == "error"]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}\n| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS))
        for cells in table_rows(result):
            print("| " + " | ".join(cells) + " |")
        print("\n".join(errors))
        return
    table = Table(title=title, title_justify="left")
    for i, header in enumerate(HEADERS):
        table.add_column(header, justify="right" if 0 < i < 6 or i == 7 else "left")
    for row, cells in zip(result["rows"], table_rows(result)):
        table.add_row(*cells, style="bold" if row["contender"].startswith("torchport") else None)
    console = Console(width=160)
    console.print(table)
    if errors:
        console.print("\n".join(errors), highlight=False, markup=False)


def plot(results: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    results = [r for r in results if any(row.get("median_ms") for row in r["rows"])]
    if not results:
        print("nothing timed: no chart")
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 1.0 + 1.6 * len(results)), squeeze=False)
    for ax, result in zip(axes[:, 0], results):
        rows = [r for r in result["rows"] if r.get("median_ms")]
        labels = [r["label"] + (" (FAIL)" if r["status"] == "FAIL" else "") for r in rows]
        values = [r["median_ms"] for r in rows]
        colors = ["tab:orange" if r["contender"].startswith("torchport") else "tab:gray" for r in rows]
        ax.barh(labels, values, color=colors)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.3f}", va="center", fontsize=8)
        ax.axvline(result["ideal_ms"], color="tab:blue", linestyle="--", linewidth=1, label="copy ceiling")
        ax.invert_yaxis()
        ax.set_title(result["title"], fontsize=9, loc="left")
        ax.set_xlabel("median ms, forward + backward", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.set_xlim(0, max(values + [result["ideal_ms"]]) * 1.2)
    axes[0, 0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def torchport_choices(device: torch.device, mode: str) -> dict[str, str] | str:
    """The implementation torchport picks for each op on ``device`` under ``mode`` (or why that is unknown)."""
    try:
        import torchport.kernels

        with kernel_mode(mode):
            return {row["op"]: row["implementation"] for row in torchport.kernels.table([device])}
    except Exception as exc:  # noqa: BLE001 - informative only
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _finite(value: Any) -> Any:
    """JSON without NaN/Infinity: non-finite floats become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def git_commit() -> str | None:
    import subprocess

    try:
        def run(*cmd: str) -> str:
            return subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()

        return run("git", "rev-parse", "--short", "HEAD") + (" (modified)" if run("git", "status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict[str, str | None]:
    from importlib import metadata

    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("triton", "liger-kernel", "torchport"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    if found["torchport"] is None:
        with contextlib.suppress(ImportError):
            import torchport

            found["torchport"] = torchport.__version__
    return found


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help=f"subset of {','.join(CONTENDERS)}")
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
                        help="the fused linear cross-entropy's least workspace in MiB (default: the module's, 48); "
                             "for trying block sizes: more is larger matmuls and more memory")
    args = parser.parse_args()
    if args.flce_workspace_mib is not None:
        import importlib

        flce = importlib.import_module("torchport.kernels.fused_linear_cross_entropy")
        flce.WORKSPACE_BYTES = int(args.flce_workspace_mib * 2**20)

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    for given, valid, what in ((ops, OPS, "op"), (contenders, CONTENDERS, "contender")):
        unknown = [x for x in given if x not in valid]
        if unknown:
            parser.error(f"unknown {what}(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    suffix = "_small" if args.small else ""
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
