"""``bench_kernels.py --sweep``: the memory-bound ops at a fixed number of rows over hidden (or vocabulary) sizes,
as GPU time against the device-to-device copy ceiling measured in the same run.

For each op and size: every contender is checked against the float32 reference on the first 64 rows, then timed
at the full row count. torchport's rows (and any peer that leaves its inputs alone) are timed as the replay of a
CUDA graph of one forward + backward, i.e. the kernels' GPU time without the host's launch work; a peer that writes
its gradients over its inputs (liger's in-place RMSNorm, GLUs and cross-entropy) is timed with CUDA events around
each call after an untimed restore of its inputs, which includes its launch time (negligible at the large sizes,
not at the small ones). Quack (``quack-kernels``) is a contender only where it imports; the run records why not.

Issue 23's target: every memory-bound op ≥ 90% of the copy ceiling in GPU time at 8192 rows for sizes
256 … 262144; cross-entropy ≥ 85%. The ceiling is the copy rate of a large buffer (``bench_kernels.py``'s, measured
in the same run); beside it each size also gets the time of one elementwise kernel that only reads and writes the
op's own least bytes, timed as torchport's rows are (``size_copy_ms``), which shows how much of the large-buffer
ceiling a single launch reaches at that size.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch

SWEEP_OPS = ("rms_norm", "layer_norm", "swiglu", "geglu", "cross_entropy")
SIZES = (256, 1024, 4096, 16384, 65536, 262144)
TARGET_PCT = {"cross_entropy": 85.0}  # every other op: 90%


def quack_status() -> str | None:
    """None when ``quack`` imports here, else why not."""
    try:
        import quack  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means no Quack row
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return None


def _quack(op: str):
    """Quack's function for ``op`` where it has one (forward + backward through autograd), else None."""
    import quack

    if op == "rms_norm" and hasattr(quack, "rmsnorm"):
        return lambda x, w: quack.rmsnorm(x, w, eps=1e-6)
    if op == "cross_entropy" and hasattr(quack, "cross_entropy"):
        return lambda logits, t: quack.cross_entropy(logits, t, ignore_index=-100).mean()
    return None


def _one(bench: Any, op: Any, name: str, fn: Any, size: int, rows: int, dtype: torch.dtype, dev: Any,
         mode: str) -> dict[str, Any]:
    row: dict[str, Any] = {"contender": name}
    scope = bench.kernel_mode(mode) if name.startswith("torchport") else contextlib.nullcontext()
    gen = torch.Generator(device=dev.device).manual_seed(size)
    try:
        with scope:
            small_args, small_grads = op.make((64, size), dtype, dev.device, gen)
            for a in small_args[:op.differentiable]:
                a.requires_grad_(True)
            ref = bench.reference(op, small_args, small_grads)
            errors, _ = bench.check(op, fn, small_args, small_grads, ref)
            row["rel_err"] = max(errors.values())
            row["status"] = "ok" if row["rel_err"] <= bench.TOLERANCE[dtype] else "FAIL"
            del small_args, small_grads, ref
            base_args, base_grads = op.make((rows, size), dtype, dev.device, gen)
            for a in base_args[:op.differentiable]:
                a.requires_grad_(True)
            row["bytes"] = op.bytes_moved(*base_args)
            args, grads = bench._fresh(base_args, base_grads)
            leaves = [a for a in args if a.requires_grad]

            def step() -> None:
                torch.autograd.backward(bench._as_tuple(fn(*args)), grads)

            def restore() -> None:
                with torch.no_grad():
                    for mine, base in zip(args + grads, base_args + base_grads):
                        mine.copy_(base)

            step()
            dev.synchronize()
            overwrites = any(not torch.equal(m, b) for m, b in zip(args + grads, base_args + base_grads))
            if overwrites:
                row["ms"] = dev.median_ms(step, leaves, restore)
                row["timer"] = "events, inputs restored untimed"
            else:
                row["ms"] = dev.graph_ms(step, leaves)
                row["timer"] = "CUDA graph replay"
                if row["ms"] is None:  # no CUDA graphs off CUDA: a synchronised host median
                    row["ms"] = dev.median_ms(step, leaves)
                    row["timer"] = "host median"
    except Exception as exc:  # noqa: BLE001 - a contender that cannot run is a row
        row.update(status="error", error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
    return row


def size_copy_ms(dev: Any, nbytes: int) -> float | None:
    """Time of one kernel that reads and writes ``nbytes`` in all (``torch.neg`` from one bf16 buffer of ``nbytes /
    4`` elements into another), as a CUDA-graph replay with the L2 cleared before each one (the sweep's timer); None
    off CUDA, where the sweep's rows are host medians and a per-size copy says nothing about the kernels, and where
    the two buffers do not fit beside what the sweep holds. Not ``copy_``: captured in a graph it becomes a memcpy
    node, which moved 2.7 TB/s on 1.3-34 GB on an H200, where this kernel reaches 4.2 (benchmarks/RESULTS.md, issue
    23)."""
    if dev.device.type != "cuda" or nbytes < 4:
        return None
    buffers: list[torch.Tensor] = []
    try:
        buffers.append(torch.empty(nbytes // 4, dtype=torch.bfloat16, device=dev.device).normal_())
        buffers.append(torch.empty_like(buffers[0]))
        return dev.graph_ms(lambda: torch.neg(buffers[0], out=buffers[1]), ())
    except torch.OutOfMemoryError:
        return None
    finally:
        buffers.clear()
        torch.cuda.empty_cache()


def _cell(entry: dict[str, Any]) -> str:
    if not entry.get("ms"):
        return entry.get("status", "-")
    size_copy = f" / {entry['pct_size_copy']:.1f}%" if entry.get("pct_size_copy") else ""
    return f"{entry['ms']:.4f} ms ({entry['pct_ceiling']:.1f}%{size_copy})"


def run_sweep(bench: Any, ops: list[str], sizes: list[int], rows: int, contenders: list[str],
              dtype: torch.dtype, dev: Any, ceiling: float, mode: str, json_path: str, meta: dict) -> None:
    quack_why = quack_status()
    print(f"sweep: {rows} rows, sizes {', '.join(map(str, sizes))}; quack: "
          f"{'imported' if quack_why is None else 'skipped (' + quack_why + ')'}")
    results = []
    for name in ops:
        op = bench.OPS[name]
        target = TARGET_PCT.get(name, 90.0)
        for size in sizes:
            entries = []
            for who in contenders + (["quack"] if quack_why is None else []):
                if who == "quack":
                    fn = _quack(name)
                else:
                    fn, error = bench.contender_fn(op, who)
                    if error is not None:
                        entries.append({"contender": who, "status": "error", "error": error})
                        continue
                if fn is None:
                    continue
                entry = _one(bench, op, who, fn, size, rows, dtype, dev, mode)
                if entry.get("ms"):
                    entry["pct_ceiling"] = 100 * entry["bytes"] / (entry["ms"] * 1e-3) / 1e9 / ceiling
                    if who == "torchport":
                        entry["target"] = f"≥{target:.0f}%: " + ("met" if entry["pct_ceiling"] >= target else "missed")
                entries.append(entry)
                if dev.device.type == "cuda":
                    torch.cuda.empty_cache()
            shown = "  ".join(f"{e['contender']} " + (f"{e['ms']:.4f} ms {e['pct_ceiling']:.1f}%"
                                                       + ("" if e.get("status") == "ok" else f" {e.get('status')}")
                                                       if e.get("ms") else f"{e.get('status')}: {e.get('error', '')}")
                              for e in entries)
            nbytes = next((e["bytes"] for e in entries if e.get("bytes")), 0)
            copy_ms = size_copy_ms(dev, nbytes)
            if copy_ms:
                for e in entries:  # against rows timed the same way only
                    if e.get("ms") and e.get("timer") == "CUDA graph replay":
                        e["pct_size_copy"] = 100 * copy_ms / e["ms"]
                shown += f"  (one pass over these bytes: {copy_ms:.4f} ms)"
            print(f"{name:>14} {rows}×{size:<7} {shown}", flush=True)
            results.append({"op": name, "rows": rows, "size": size, "target_pct": target, "entries": entries,
                            "size_copy_ms": copy_ms})
    print("\n| op | size | least bytes | one pass over them | " + " | ".join(contenders) + " | torchport target |")
    print("|---|---|---|---|" + "---|" * len(contenders) + "---|")
    for r in results:
        by = {e["contender"]: e for e in r["entries"]}
        cells = [_cell(by.get(c, {})) for c in contenders]
        nbytes = next((e["bytes"] for e in r["entries"] if e.get("bytes")), 0)
        copy = f"{r['size_copy_ms']:.4f} ms ({100 * nbytes / (r['size_copy_ms'] * 1e-3) / 1e9 / ceiling:.1f}%)" \
            if r.get("size_copy_ms") else "-"
        print(f"| {r['op']} | {r['size']} | {nbytes / 1e6:.1f} MB | {copy} | " + " | ".join(cells) +
              f" | {by.get('torchport', {}).get('target', '-')} |")
    print("(each cell: ms, % of the large-buffer copy ceiling; after '/', % of one pass over the same bytes)")
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump({**meta, "sweep_rows": rows, "sizes": sizes, "quack": quack_why or "imported",
                   "copy_gbps": ceiling, "results": results}, f, indent=1)
    print(f"wrote {json_path}")
