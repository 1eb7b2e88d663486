"""Host time per call of a quantised layer at prefill sizes, against the launches it is made of.

A quantised model's prefill is host-bound where a layer's Python path costs more than its kernels run. For each
layer shape this times, with no gradient (``torch.no_grad``), the time to enqueue one call (median over
``--repeats`` rounds of the mean over ``--calls`` calls; the device is synchronised between rounds only): PyTorch's
``F.linear`` on the dense weight, the format's dequantise (on CUDA the Triton kernel) followed by ``F.linear``
(the two launches of the dense route), and ``QuantizedLinear``'s forward. The last two rows should be close when
the layer's call path adds little to its launches. All rows come from one process, so they compare with each
other; absolute figures depend on the host and its load. Writes JSON with ``--json``.

    PYTHONPATH=src python benchmarks/lowbit_host.py                       # CUDA, int4, 2048 rows, the 8B shapes
    PYTHONPATH=src python benchmarks/lowbit_host.py --device cpu --rows 64 --shapes 256x512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import torchport
from torchport.quant import quantize
from torchport.quant.formats import FORMATS


def enqueue_us(fn: Callable[[], object], device: torch.device, calls: int, repeats: int) -> float:
    """Median over ``repeats`` rounds of the mean host time of one of ``calls`` back-to-back calls, in µs."""
    for _ in range(5):
        fn()
    torchport.synchronize(device)
    rounds = []
    for _ in range(repeats):
        torchport.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    torchport.synchronize(device)
    return statistics.median(rounds)


def _shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layer shape is OUTxIN, such as 14336x4096; not {text!r}") from None
    return n, k


def measure(args: argparse.Namespace) -> list[dict[str, object]]:
    device = torch.device(args.device) if args.device else torchport.device()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for n, k in args.shapes:
            x = torch.randn(args.rows, k, device=device, dtype=dtype)
            holder = nn.Sequential(nn.Linear(k, n, bias=False, device=device, dtype=dtype))
            dense = holder[0].weight.detach().clone()
            quantize(holder, args.format)
            layer = holder[0]
            tensors, group = layer.tensors(), layer.group_size
            if device.type == "cuda":
                from torchport.kernels.triton import lowbit

                def dequantize() -> torch.Tensor:
                    return lowbit.dequantize(tensors, args.format, group, dtype)
            else:
                decoder = layer.format_spec.dequantize

                def dequantize() -> torch.Tensor:
                    return decoder(tensors, dtype)
            cases = {
                "F.linear, dense weight": lambda: F.linear(x, dense),
                "dequantise + F.linear": lambda: F.linear(x, dequantize()),
                "QuantizedLinear": lambda: layer(x),
            }
            for name, fn in cases.items():
                us = enqueue_us(fn, device, args.calls, args.repeats)
                rows.append({"shape": f"{n}x{k}", "rows": args.rows, "format": args.format, "case": name,
                             "host_us": round(us, 1)})
                print(f"{n:>6}x{k:<6} {name:26s} {us:8.1f} us", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="device (default: torchport.device())")
    parser.add_argument("--format", default="int4", choices=sorted(FORMATS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--shapes", type=_shape, nargs="+", default=[(4096, 4096), (14336, 4096), (4096, 14336)],
                        help="layer shapes OUTxIN (default: three of the 8B model's)")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = measure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device or str(torchport.device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
