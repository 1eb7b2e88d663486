"""Train step of a Llama-shaped model: Hugging Face eager, liger-kernel, Inductor, liger + Inductor, torchport
eager and torchport + ``torch.compile``.

Model (``../shared/BENCHMARKS.md``): hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 kv heads, vocab 128256,
bf16 weights, SDPA attention, AdamW (fused, Hugging Face Trainer's default; ``--optimizer foreach``: torch's own
default); batch 4 x 2048 tokens, labels = inputs (causal-LM loss). Each contender runs
in its own process (both liger-kernel and torchport patch transformers' modules; compiling fills dynamo's caches),
from the same seed and data: tokens/s over the timed steps, peak device memory during them, and the losses of every
step, compared with Hugging Face eager's.

* ``eager``: the model as Hugging Face builds it; ``liger``: ``_apply_liger_kernel_to_instance(model)``;
* ``inductor``: ``torch.compile(model)``; ``liger-inductor``: liger's patch, then ``torch.compile``;
* ``torchport``: ``torchport.patch(model)``; ``torchport-compile``: ``torch.compile(torchport.patch(model))``
  (torchport's ops are custom ops: Inductor compiles around them, with no graph break).
* not run by default: ``inductor-graphs`` and ``torchport-compile-graphs``, the same with
  ``mode="reduce-overhead"`` (CUDA graphs replay each compiled graph: no host time per kernel).

Targets (issue 23): torchport + compile ≥ 1.15× liger's tokens/s and ≥ 1.05× the fastest other contender, peak
memory ≤ liger's, losses equal within bf16 tolerance.

    PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/bench_train_step.py             # H100: ~6 min
    python3 benchmarks/bench_train_step.py --small --device cpu --contenders eager,torchport   # smoke run
    python3 benchmarks/bench_train_step.py --contenders torchport,torchport-compile --profile 25   # where time goes

Results: a table on stdout and ``results/train_step.json`` (``--json``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_step  # noqa: E402

CONTENDERS = ("eager", "liger", "inductor", "liger-inductor", "torchport", "torchport-compile", "inductor-graphs",
              "torchport-compile-graphs")
DEFAULT = CONTENDERS[:6]
LOSS_TOLERANCE = 2e-2  # |loss - eager's| per step: a few bf16 roundings of a loss near 12 (one ulp is 0.0625)


def run_one(name: str, shape: dict[str, int], device_spec: str | None, steps: int, warmup: int,
            profile: int = 0, optimizer: str = "fused") -> dict[str, Any]:
    """Build, patch, (compile,) train ``warmup + steps`` steps, and measure; runs in its own process."""
    import torch

    import torchport

    model, device = llama_step.build(shape, device_spec)
    if name.startswith("liger"):
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    elif name.startswith("torchport"):
        torchport.patch(model)
    if name.endswith("-graphs"):  # Inductor with CUDA graphs: no host time per kernel launch
        forward = torch.compile(model, mode="reduce-overhead")
    elif name in ("inductor", "liger-inductor", "torchport-compile"):
        forward = torch.compile(model)
    else:
        forward = model
    result = llama_step.measure(model, forward, shape, device, steps, warmup, profile, optimizer)
    median_s = result["median_step_ms"] / 1e3
    result["compile_s"] = max(0.0, result["first_step_s"] - median_s) if result["first_step_s"] else None
    return {"contender": name, **result}


def _targets(mine: str, ok: dict[str, dict[str, Any]]) -> None:
    """Issue 23's targets for the torchport + compile contender ``mine``, against the others that ran."""
    tp, lg = ok[mine], ok.get("liger")
    print(f"\n{mine}:")
    if lg is not None:
        speed = tp["tokens_per_s"] / lg["tokens_per_s"]
        print(f"target tokens/s ≥ 1.15x liger: {'met' if speed >= 1.15 else 'missed'} ({speed:.3f}x)")
        if mine.endswith("-graphs"):
            print("target peak ≤ liger: not measured (the CUDA graphs' memory pool is not in the allocated peak)")
        elif tp["peak_gib"] is not None and lg["peak_gib"] is not None:
            over = tp["peak_gib"] - lg["peak_gib"]
            print(f"target peak ≤ liger: {'met' if over <= 0 else f'missed by {over:.2f} GiB'}")
    others = [r for name, r in ok.items() if not name.startswith("torchport-compile")]
    if others:
        best = max(others, key=lambda r: r["tokens_per_s"])
        ratio = tp["tokens_per_s"] / best["tokens_per_s"]
        print(f"target ≥ 1.05x the fastest other ({best['contender']}): {'met' if ratio >= 1.05 else 'missed'} "
              f"({ratio:.3f}x)")
    if "max_loss_diff_vs_eager" in tp:
        same = tp["max_loss_diff_vs_eager"] <= LOSS_TOLERANCE
        print(f"losses within {LOSS_TOLERANCE} of eager's: {'met' if same else 'missed'} "
              f"({tp['max_loss_diff_vs_eager']:.4f})")


def main() -> None:
    ran = llama_step.main(__doc__, CONTENDERS, DEFAULT, "train_step.json", run_one)
    if ran is None:
        return
    args, shape, rows = ran
    ok = {r["contender"]: r for r in rows if "error" not in r}
    base = ok.get("eager")
    print(f"\nLlama-shaped train step, batch {shape['batch']} x {shape['seq']}, {shape['num_hidden_layers']} layers, "
          f"hidden {shape['hidden_size']}, vocab {shape['vocab_size']}, bf16, AdamW ({args.optimizer})")
    print("| contender | median step ms | tokens/s | vs liger | peak GiB | loss, first → last | max |Δloss| vs eager |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['contender']} | error: {r['error']} | | | | | |")
            continue
        versus = f"{r['tokens_per_s'] / ok['liger']['tokens_per_s']:.3f}x" if "liger" in ok else "-"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        if base is not None:
            r["max_loss_diff_vs_eager"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        diff = f"{r['max_loss_diff_vs_eager']:.4f}" if "max_loss_diff_vs_eager" in r else "-"
        print(f"| {r['contender']} | {r['median_step_ms']:.1f} | {r['tokens_per_s']:.0f} | {versus} | {peak} | "
              f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f} | {diff} |")
    for r in rows:
        if r.get("profile"):
            print(f"\n{r['contender']}: the device kernels of one step, slowest first")
            print("| kernel | ms | calls |\n|---|---|---|")
            for name, ms, calls in r["profile"]:
                print(f"| {name} | {ms:.2f} | {calls} |")
    for mine in ("torchport-compile", "torchport-compile-graphs"):
        if mine in ok:
            _targets(mine, ok)
    llama_step.write(args.json, shape, args, rows)


if __name__ == "__main__":
    main()
