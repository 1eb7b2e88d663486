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

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_step  # noqa: E402

CONTENDERS = ("eager", "inductor", "torchport", "patched", "torchport-no-fusion", "torchport-ce-only")


def _variants() -> dict[str, dict[str, bool]]:
    """The torchport backend with some of its kernel-fusion passes switched off or on, to see what each
    contributes (the fusion passes are those that swap a subgraph for a torchport op)."""
    from torchport.compile import passes

    fusions = [p.name for p in passes.list_passes() if p.fusion]
    return {"torchport-no-fusion": {name: False for name in fusions},
            "torchport-ce-only": {name: name == "cross_entropy" for name in fusions}}


def run_one(name: str, shape: dict[str, int], device_spec: str | None, steps: int, warmup: int,
            profile: int = 0, optimizer: str = "fused") -> dict[str, Any]:
    import torch

    import torchport

    model, device = llama_step.build(shape, device_spec)
    forward = model
    if name == "inductor":
        forward = torch.compile(model)
    elif name == "torchport":
        forward = torch.compile(model, backend="torchport")
    elif name in ("torchport-no-fusion", "torchport-ce-only"):
        forward = torch.compile(model, backend="torchport", options={"passes": _variants()[name]})
    elif name == "patched":
        torchport.patch(model)
    result = llama_step.measure(model, forward, shape, device, steps, warmup, profile, optimizer)
    median_s = result["median_step_ms"] / 1e3
    result["compile_s"] = max(0.0, result["first_step_s"] - median_s) if result["first_step_s"] else None
    return {"contender": name, **result}


def main() -> None:
    ran = llama_step.main(__doc__, CONTENDERS, CONTENDERS[:4], "compile.json", run_one)
    if ran is None:
        return
    args, shape, rows = ran
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
    llama_step.write(args.json, shape, args, rows)


if __name__ == "__main__":
    main()
