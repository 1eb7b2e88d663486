"""Low-bit weights on a Llama-8B-shaped model: torchport's formats against bf16 and torchao, in one process.

Model: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 kv heads, vocab 128256, random bf16 weights (std
0.02), a static KV cache. Every ``nn.Linear`` (the 224 of the layers and the output layer) is quantised; the
embedding stays bf16. For each contender:

* **decode**: batch 1, greedy, one CUDA graph per token step (the step writes its token and advances its position
  inside the graph, so replays need no host work): tokens/s over ``--decode-tokens`` replays; ``--decode-batch B
  ...`` also decodes B copies of the prompt together per size (tokens/s of all of them: the 2-16-row kernels, where
  q/k/v and gate/up run as separate layers);
* **eager decode** (``--eager-decode``): batch 1 again, each step launched from Python without a graph, as a
  generate loop that captures none runs it: the host's launch path per layer counts here;
* **prefill**: one ``1 x --prefill-tokens`` forward, eager: tokens/s, median of 5; for torchport's formats twice:
  in the default mode (each layer dequantises its weight per call and drops it: weight memory unchanged), and with
  ``QuantizedLinear.cache_dequantized`` (the dense weight kept after the first call: its extra memory is reported);
* **kernel profile** (``--profile``, CUDA): the GPU time of one prefill and of one eager decode step summed over
  their kernels, and the ten kernels that take the most, to set beside the wall-clock figures. The profiles run
  after every contender's timings, on the models made again: once a ``torch.profiler`` session with CUDA activity
  has run, the process keeps CUPTI attached (PyTorch does not finalise it: pytorch/pytorch#144455), which slows
  the host's launches of everything timed afterwards;
* **weight memory**: device bytes held by the model (``memory_allocated`` before and after building it), and the
  bytes of the linear layers alone;
* **accuracy**: logits of a 256-token prompt against the bf16 model's: relative error (Frobenius) and the mean
  KL divergence ``KL(p_bf16 || p_quantised)`` per position, in float32.

RMSNorm, RoPE and SwiGLU run as torchport's fused kernels for every contender (``--plain-ops``: plain PyTorch, whose
~20 small kernels per layer cost about 2.5 ms of an H100's 8 ms bf16 step and hide the linear layers' speed-up).

Contenders: ``bf16``; ``torchport-{int8,fp8,int4,mxfp4,nvfp4}`` (``torchport.quantize``: q/k/v and gate/up merged,
one kernel each at batch-1 decode; ``--separate`` adds ``torchport-<format>-separate`` with ``merge=False``);
``torchao-{int8,fp8,int4,nvfp4}`` (``torchao.quantization.quantize_`` with ``Int8WeightOnlyConfig``,
``Float8WeightOnlyConfig``, ``Int4WeightOnlyConfig`` in tinygemm's ``tile_packed_to_4d`` layout, which needs only
torch, and ``NVFP4WeightOnlyConfig``; torchao 0.18 has no weight-only MXFP4). Targets: int4/fp4 weight memory
<= 30% of bf16, batch-1 decode >= 1.5x bf16, accuracy no worse than torchao's for the same format.

    PYTHONPATH=$PWD/src python3 benchmarks/bench_lowbit.py --json benchmarks/results/lowbit.json   # GPU, ~5 min
    python3 benchmarks/bench_lowbit.py --small --device cpu                                        # smoke run
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_lowbit_model as model_def  # noqa: E402
from bench_lowbit_model import SHAPES, Llama, build, new_caches  # noqa: E402

TORCHPORT_FORMATS = ("int8", "fp8", "int4", "mxfp4", "nvfp4")
TORCHAO_FORMATS = ("int8", "fp8", "int4", "nvfp4")
MAX_SEQ = model_def.MAX_SEQ


def _sync(device: torch.device) -> None:
    import torchport

    torchport.synchronize(device)


def capture(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn`` (run once on a side stream first, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def measure_decode(model: Llama, device: torch.device, tokens: int, prompt: torch.Tensor,
                   graphs: bool = True) -> float:
    """Greedy decode tokens/s of the ``prompt.shape[0]`` sequences together (every row at the same position): one
    CUDA graph per step where the device has graphs (unless ``graphs`` is False), eager otherwise."""
    caches = new_caches(model, device, prompt.shape[0])
    start = prompt.shape[1]
    with torch.no_grad():
        logits = model(prompt, torch.arange(start, device=device), caches, decode=False)
        token = logits[:, -1:].argmax(-1)
        position = torch.tensor([start], device=device)

        def step() -> None:
            out = model(token, position, caches, decode=True)
            token.copy_(out[:, -1:].argmax(-1))
            position.add_(1)

        for _ in range(3):  # warm-up: kernels compile and autotune here, outside the graph
            step()
        steps = min(tokens, MAX_SEQ - start - 8)
        if device.type == "cuda" and graphs:
            graph = capture(step)
            position.fill_(start)
            for _ in range(3):
                graph.replay()
            position.fill_(start)
            _sync(device)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(steps):
                graph.replay()
            end.record()
            _sync(device)
            seconds = begin.elapsed_time(end) / 1e3
        else:
            position.fill_(start)
            _sync(device)
            began = time.perf_counter()
            for _ in range(steps):
                step()
            _sync(device)
            seconds = time.perf_counter() - began
    return prompt.shape[0] * steps / seconds


def measure_prefill(model: Llama, device: torch.device, tokens: int, runs: dict[str, list] | None = None) -> float:
    """Prefill tokens/s, median of 5 timed forwards after one untimed (which compiles and tunes). ``runs`` receives,
    per timed forward, its milliseconds (``prefill_runs_ms``), the milliseconds until the forward returned to Python
    (``prefill_host_ms``: close to the first where the host, not the device, sets the pace) and, on CUDA, the device
    allocations the caching allocator made during it (``prefill_device_allocs``: each one can stall the host)."""
    prompt = torch.randint(0, model.config["vocab"], (1, tokens), device=device)
    times, host, allocs = [], [], []
    with torch.no_grad():
        for i in range(6):
            caches = _prefill_caches(model, device, tokens)
            _sync(device)
            before = _device_allocs(device)
            began = time.perf_counter()
            model(prompt, torch.arange(tokens, device=device), caches, decode=False)
            returned = time.perf_counter()
            _sync(device)
            if i:
                times.append(time.perf_counter() - began)
                host.append(returned - began)
                allocs.append(_device_allocs(device) - before)
    if runs is not None:
        runs["prefill_runs_ms"] = [round(t * 1e3, 2) for t in times]
        runs["prefill_host_ms"] = [round(t * 1e3, 2) for t in host]
        if device.type == "cuda":
            runs["prefill_device_allocs"] = allocs
    return tokens / statistics.median(times)


def _device_allocs(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("num_device_alloc", 0) if device.type == "cuda" else 0


def _prefill_caches(model: Llama, device: torch.device, tokens: int) -> list:
    return new_caches(model, device) if tokens <= MAX_SEQ else _long_caches(model, device, tokens)


def kernel_profile(model: Llama, device: torch.device, tokens: int, prompt: torch.Tensor, top: int = 10
                   ) -> dict[str, Any]:
    """GPU time of one prefill and of one eager decode step, summed over their kernels (``torch.profiler``), with
    the ``top`` kernels of each by time: where a contender's step goes, beside the wall-clock figures."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(fn) -> tuple[float, list[dict[str, Any]]]:
        _sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            _sync(device)
        by_name: dict[str, list[float]] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                entry = by_name.setdefault(event.name, [0.0, 0])
                entry[0] += event.device_time / 1e3
                entry[1] += 1
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        return (round(sum(v[0] for v in by_name.values()), 3),
                [{"kernel": name[:120], "ms": round(ms, 3), "calls": calls} for name, (ms, calls) in ranked])

    with torch.no_grad():
        long_prompt = torch.randint(0, model.config["vocab"], (1, tokens), device=device)
        caches = _prefill_caches(model, device, tokens)
        prefill_ms, prefill_top = kernels(
            lambda: model(long_prompt, torch.arange(tokens, device=device), caches, decode=False))
        caches = new_caches(model, device)
        start = prompt.shape[1]
        model(prompt, torch.arange(start, device=device), caches, decode=False)
        token = prompt[:, -1:].clone()
        position = torch.tensor([start], device=device)
        model(token, position, caches, decode=True)  # warm-up at this position
        decode_ms, decode_top = kernels(lambda: model(token, position, caches, decode=True))
    return {"prefill_gpu_ms": prefill_ms, "prefill_kernels": prefill_top, "decode_gpu_ms": decode_ms,
            "decode_kernels": decode_top}


def measure_cached_prefill(model: Llama, device: torch.device, tokens: int) -> dict[str, float]:
    """Prefill tokens/s with every quantised layer keeping its dequantised weight, and the memory those copies
    take; the copies are dropped afterwards."""
    import torchport.quant as quant

    layers = [m for m in model.modules() if isinstance(m, quant.QuantizedLinear)]
    before = _allocated(device)
    for layer in layers:
        layer.cache_dequantized = True
    try:
        tok_s = measure_prefill(model, device, tokens)
        extra = _allocated(device) - before
    finally:
        for layer in layers:
            layer.cache_dequantized = False
            layer._cache.pop("dense", None)
    return {"prefill_cached_tok_s": tok_s, "prefill_cache_bytes": extra}


def _long_caches(model: Llama, device: torch.device, tokens: int) -> list:
    c = model.config
    shape = (1, c["kv_heads"], tokens, c["hidden"] // c["heads"])
    return [(torch.zeros(shape, dtype=torch.bfloat16, device=device), torch.zeros(shape, dtype=torch.bfloat16,
             device=device)) for _ in range(c["layers"])]


def logits_of(model: Llama, device: torch.device, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(prompt, torch.arange(prompt.shape[1], device=device), new_caches(model, device),
                     decode=False).float()


def accuracy(logits: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    rel = ((logits - reference).norm() / reference.norm()).item()
    log_p = F.log_softmax(reference, dim=-1)
    log_q = F.log_softmax(logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    return {"logits_rel_error": rel, "kl_divergence": kl}


def _linear_bytes(model: nn.Module) -> int:
    import torchport.quant as quant

    total = 0
    for m in model.modules():
        if isinstance(m, quant.QuantizedLinear):
            total += m.nbytes()
        elif isinstance(m, nn.Linear):
            total += _tensor_bytes(m.weight)
    return total


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, or of the inner tensors of a tensor subclass (torchao's quantised weights)."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names if getattr(t, n) is not None)
    return t.numel() * t.element_size()


def _model_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += _tensor_bytes(t)
    return total


def _allocated(device: torch.device) -> int:
    return torch.accelerator.memory_allocated(device.index or 0) if device.type != "cpu" else 0


def make(base: Llama, contender: str) -> Llama:
    library, _, fmt = contender.partition("-")
    fmt, _, variant = fmt.partition("-")
    model = copy.deepcopy(base)
    if library == "torchport":
        from torchport.quant import quantize

        quantize(model, fmt, merge=variant != "separate")
    elif library == "torchao":
        from torchao.quantization import (Float8WeightOnlyConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig,
                                          quantize_)

        if fmt == "nvfp4":
            from torchao.prototype.mx_formats.inference_workflow import NVFP4WeightOnlyConfig
            config = NVFP4WeightOnlyConfig()
        elif fmt == "int4":
            config = Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
        else:
            config = {"int8": Int8WeightOnlyConfig, "fp8": Float8WeightOnlyConfig}[fmt]()
        quantize_(model, config)
    return model


def run(args: argparse.Namespace, save: Callable[[list[dict[str, Any]], bool], None] | None = None
        ) -> list[dict[str, Any]]:
    """Every contender's row; ``save(rows, complete)`` after each one (a run cut short keeps what it measured)."""
    import torchport

    device = torch.device(args.device) if args.device else torchport.device()
    shape = SHAPES["small" if args.small else "8b"]
    contenders = ["bf16", *(f"torchport-{f}" for f in args.formats)]
    if args.separate:
        contenders += [f"torchport-{f}-separate" for f in args.formats]
    if not args.no_torchao:
        contenders += [f"torchao-{f}" for f in args.torchao_formats if f in args.formats]
    gc.collect()
    before = _allocated(device)
    base = build(shape, device)
    base_bytes = _allocated(device) - before
    prompt = torch.randint(0, shape["vocab"], (1, 256), generator=torch.Generator().manual_seed(1)).to(device)
    reference = logits_of(base, device, prompt)
    rows = []
    for name in contenders:
        row: dict[str, Any] = {"contender": name}
        try:
            start = _allocated(device)
            began = time.perf_counter()
            model = base if name == "bf16" else make(base, name)
            row["quantize_s"] = round(time.perf_counter() - began, 2)
            row["weight_bytes"] = _model_bytes(model)
            row["allocated_bytes"] = base_bytes if name == "bf16" else _allocated(device) - start
            row["linear_bytes"] = _linear_bytes(model)
            row.update(accuracy(logits_of(model, device, prompt), reference))
            runs: dict[str, list] = {}
            row["prefill_tok_s"] = measure_prefill(model, device, args.prefill_tokens, runs)
            row.update(runs)
            row["decode_tok_s"] = measure_decode(model, device, args.decode_tokens, prompt[:, :64])
            for batch in args.decode_batch:
                row[f"decode_b{batch}_tok_s"] = measure_decode(model, device, args.decode_tokens,
                                                               prompt[:, :64].expand(batch, -1))
            if args.eager_decode:
                row["decode_eager_tok_s"] = measure_decode(model, device, args.decode_tokens, prompt[:, :64],
                                                           graphs=False)
            if name.startswith("torchport-"):
                row.update(measure_cached_prefill(model, device, args.prefill_tokens))
        except Exception as exc:  # one contender failing must not lose the others' figures
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            model = None
            gc.collect()
            torchport.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        if save is not None:
            save(rows, False)
    if args.profile and device.type == "cuda":  # last: see the module's docstring
        for row in rows:
            if "error" in row:
                continue
            try:
                model = base if row["contender"] == "bf16" else make(base, row["contender"])
                row.update(kernel_profile(model, device, args.prefill_tokens, prompt[:, :64]))
            except Exception as exc:  # noqa: BLE001 - a failing profile must not lose the timings
                row["profile_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            finally:
                model = None
                gc.collect()
                torchport.empty_cache()
            profiled = {k: v for k, v in row.items() if k.startswith(("contender", "prefill_gpu", "decode_gpu"))}
            print(json.dumps(profiled), flush=True)
    bf16 = rows[0]
    for row in rows:
        if "error" in row or "error" in bf16:
            continue
        row["weight_vs_bf16"] = row["weight_bytes"] / bf16["weight_bytes"]
        row["linear_vs_bf16"] = row["linear_bytes"] / bf16["linear_bytes"]
        row["decode_vs_bf16"] = row["decode_tok_s"] / bf16["decode_tok_s"]
        for batch in args.decode_batch:
            row[f"decode_b{batch}_vs_bf16"] = row[f"decode_b{batch}_tok_s"] / bf16[f"decode_b{batch}_tok_s"]
        row["prefill_vs_bf16"] = row["prefill_tok_s"] / bf16["prefill_tok_s"]
        if "decode_eager_tok_s" in row:
            row["decode_eager_vs_bf16"] = row["decode_eager_tok_s"] / bf16["decode_eager_tok_s"]
        if "prefill_cached_tok_s" in row:
            row["prefill_cached_vs_bf16"] = row["prefill_cached_tok_s"] / bf16["prefill_tok_s"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'contender':<26}{'decode tok/s':>13}{'x bf16':>8}{'prefill tok/s':>15}{'x bf16':>8}"
            f"{'weights GiB':>12}{'x bf16':>8}{'linears x':>10}{'rel err':>10}{'KL':>10}{'cached x':>9}{'+GiB':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['contender']:<26}error: {r['error']}")
            continue
        lines.append(
            f"{r['contender']:<26}{r['decode_tok_s']:>13.1f}{r.get('decode_vs_bf16', math.nan):>8.2f}"
            f"{r['prefill_tok_s']:>15.0f}{r.get('prefill_vs_bf16', math.nan):>8.2f}"
            f"{r['weight_bytes'] / 2**30:>12.2f}{r.get('weight_vs_bf16', math.nan):>8.3f}"
            f"{r.get('linear_vs_bf16', math.nan):>10.3f}{r['logits_rel_error']:>10.4f}{r['kl_divergence']:>10.2e}"
            f"{r.get('prefill_cached_vs_bf16', math.nan):>9.2f}{r.get('prefill_cache_bytes', 0) / 2**30:>8.2f}"
        )
    return "\n".join(lines)


def batch_table(rows: list[dict[str, Any]], batches: list[int]) -> str:
    """Decode tokens/s (all sequences together) at each ``--decode-batch`` size, and against bf16's."""
    head = f"{'contender':<26}" + "".join(f"{f'batch {b} tok/s':>16}{'x bf16':>8}" for b in batches)
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            continue
        lines.append(f"{r['contender']:<26}" + "".join(
            f"{r[f'decode_b{b}_tok_s']:>16.1f}{r.get(f'decode_b{b}_vs_bf16', math.nan):>8.2f}" for b in batches))
    return "\n".join(lines)


def eager_table(rows: list[dict[str, Any]]) -> str:
    """Batch-1 decode without CUDA graphs (``--eager-decode``) beside the graphed one: where the host's launch path
    sets the pace, as in a generate loop that captures no graph."""
    head = f"{'contender':<26}{'eager tok/s':>12}{'x bf16':>8}{'graphed tok/s':>14}{'eager / graphed':>16}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "decode_eager_tok_s" not in r:
            continue
        lines.append(f"{r['contender']:<26}{r['decode_eager_tok_s']:>12.1f}"
                     f"{r.get('decode_eager_vs_bf16', math.nan):>8.2f}{r['decode_tok_s']:>14.1f}"
                     f"{r['decode_eager_tok_s'] / r['decode_tok_s']:>16.2f}")
    return "\n".join(lines)


def profile_table(rows: list[dict[str, Any]]) -> str:
    """Wall-clock against summed kernel time (``--profile``): a prefill or step whose wall time is far above its GPU
    time waits on the host, not on its kernels."""
    head = (f"{'contender':<26}{'prefill ms':>11}{'host ms':>9}{'allocs':>7}{'GPU ms':>9}{'step ms':>9}{'GPU ms':>9}"
            "  top prefill / decode kernel")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "prefill_gpu_ms" not in r:
            continue
        lines.append(
            f"{r['contender']:<26}{statistics.median(r['prefill_runs_ms']):>11.1f}"
            f"{statistics.median(r['prefill_host_ms']):>9.1f}{sum(r.get('prefill_device_allocs', [0])):>7}"
            f"{r['prefill_gpu_ms']:>9.1f}"
            f"{1e3 / r['decode_tok_s']:>9.2f}{r['decode_gpu_ms']:>9.2f}  {r['prefill_kernels'][0]['kernel'][:30]} / "
            f"{r['decode_kernels'][0]['kernel'][:30]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="device (default: torchport.device())")
    parser.add_argument("--small", action="store_true", help="a tiny model, for a smoke run")
    parser.add_argument("--formats", nargs="+", default=list(TORCHPORT_FORMATS), choices=TORCHPORT_FORMATS)
    parser.add_argument("--no-torchao", action="store_true", help="leave torchao out")
    parser.add_argument("--separate", action="store_true",
                        help="also each torchport format with q/k/v and gate/up quantised one by one (merge=False): "
                             "contenders torchport-<format>-separate")
    parser.add_argument("--torchao-formats", nargs="+", default=list(TORCHAO_FORMATS), choices=TORCHAO_FORMATS)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, nargs="*", default=[],
                        help="also decode this many sequences together (2-16: the batched-decode kernels), per size")
    parser.add_argument("--eager-decode", action="store_true",
                        help="also decode batch 1 without CUDA graphs (each step launched from Python)")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--plain-ops", action="store_true", help="RMSNorm, RoPE, SwiGLU in plain PyTorch")
    parser.add_argument("--profile", action="store_true",
                        help="also record each contender's GPU kernel time of one prefill and one decode step")
    parser.add_argument("--json", default=None,
                        help="write the rows to this file, after each contender (meta.complete: false) and at the end")
    args = parser.parse_args()
    model_def.OPS = model_def.PlainOps if args.plain_ops else model_def.FusedOps
    if any(b < 1 for b in args.decode_batch):
        parser.error(f"--decode-batch takes sizes of at least 1, not {args.decode_batch}")
    save = functools.partial(write_json, args.json, args) if args.json else None
    rows = run(args, save)
    print(table(rows))
    if args.decode_batch:
        print(batch_table(rows, args.decode_batch))
    if args.eager_decode:
        print(eager_table(rows))
    if args.profile:
        print(profile_table(rows))
    if save is not None:
        save(rows, True)


def write_json(path: str, args: argparse.Namespace, rows: list[dict[str, Any]], complete: bool) -> None:
    """The rows and the run's settings; ``complete`` is false in the file written after each contender, until the
    ratios to bf16 (and ``--profile``'s figures) are in."""
    import torchport
    from torchport.backends import get_backend

    device = torch.device(args.device) if args.device else torchport.device()
    meta = {"device": get_backend(device.type).device_name(device.index or 0), "torch": torch.__version__,
            "shape": "small" if args.small else "8b", "decode_tokens": args.decode_tokens,
            "decode_batch": args.decode_batch, "eager_decode": args.eager_decode,
            "prefill_tokens": args.prefill_tokens,
            "ops": "plain" if args.plain_ops else "torchport kernels", "complete": complete}
    partial = f"{path}.partial"
    with open(partial, "w") as f:  # then renamed: a run killed while writing keeps the previous file whole
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    os.replace(partial, path)


if __name__ == "__main__":
    main()
