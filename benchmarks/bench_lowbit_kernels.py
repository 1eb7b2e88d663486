"""torchport's low-bit matmul kernels on the linear layers of an 8B-shaped Llama, one layer at a time, against bf16.

For each layer shape (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336, lm_head 128256x4096) and
each format: the time of ``x @ W.T`` for 1 row (the batch-1 decode kernel) and 2-16 rows (what the autotuner chose:
the tensor-core kernel, the one-row kernel per row, or dequantise + dense matmul; the ``*_kernel`` field names it),
the bytes of the stored weight over that time (GB/s: the copy bandwidth of an H100 is about 3000), the speed-up over
the bf16 ``F.linear``, and the time of one dequantisation of the weight into bf16 (what prefill pays per layer
before the dense matmul).

Times are medians of ``triton.testing.do_bench`` over a CUDA graph of calls, so the host's launch cost is not
counted (in a model the decode step is replayed from one graph as well), in two ways:

* ``cold`` (the ``*_us`` fields): the graph cycles over copies of the weight (same values, other addresses) that
  together exceed the 50 MB L2 at least 4 times, so every call reads its weight from DRAM, as in a decode step of a
  model whose weights do not fit in L2; this is how the autotuner times (L2 cleared before each run);
* ``warm`` (``*_warm_us``): 20 calls on one weight, which run partly from L2 for weights up to ~33 MB (the method
  of the issue-24 table before this one).

``--prefill-rows`` adds, per layer, one call of that many rows (eager, autotuned): bf16, and each format's choice
(``*_prefill_kernel``: 4 = dequantise + matmul, 5 = the decode-in-prologue GEMM).

``--read-ceiling`` adds, to each one-row line, how fast one kernel launch can merely read the stored bytes cold:
the fastest of a set of Triton read-only kernels (every int32 word loaded and xor-ed, one word written per program)
over the same number of bytes, timed the same cold way (``bf16_read_us``, ``<format>_read_us``), and
``<format>_bound_x`` = bf16 ``F.linear`` time / that read time: the highest one-row speed-up over bf16 that a kernel
reading its weight once in one launch could reach on this machine.

    PYTHONPATH=$PWD/src python3 benchmarks/bench_lowbit_kernels.py --json benchmarks/results/lowbit_kernels.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lowbit import capture  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
FORMATS = ["int8", "fp8", "int4", "mxfp4", "nvfp4"]
_CALLS = 20
_COLD_BYTES = 200 * 2**20  # 4x the H100's 50 MB L2


def graph_ms(fn) -> float:
    """Median milliseconds of one ``fn()``, replayed from a CUDA graph of ``_CALLS`` calls."""
    import triton

    fn()  # compiles and autotunes outside the graph
    graph = capture(fn, _CALLS)
    return triton.testing.do_bench(graph.replay, return_mode="median") / _CALLS


def cold_ms(fns) -> float:
    """Median milliseconds of one call, from a CUDA graph of one call of each of ``fns`` (each on its own copy of
    the weight, so that the copies together do not stay in L2)."""
    import triton

    for fn in fns:
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") / len(fns)


def copies(nbytes: int) -> int:
    return max(2, min(64, -(-_COLD_BYTES // nbytes)))


@functools.cache
def _read_kernel():
    """A Triton kernel that loads every int32 word of its input and writes one xor per program (imported on first
    use, as the other timings import Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_words(p, out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([BLOCK], tl.int32)
        for i in tl.static_range(ITERS):  # unrolled: every load of the program issued before the xor waits
            offs = pid * BLOCK * ITERS + i * BLOCK + tl.arange(0, BLOCK)
            acc ^= tl.load(p + offs, mask=offs < n, other=0)
        tl.store(out + pid, tl.xor_sum(acc, 0))

    return read_words


def read_ms(nbytes: int) -> tuple[float, dict]:
    """(milliseconds, configuration) of the fastest read-only kernel over ``nbytes`` stored bytes, cold."""
    import triton

    kernel = _read_kernel()
    n = nbytes // 4
    bufs = [torch.randint(-2**31, 2**31 - 1, (n,), device="cuda", dtype=torch.int32) for _ in range(copies(nbytes))]
    best = (float("inf"), {})
    for block in (512, 1024, 2048):  # the fastest on an H100 for 2 MB to 1 GB (a wider sweep: RESULTS.md)
        for iters in (1, 2):
            for warps in (2, 4, 8):
                if block < 128 * warps or block > 2048 * warps:  # 4 to 64 words a thread per load
                    continue
                grid = (triton.cdiv(n, block * iters),)
                out = torch.empty(grid[0], device="cuda", dtype=torch.int32)
                ms = cold_ms([lambda b=b: kernel[grid](b, out, n, BLOCK=block, ITERS=iters, num_warps=warps)
                              for b in bufs])
                if ms < best[0]:
                    best = (ms, {"BLOCK": block, "ITERS": iters, "num_warps": warps})
    return best


def eager_ms(fn) -> float:
    import triton

    fn()
    return triton.testing.do_bench(fn, return_mode="median")


def run(rows_list: list[int], prefill_rows: int | None, read_ceiling: bool = False) -> list[dict]:
    from torchport.kernels.triton import lowbit, lowbit_tuning
    from torchport.quant.formats import get_format

    torch.manual_seed(0)
    out = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        ws = [w] + [w.clone() for _ in range(copies(w.numel() * 2) - 1)]
        packed = {}
        for name in FORMATS:
            fmt = get_format(name)
            group = fmt.group_size(None, k)
            t = {key: v.contiguous() for key, v in fmt.quantize(w, group).items()}
            nbytes = sum(v.numel() * v.element_size() for v in t.values())
            ts = [t] + [{key: v.clone() for key, v in t.items()} for _ in range(copies(nbytes) - 1)]
            packed[name] = (group, ts, nbytes)
        for m in rows_list + ([prefill_rows] if prefill_rows else []):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            prefill = m > lowbit.DECODE_ROWS
            if prefill:
                base = eager_ms(lambda: torch.nn.functional.linear(x, w))
                row = {"n": n, "k": k, "m": m, "bf16_us": round(base * 1e3, 2)}
            else:
                base = cold_ms([lambda v=v: torch.nn.functional.linear(x, v) for v in ws])
                warm = graph_ms(lambda: torch.nn.functional.linear(x, w))
                row = {"n": n, "k": k, "m": m, "bf16_us": round(base * 1e3, 2), "bf16_GBs": round(n * k * 2 / base / 1e6),
                       "bf16_warm_us": round(warm * 1e3, 2)}
                if read_ceiling and m == 1:
                    row["bf16_read_us"] = round(read_ms(n * k * 2)[0] * 1e3, 2)
                    for name, (_, _, nbytes) in packed.items():
                        ms, config = read_ms(nbytes)
                        row.update({f"{name}_read_us": round(ms * 1e3, 2), f"{name}_read_config": config,
                                    f"{name}_bound_x": round(base / ms, 3)})
            for name, (group, ts, nbytes) in packed.items():
                t = ts[0]
                ref = torch.nn.functional.linear(x.float(), lowbit.dequantize(t, name, group, torch.float32))
                got = lowbit.matmul(x, t, name, group, None).float()
                row[f"{name}_rel_error"] = float((got - ref).norm() / ref.norm())
                tuned = lowbit_tuning.TUNED_GEMV if m == 1 else lowbit_tuning.TUNED_PREFILL if prefill else lowbit_tuning.TUNED
                config = tuned[name].lookup(x.device, x.dtype, *((n, k, group) if m == 1 else (m, n, k, group)))
                row[f"{name}_config"] = config
                if prefill:
                    ms = eager_ms(lambda: lowbit.matmul(x, t, name, group, None))
                    row[f"{name}_us"] = round(ms * 1e3, 2)
                    row[f"{name}_x"] = round(base / ms, 3)
                    continue
                row[f"{name}_kernel"] = None if config is None else config.get("KERNEL")
                ms = cold_ms([lambda t=t: lowbit.matmul(x, t, name, group, None) for t in ts])
                row[f"{name}_us"] = round(ms * 1e3, 2)
                row[f"{name}_GBs"] = round(nbytes / ms / 1e6)
                row[f"{name}_x"] = round(base / ms, 3)
                warm_ms = graph_ms(lambda: lowbit.matmul(x, t, name, group, None))
                row[f"{name}_warm_us"] = round(warm_ms * 1e3, 2)
                row[f"{name}_warm_x"] = round(warm / warm_ms, 3)
            out.append(row)
            print(json.dumps(row), flush=True)
        del packed, w, ws
        torch.cuda.empty_cache()
    return out


def table(rows: list[dict]) -> str:
    head = f"{'shape':>14}{'rows':>5}{'bf16 us':>9}" + "".join(f"{f + ' us (x)':>18}" for f in FORMATS)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f"{r[f + '_us']:>9.1f} ({r[f + '_x']:.2f})" for f in FORMATS)
        lines.append(f"{r['n']:>7}x{r['k']:<6}{r['m']:>5}{r['bf16_us']:>9.1f}{cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--shapes", default=None, help="comma-separated NxK, e.g. 4096x4096,1024x4096")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--prefill-rows", type=int, default=2048, help="0: no prefill row")
    parser.add_argument("--read-ceiling", action="store_true",
                        help="time a read-only kernel over each one-row line's stored bytes (the line's bound)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_lowbit_kernels.py times the CUDA kernels: it needs a CUDA GPU")
    if args.shapes:
        SHAPES[:] = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    FORMATS[:] = args.formats
    rows = run(args.rows, args.prefill_rows, args.read_ceiling)
    print(table(rows))
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "timing": "cold: CUDA graph of one call per "
                f"weight copy (>= {_COLD_BYTES >> 20} MB of copies); warm: CUDA graph of {_CALLS} calls on one weight; "
                "prefill: eager; triton do_bench median"}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
