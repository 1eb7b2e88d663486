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

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_step  # noqa: E402

CONTENDERS = ("eager", "liger", "torchport")


def run_one(name: str, shape: dict[str, int], device_spec: str | None, steps: int, warmup: int) -> dict[str, Any]:
    """Build, patch, train ``warmup + steps`` steps, and measure; runs in its own process."""
    import torchport

    model, device = llama_step.build(shape, device_spec)
    if name == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    elif name == "torchport":
        torchport.patch(model)
    return {"contender": name, **llama_step.measure(model, model, shape, device, steps, warmup)}


def main() -> None:
    ran = llama_step.main(__doc__, CONTENDERS, CONTENDERS, "train_step.json", run_one)
    if ran is None:
        return
    args, shape, rows = ran
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
    llama_step.write(args.json, shape, args, rows)


if __name__ == "__main__":
    main()
