"""Train step of a Llama-shaped model: Hugging Face eager vs liger-kernel-patched vs torchport-patched.

Model (``../shared/BENCHMARKS.md``): hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 kv heads, vocab 128256,
bf16 weights, SDPA attention, AdamW; batch 4 x 2048 tokens, labels = inputs (causal-LM loss). Each contender runs
in its own process (both liger-kernel and torchport patch transformers' modules), from the same seed and data:
tokens/s over the timed steps, peak device memory during them, and the losses of every step (the three runs
should agree to bf16 noise).

    PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/bench_train_step.py             # H100: ~3 min
    python3 benchmarks/bench_train_step.py --small --device cpu                      # smoke run, seconds

Results: a table on stdout and ``results/train_step.json`` (``--json``).
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

CONTENDERS = ("eager", "liger", "torchport")
FULL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, batch=4, seq=2048)
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, batch=2, seq=32)


def run_one(name: str, shape: dict[str, int], device_spec: str | None, steps: int, warmup: int) -> dict[str, Any]:
    """Build, patch, train ``warmup + steps`` steps, and measure; runs in its own process."""
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
    if name == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    elif name == "torchport":
        torchport.patch(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (shape["batch"], shape["seq"]), generator=gen).to(device)
               for _ in range(warmup + steps)]
    losses: list[float] = []

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for tokens in batches[:warmup]:
        losses.append(float(step(tokens)))
    torchport.synchronize(device)
    backend = torchport.backends.get_backend(device.type)
    index = device.index or 0
    if device.type != "cpu":
        backend.reset_peak_memory_stats(index)
    times = []
    pending = []
    start = time.perf_counter()
    for tokens in batches[warmup:]:
        pending.append(step(tokens))
        torchport.synchronize(device)
        now = time.perf_counter()
        times.append(now - start)
        start = now
    losses += [float(t) for t in pending]
    peak = backend.memory_stats(index).get("peak_allocated") if device.type != "cpu" else None
    tokens_per_step = shape["batch"] * shape["seq"]
    return {
        "contender": name,
        "device": str(device),
        "median_step_ms": statistics.median(times) * 1e3,
        "tokens_per_s": tokens_per_step / statistics.median(times),
        "peak_gib": None if peak is None else peak / 2**30,
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny model, for a quick smoke run")
    parser.add_argument("--device", help="device (default: torchport.device())")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help=f"subset of {','.join(CONTENDERS)}")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "train_step.json"))
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
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            rows.append({"contender": name, "error": tail[0][:300]})
            print(f"{name}: error: {tail[0][:300]}")
            continue
        rows.append(json.loads(found[-1][len("RESULT "):]))
    ok = {r["contender"]: r for r in rows if "error" not in r}
    print(f"\nLlama-shaped train step, batch {shape['batch']} x {shape['seq']}, {shape['num_hidden_layers']} layers, "
          f"hidden {shape['hidden_size']}, vocab {shape['vocab_size']}, bf16, AdamW")
    print("| contender | median step ms | tokens/s | vs liger | peak GiB | loss, first → last |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['contender']} | error: {r['error']} | | | | |")
            continue
        versus = f"{r['tokens_per_s'] / ok['liger']['tokens_per_s']:.3f}x" if "liger" in ok else "-"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"| {r['contender']} | {r['median_step_ms']:.1f} | {r['tokens_per_s']:.0f} | {versus} | {peak} | "
              f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f} |")
    if "torchport" in ok and "liger" in ok:
        tp, lg = ok["torchport"], ok["liger"]
        speed = tp["tokens_per_s"] / lg["tokens_per_s"]
        print(f"\ntarget tokens/s ≥ 1.15x liger: {'met' if speed >= 1.15 else 'missed'} ({speed:.3f}x)")
        if tp["peak_gib"] is not None and lg["peak_gib"] is not None:
            over = tp["peak_gib"] - lg["peak_gib"]
            print(f"target peak ≤ liger: {'met' if over <= 0 else f'missed by {over:.2f} GiB'}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"shape": shape, "steps": args.steps, "warmup": args.warmup, "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
