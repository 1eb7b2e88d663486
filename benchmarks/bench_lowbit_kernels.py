"""torchport's low-bit matmul kernels on the linear layers of an 8B-shaped Llama, one layer at a time, against bf16.

For each layer shape (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336, lm_head 128256x4096) and
each format: the time of ``x @ W.T`` for 1 row (the batch-1 decode kernel) and 2-16 rows (what the autotuner chose:
the tensor-core kernel, the one-row kernel per row, or dequantise + dense matmul; the ``*_kernel`` field names it),
the bytes of the stored weight over that time (GB/s: the copy bandwidth of an H100 is about 3000), the speed-up over
the bf16 ``F.linear``, and the time of one dequantisation of the weight into bf16 (what prefill pays per layer
before the dense matmul).

Times are medians of ``triton.testing.do_bench`` over a CUDA graph of 20 calls, so the host's launch cost is not
counted (in a model the decode step is replayed from one graph as well).

    PYTHONPATH=$PWD/src python3 benchmarks/bench_lowbit_kernels.py --json benchmarks/results/lowbit_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lowbit import capture  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
FORMATS = ("int8", "fp8", "int4", "mxfp4", "nvfp4")
_CALLS = 20


def graph_ms(fn) -> float:
    """Median milliseconds of one ``fn()``, replayed from a CUDA graph of ``_CALLS`` calls."""
    import triton

    fn()  # compiles and autotunes outside the graph
    graph = capture(fn, _CALLS)
    return triton.testing.do_bench(graph.replay, return_mode="median") / _CALLS


def run(rows_list: list[int]) -> list[dict]:
    from torchport.kernels.triton import lowbit
    from torchport.quant.formats import get_format

    torch.manual_seed(0)
    out = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed = {}
        for name in FORMATS:
            fmt = get_format(name)
            group = fmt.group_size(None, k)
            packed[name] = (group, {key: v.contiguous() for key, v in fmt.quantize(w, group).items()})
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = graph_ms(lambda: torch.nn.functional.linear(x, w))
            row = {"n": n, "k": k, "m": m, "bf16_us": round(base * 1e3, 2), "bf16_GBs": round(n * k * 2 / base / 1e6)}
            for name, (group, t) in packed.items():
                nbytes = sum(v.numel() * v.element_size() for v in t.values())
                ref = torch.nn.functional.linear(x.float(), lowbit.dequantize(t, name, group, torch.float32))
                got = lowbit.matmul(x, t, name, group, None).float()
                row[f"{name}_rel_error"] = float((got - ref).norm() / ref.norm())
                config = (lowbit._TUNED_GEMV if m == 1 else lowbit._TUNED)[name].lookup(
                    x.device, x.dtype, *((n, k, group) if m == 1 else (m, n, k, group)))
                row[f"{name}_kernel"] = None if config is None else config.get("KERNEL")
                ms = graph_ms(lambda: lowbit.matmul(x, t, name, group, None))
                row[f"{name}_us"] = round(ms * 1e3, 2)
                row[f"{name}_GBs"] = round(nbytes / ms / 1e6)
                row[f"{name}_x"] = round(base / ms, 3)
                if m == rows_list[0]:
                    deq = graph_ms(lambda: lowbit.dequantize(t, name, group, torch.bfloat16))
                    row[f"{name}_dequantize_us"] = round(deq * 1e3, 2)
            out.append(row)
            print(json.dumps(row), flush=True)
        del packed, w
        torch.cuda.empty_cache()
    return out


def table(rows: list[dict]) -> str:
    head = f"{'shape':>14}{'rows':>5}{'bf16 us':>9}" + "".join(f"{f + ' us (x)':>18}" for f in FORMATS)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f"{r[f + '_us']:>9.1f} ({r[f + '_x']:.2f})" for f in FORMATS)
        lines.append(f"{r['n']:>7}x{r['k']:<6}{r['m']:>5}{r['bf16_us']:>9.1f}{cells}")
    deq = [r for r in rows if f"{FORMATS[0]}_dequantize_us" in r]
    lines.append("dequantise into bf16, us: " + "; ".join(
        f"{r['n']}x{r['k']} " + ", ".join(f"{f} {r[f + '_dequantize_us']:.0f}" for f in FORMATS) for r in deq))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--shapes", default=None, help="comma-separated NxK, e.g. 4096x4096,1024x4096")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_lowbit_kernels.py times the CUDA kernels: it needs a CUDA GPU")
    if args.shapes:
        SHAPES[:] = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = run(args.rows)
    print(table(rows))
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "timing": f"CUDA graph of "
                f"{_CALLS} calls, triton do_bench median"}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
