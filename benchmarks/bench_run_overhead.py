"""What `torchport run` costs: start-up added to a script, and per-step overhead of a training step.

Both are measured in one process tree on one machine, interleaving plain ``python`` and ``torchport run`` runs
so that drift affects both alike. Prints a table and writes JSON (default benchmarks/results/run_overhead.json).

    python benchmarks/bench_run_overhead.py [--rounds 5] [--steps 30] [--json PATH]

Targets (issue 3): per-step overhead on CUDA <= 1%; start-up added < 0.3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _command(torchport: bool, script: str, *args: str) -> list[str]:
    if torchport:
        return [sys.executable, "-m", "torchport", "run", script, *args]
    return [sys.executable, script, *args]


def startup(rounds: int) -> dict:
    """Wall time of a script that only imports torch, with and without torchport run."""
    # A folder of its own: `python script.py` puts the script's folder first on sys.path for every import torch
    # makes, so a crowded folder such as /tmp would slow the plain run and flatter torchport's.
    folder = tempfile.mkdtemp()
    script = os.path.join(folder, "import_torch.py")
    with open(script, "w") as f:
        f.write("import torch\n")
    results: dict[str, list[float]] = {"python": [], "torchport run": []}
    for round_index in range(rounds):
        order = (("python", False), ("torchport run", True))
        for label, use in (order if round_index % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            subprocess.run(_command(use, script), check=True, capture_output=True, cwd=folder)
            results[label].append(time.perf_counter() - t0)
    shutil.rmtree(folder)
    medians = {label: statistics.median(values) for label, values in results.items()}
    return {"python_s": medians["python"], "torchport_run_s": medians["torchport run"],
            "added_s": medians["torchport run"] - medians["python"], "rounds": rounds}


_IN_PROCESS = """
import time, torch
t0 = time.perf_counter()
import torchport.cli.main, torchport.compat as compat
t1 = time.perf_counter()
compat.patch({target!r})
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def in_process(rounds: int) -> dict:
    """torchport's own start-up work once torch is loaded: importing its CLI, then installing the shim (for the
    detected device, and for the CPU, where every patch is installed). Precise where whole-process timings are not."""
    out: dict[str, float] = {}
    for target in (None, "cpu"):
        imports, patches = [], []
        for _ in range(rounds):
            done = subprocess.run([sys.executable, "-c", _IN_PROCESS.format(target=target)], check=True,
                                  capture_output=True, text=True)
            a, b = map(float, done.stdout.split())
            imports.append(a)
            patches.append(b)
        key = "detected" if target is None else target
        out["import_s"] = statistics.median(imports)
        out[f"patch_{key}_s"] = statistics.median(patches)
    return out


def step_overhead(rounds: int, steps: int) -> dict | None:
    """Median training-step time of run_overhead_step.py, plain vs under torchport run (CUDA only)."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != "True":
        return None
    script = os.path.join(HERE, "run_overhead_step.py")
    per: dict[str, list[float]] = {"python": [], "torchport run": []}
    device = None
    order = (("python", False), ("torchport run", True))
    for round_index in range(rounds):
        # ABBA: alternate which goes first, so drift (clocks, other tenants) falls on both alike
        for label, use in (order if round_index % 2 == 0 else order[::-1]):
            out = subprocess.run(_command(use, script, str(steps), "5"), check=True, capture_output=True, text=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            per[label].append(row["median_ms"])
            device = row["device"]
    plain, shim = statistics.median(per["python"]), statistics.median(per["torchport run"])
    # The same program in separate processes differs by more than any shim cost: report that spread beside it.
    spread = (max(per["python"]) - min(per["python"])) / plain
    return {"device": device, "python_ms": plain, "torchport_run_ms": shim, "overhead": shim / plain - 1,
            "python_spread": spread, "rounds": rounds, "steps_per_round": steps, "per_round": per}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "run_overhead.json"))
    parser.add_argument("--no-train", action="store_true", help="measure start-up only")
    args = parser.parse_args()
    if shutil.which(sys.executable) is None:
        raise SystemExit(f"python interpreter {sys.executable!r} not found")
    result = {"startup": startup(args.rounds), "in_process": in_process(args.rounds),
              "train_step": None if args.no_train else step_overhead(args.rounds, args.steps)}
    s, p = result["startup"], result["in_process"]
    print("| measure | python | torchport run | difference |")
    print("|---|---|---|---|")
    print(f"| start-up (import torch script), s | {s['python_s']:.3f} | {s['torchport_run_s']:.3f} | "
          f"{s['added_s']:+.3f} s |")
    print(f"| torchport's own start-up work (import CLI + patch), s | - | {p['import_s'] + p['patch_detected_s']:.3f} "
          f"(patching for the CPU: {p['import_s'] + p['patch_cpu_s']:.3f}) | |")
    t = result["train_step"]
    if t is None:
        print("| train step | (not measured: no CUDA device, or --no-train) | | |")
    else:
        print(f"| train step on {t['device']}, ms (median of {t['rounds']} processes) | {t['python_ms']:.2f} | "
              f"{t['torchport_run_ms']:.2f} | {100 * t['overhead']:+.2f}% (python alone spreads "
              f"{100 * t['python_spread']:.1f}%) |")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
