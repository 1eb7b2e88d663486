"""The Llama-shaped train step shared by ``bench_train_step.py`` and ``bench_compile.py``.

Model (``../shared/BENCHMARKS.md``): hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 kv heads, vocab 128256,
bf16 weights, SDPA attention, AdamW (fused, as Hugging Face Trainer's default; ``--optimizer foreach`` for
torch's own default); batch 4 x 2048 tokens, labels = inputs. Each contender runs in its own
process (patching and compiling change transformers' modules and dynamo's caches), from the same seed and data:
:func:`build` makes the model, :func:`measure` times ``warmup`` untimed then ``steps`` timed steps, and
:func:`run_contenders` starts one process per contender and collects what each printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

FULL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, batch=4, seq=2048)
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, batch=2, seq=32)


def build(shape: dict[str, int], device_spec: str | None) -> tuple[Any, Any]:
    """The bf16 Llama model of ``shape`` on the device (default: ``torchport.device()``), seeded; and the device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import torchport

    device = torch.device(device_spec) if device_spec else torchport.device()
    dims = {k: v for k, v in shape.items() if k not in ("batch", "seq")}
    config = LlamaConfig(**dims, max_position_embeddings=max(4096, shape["seq"]), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.train()
    return model, device


OPTIMIZERS = ("fused", "foreach")  # torch.optim.AdamW's implementations; Hugging Face Trainer's default is "fused"


def measure(model: Any, forward: Callable[..., Any], shape: dict[str, int], device: Any, steps: int,
            warmup: int, profile: int = 0, optimizer: str = "fused") -> dict[str, Any]:
    """Train ``warmup + steps`` AdamW steps through ``forward``; tokens/s and peak memory over the timed ones.
    ``optimizer``: AdamW's ``"fused"`` kernel (Hugging Face Trainer's default ``optim="adamw_torch_fused"`` with
    torch >= 2.8, transformers' ``training_args.py``) or its ``"foreach"`` kernels (``torch.optim.AdamW``'s own
    default on CUDA). With ``profile`` > 0, one more step runs under ``torch.profiler`` and the result lists its
    ``profile`` device kernels that took the most time (name, ms, calls)."""
    import torch

    import torchport
    import torchport.backends

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4, **{optimizer: True})
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (shape["batch"], shape["seq"]), generator=gen).to(device)
               for _ in range(warmup + steps)]

    def step(tokens: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # a new step for CUDA-graph trees (mode="reduce-overhead")
        loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        return loss.detach().clone()  # a graph's output memory is overwritten by its next replay

    losses, warm_times = [], []
    for tokens in batches[:warmup]:
        start = time.perf_counter()
        losses.append(float(step(tokens)))
        warm_times.append(time.perf_counter() - start)
    torchport.synchronize(device)
    backend = torchport.backends.get_backend(device.type)
    index = device.index or 0
    if device.type != "cpu":
        backend.reset_peak_memory_stats(index)
    times, pending = [], []
    start = time.perf_counter()
    for tokens in batches[warmup:]:
        pending.append(step(tokens))
        torchport.synchronize(device)
        now = time.perf_counter()
        times.append(now - start)
        start = now
    losses += [float(t) for t in pending]
    peak = backend.memory_stats(index).get("peak_allocated") if device.type != "cpu" else None
    median = statistics.median(times)
    kernels = _profile(step, batches[-1], device, profile) if profile > 0 else None
    return {
        "device": str(device),
        "device_name": backend.device_name(index),
        "median_step_ms": median * 1e3,
        "tokens_per_s": shape["batch"] * shape["seq"] / median,
        "peak_gib": None if peak is None else peak / 2**30,
        "first_step_s": warm_times[0] if warm_times else None,
        "optimizer": f"AdamW, {optimizer}",
        "losses": losses,
        **({"profile": kernels} if kernels is not None else {}),
    }


def _profile(step: Callable[[Any], Any], tokens: Any, device: Any, top: int) -> list[tuple[str, float, int]]:
    """The ``top`` device kernels of one more step by total time: ``(name, ms, calls)``, and the step's sum of
    every kernel's time as ``("all kernels", ms, count)`` first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import torchport

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(tokens)
        torchport.synchronize(device)
    kernels: dict[str, list[float]] = {}
    spans = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.name.startswith("Optimizer."):
            continue
        entry = kernels.setdefault(event.name, [0.0, 0])
        entry[0] += event.device_time / 1e3
        entry[1] += 1
        spans.append((event.time_range.start, event.time_range.end, event.name))
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    total = ("all kernels", sum(v[0] for v in kernels.values()), int(sum(v[1] for v in kernels.values())))
    rows = [total] + [(name[:120], ms, int(calls)) for name, (ms, calls) in ranked[:top]]
    return rows + _idle(sorted(spans), top)


def _idle(spans: list[tuple[float, float, str]], top: int) -> list[tuple[str, float, int]]:
    """Where the device waited between kernels (µs timestamps): the total, then the ``top`` longest gaps, each
    named by the kernels before and after it."""
    gaps, reach, last = [], None, ""
    for start, end, name in spans:
        if reach is not None and start > reach:
            gaps.append((start - reach, f"{last[:50]} -> {name[:50]}"))
        if reach is None or end > reach:
            reach, last = end, name
    gaps.sort(reverse=True)
    return [("device idle between kernels", sum(g for g, _ in gaps) / 1e3, len(gaps))] + \
        [(f"gap: {where}", gap / 1e3, 1) for gap, where in gaps[:top]]


def run_contenders(script: str, names: Sequence[str], extra: Sequence[str],
                   partial: str | None = None) -> list[dict[str, Any]]:
    """Run ``script --one NAME *extra`` for each name in its own process; the JSON each printed after
    ``RESULT ``, or ``{"contender": name, "error": ...}``. With ``partial``, the rows so far are written there
    after each contender (a run cut short keeps what it measured)."""
    rows: list[dict[str, Any]] = []
    for name in names:
        if partial and rows:
            with open(partial, "w", encoding="utf-8") as f:
                json.dump({"partial": True, "rows": rows}, f, indent=2)
        done = subprocess.run([sys.executable, os.path.abspath(script), "--one", name, *extra],
                              capture_output=True, text=True)
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not found:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:] or ["no output"]
            rows.append({"contender": name, "error": " | ".join(tail)[:600]})
            print(f"{name}: error: {rows[-1]['error']}", flush=True)
            continue
        rows.append(json.loads(found[-1][len("RESULT "):]))
        print(f"{name}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    return rows


def report_one(result: dict[str, Any]) -> None:
    """Print a contender's result for :func:`run_contenders` to collect."""
    print("RESULT " + json.dumps(result))


def main(doc: str, contenders: Sequence[str], default: Sequence[str], json_name: str,
         run_one: Callable[[str, dict[str, int], str | None, int, int, int, str], dict[str, Any]]
         ) -> tuple[argparse.Namespace, dict[str, int], list[dict[str, Any]]] | None:
    """The command line both benchmarks share: parse it; with ``--one NAME`` (a child process) run that contender
    and return None; otherwise run the chosen contenders, one process each, and return the arguments, the shape
    and the rows."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny model, for a quick smoke run")
    parser.add_argument("--device", help="device (default: torchport.device())")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included (default 3)")
    parser.add_argument("--contenders", default=",".join(default), help=f"subset of {','.join(contenders)}")
    parser.add_argument("--json", default=os.path.join(HERE, "results", json_name))
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="after timing, profile one more step and list its K slowest device kernels")
    parser.add_argument("--optimizer", default="fused", choices=OPTIMIZERS,
                        help="AdamW's fused kernel (default; Hugging Face Trainer's default) or its foreach kernels")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one contender in this process, print JSON
    args = parser.parse_args()
    shape = SMALL if args.small else FULL
    if args.one:
        report_one(run_one(args.one, shape, args.device, args.steps, args.warmup, args.profile, args.optimizer))
        return None
    wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(contenders))
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; valid: {', '.join(contenders)}")
    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--profile", str(args.profile),
             "--optimizer", args.optimizer] + \
        (["--small"] if args.small else []) + (["--device", args.device] if args.device else [])
    return args, shape, run_contenders(sys.argv[0], wanted, extra, args.json + ".partial")


def write(path: str, shape: dict[str, int], args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"shape": shape, "steps": args.steps, "warmup": args.warmup, "optimizer": args.optimizer,
                   "rows": rows}, f, indent=2)
    print(f"wrote {path}")
