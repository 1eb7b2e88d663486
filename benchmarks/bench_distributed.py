"""Data-parallel scaling: the Llama-shaped train step on 1 and 2 devices, DDP and FSDP, through torchport.

Runs ``examples/train_distributed.py`` (torchport-patched model, ``torchport.distributed.wrap``) in these
configurations, each in its own processes, from the same seed and the same global batches:

* ``single``: one device, 4 rows x 2048 tokens per step (the per-device work of the runs below);
* ``reference``: one device, the 8-row global batch as 2 accumulated micro-batches of 4 (the loss curve the
  two-device runs must follow);
* ``ddp`` / ``fsdp``: two devices, 4 rows each (global batch 8);
* ``ddp-fp32-reduce``: DDP reducing the bf16 gradients in float32 (torchport does so from three ranks up; with
  two it reduces in bf16, which rounds the sum once either way);
* ``fsdp+ckpt``: FSDP with activation checkpointing (memory at the cost of a recomputed forward).

Reported: tokens/s, scaling efficiency (2-device tokens/s / 1-device tokens/s; target >= 1.85 for DDP), peak
memory per device (target: FSDP <= 60% of ``single``), and the largest loss difference from ``reference``.

    PYTHONPATH=$PWD/src python3 benchmarks/bench_distributed.py                  # 2 GPUs, ~5 minutes
    python3 benchmarks/bench_distributed.py --preset tiny --device cpu           # smoke run on the CPU (gloo)

Results: a table on stdout and ``results/distributed.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "train_distributed.py")

RUNS = {
    # name: processes, strategy, gradient accumulation, extra flags of the example
    "single": (1, "none", 1, []),
    "reference": (1, "none", 2, []),
    "ddp": (2, "ddp", 1, []),
    "ddp-fp32-reduce": (2, "ddp", 1, ["--reduce-dtype", "float32"]),
    "fsdp": (2, "fsdp", 1, []),
    "fsdp+ckpt": (2, "fsdp", 1, ["--checkpointing"]),
}


def run(name: str, preset: str, steps: int, warmup: int, device: str | None, timeout: float) -> dict[str, Any]:
    processes, strategy, accum, flags = RUNS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "torchport", "run", "--nproc-per-node", str(processes)]
        command += ["--device", device] if device else []
        command += [EXAMPLE, "--preset", preset, "--strategy", strategy, "--steps", str(steps), "--warmup",
                    str(warmup), "--grad-accum", str(accum), "--json", out]
        command += flags
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(ROOT, "src"),
                                                                           os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0 or not os.path.exists(out):
            text = done.stdout + done.stderr
            first = text.find("Traceback")  # the failing rank's own traceback, before torchrun's summary
            tail = text[first:first + 3000] if first >= 0 else text[-3000:]
            return {"name": name, "error": f"exit {done.returncode}", "output_tail": tail, "command": command}
        with open(out) as handle:
            result = json.load(handle)
    result["name"] = name
    result["command"] = " ".join(command[1:])
    return result


def summarise(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    single = results.get("single", {})
    reference = results.get("reference", {})
    summary: dict[str, Any] = {}
    for name, result in results.items():
        if "error" in result:
            continue
        row: dict[str, Any] = {}
        if single.get("tokens_per_s") and result["world_size"] > 1:
            row["scaling_efficiency"] = result["tokens_per_s"] / single["tokens_per_s"]
        if single.get("peak_memory_gib_per_process"):
            row["peak_vs_single"] = result["peak_memory_gib_per_process"] / single["peak_memory_gib_per_process"]
        if reference.get("losses") and result["global_batch"] == reference["global_batch"] and name != "reference":
            pairs = list(zip(result["losses"], reference["losses"]))
            row["max_loss_diff_vs_reference"] = max(abs(a - b) for a, b in pairs)
        summary[name] = row
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b", help="model preset of examples/train_distributed.py")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", help="device type (default: the detected one)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "distributed.json"))
    args = parser.parse_args()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"unknown run(s) {', '.join(unknown)}; valid: {', '.join(RUNS)}")

    results = {}
    for name in names:
        results[name] = run(name, args.preset, args.steps, args.warmup, args.device, args.timeout)
        result = results[name]
        if "error" in result:
            print(f"{name}: FAILED ({result['error']})\n{result['output_tail']}", flush=True)
        else:
            print(f"{name}: {result['tokens_per_s']:.0f} tokens/s, peak {result['peak_memory_gib_per_process']:.2f} "
                  f"GiB/device, losses {' '.join(f'{x:.4f}' for x in result['losses'])}", flush=True)
    summary = summarise(results)

    print(f"\n{'run':<16} {'devices':>7} {'global batch':>12} {'tokens/s':>10} {'scaling':>8} {'peak GiB':>9} "
          f"{'vs single':>9} {'max |dloss|':>11}")
    for name, result in results.items():
        if "error" in result:
            print(f"{name:<16} failed: {result['error']}")
            continue
        row = summary[name]
        scaling = f"{row['scaling_efficiency']:.3f}" if "scaling_efficiency" in row else "-"
        ratio = f"{row['peak_vs_single']:.2f}" if "peak_vs_single" in row else "-"
        diff = f"{row['max_loss_diff_vs_reference']:.4f}" if "max_loss_diff_vs_reference" in row else "-"
        print(f"{name:<16} {result['world_size']:>7} {result['global_batch']:>12} {result['tokens_per_s']:>10.0f} "
              f"{scaling:>8} {result['peak_memory_gib_per_process']:>9.2f} {ratio:>9} {diff:>11}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"preset": args.preset, "steps": args.steps, "warmup": args.warmup, "runs": results,
                   "summary": summary}, handle, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
