"""The Llama-shaped train step of an *unpatched* Hugging Face model under eager, Inductor and the torchport backend.

Contenders, each in its own process from the same seed and data (``../shared/BENCHMARKS.md`` shapes: hidden 2048,
intermediate 8192, 16 layers, 32 heads, 8 kv heads, vocab 128256; batch 4 x 2048; bf16; AdamW):

* ``eager``: the model as Hugging Face builds it;
* ``inductor``: ``torch.compile(model)``;
* ``torchport``: ``torch.compile(model, backend="torchport")`` — torchport's passes put its fused kernels into
  the unpatched model's graphs, then Inductor compiles the rest;
* ``patched``: eager, with ``torchport.patch(model)`` (the target for the backend: at least as fast).

Reported: tokens/s (median step), peak device memory over the timed steps, and compile time (the first step's
time less a steady step's). Target: the torchport backend >= Inductor and >= the patched eager model.

    PYTHONPATH=$PWD/src python3 benchmarks/bench_compile.py                # GPU, ~4 minutes
    python3 benchmarks/bench_compile.py --small --device cpu               # smoke run

Results: a table on stdout and ``results/compile.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

CONTENDERS = ("eager", "inductor", "torchport", "patched", "torchport-no-fusion", "torchport-ce-only")
# the torchport backend with some of its kernel-fusion passes switched off, to see what each contributes
_FUSIONS = ("rms_norm", "swiglu", "geglu", "rope", "cross_entropy")
_VARIANTS = {
    "torchport-no-fusion": {name: False for name in _FUSIONS},
    "torchport-ce-only": {name: False for name in _FUSIONS if name != "cross_entropy"},
}
FULL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, batch=4, seq=2048)
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, batch=2, seq=32)


def run_one(name: str, shape: dict[str, int], device_spec: str | None, steps: int, warmup: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import torchport
    import torchport.backends

    device = torch.device(device_spec) if device_spec else torchport.device()
    dims = {k: v for k, v in shape.items() if k not in ("batch", "seq")}
    config = LlamaConfig(**dims, max_position_embeddings=max(4096, shape["seq"]), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.train()
    forward = model
    if name == "inductor":
        forward = torch.compile(model)
    elif name == "torchport":
        forward = torch.compile(model, backend="torchport")
    elif name in _VARIANTS:
        forward = torch.compile(model, backend="torchport", options={"passes": _VARIANTS[name]})
    elif name == "patched":
        torchport.patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (shape["batch"], shape["seq"]), generator=gen).to(device)
               for _ in range(warmup + steps)]

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

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
    explained = None
    if name.startswith("torchport"):
        from torchport.compile import passes

        explained = [p.name for p in passes.list_passes() if _VARIANTS.get(name, {}).get(p.name, True)]
    return {
        "contender": name,
        "device": str(device),
        "device_name": backend.device_name(index),
        "median_step_ms": median * 1e3,
        "tokens_per_s": shape["batch"] * shape["seq"] / median,
        "peak_gib": None if peak is None else peak / 2**30,
        "compile_s": max(0.0, warm_times[0] - median) if warm_times else None,
        "losses": losses,
        "passes": explained,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny model, for a quick smoke run")
    parser.add_argument("--device", help="device (default: torchport.device())")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included")
    parser.add_argument("--contenders", default=",".join(CONTENDERS[:4]), help=f"subset of {','.join(CONTENDERS)}")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "compile.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one contender in this process, print JSON
    args = parser.parse_args()
    shape = SMALL if args.small else FULL
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, shape, args.device, args.steps, args.warmup)))
        return
    wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(CONTENDERS))
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; valid: {', '.join(CONTENDERS)}")
    rows = []
    for name in wanted:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + (["--small"] if args.small else []) + \
              (["--device", args.device] if args.device else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not found:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:] or ["no output"]
            rows.append({"contender": name, "error": " | ".join(tail)[:600]})
            print(f"{name}: error: {rows[-1]['error']}", flush=True)
            continue
        rows.append(json.loads(found[-1][len("RESULT "):]))
        print(f"{name}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    ok = {r["contender"]: r for r in rows if "error" not in r}
    print(f"\nunpatched Llama-shaped train step, batch {shape['batch']} x {shape['seq']}, "
          f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, vocab {shape['vocab_size']}, bf16")
    print("| contender | median step ms | tokens/s | vs inductor | peak GiB | compile s | loss, first → last |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['contender']} | error: {r['error']} | | | | | |")
            continue
        versus = f"{r['tokens_per_s'] / ok['inductor']['tokens_per_s']:.3f}x" if "inductor" in ok else "-"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"| {r['contender']} | {r['median_step_ms']:.1f} | {r['tokens_per_s']:.0f} | {versus} | {peak} | "
              f"{r['compile_s']:.1f} | {r['losses'][0]:.4f} → {r['losses'][-1]:.4f} |")
    if "torchport" in ok:
        for other in ("inductor", "patched"):
            if other in ok:
                ratio = ok["torchport"]["tokens_per_s"] / ok[other]["tokens_per_s"]
                print(f"target torchport backend ≥ {other}: {'met' if ratio >= 1 else 'missed'} ({ratio:.3f}x)")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"shape": shape, "steps": args.steps, "warmup": args.warmup, "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
