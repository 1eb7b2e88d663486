"""``torchport bench``: latency, throughput and peak memory of a factory's model over batch sizes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .output import add_json_arguments, check_output, json_outputs, write_json
from .verify import DTYPES, check_device, load_factory, usage_error

__all__ = ["HELP", "add_arguments", "handle", "parse_batch_sizes"]

HELP = "time a model on a device over batch sizes: median/p20/p80 ms, items/s, peak memory"

_DESCRIPTION = """\
Time model(inputs) in eval mode without gradients on --device, at each batch size: --warmup untimed calls, then
--iters timed ones (device events, or the host clock synchronised with the device). Prints median, p20 and p80
milliseconds, throughput (samples per second at the median) and the peak of device memory held by tensors (n/a on
the CPU, which keeps no such count). Exit 1 when a batch size fails (out of memory or an error; the table shows
which), 2 on a usage error.

TARGET is package.module:function or path/to/file.py:function; the function returns (model, inputs).
How a batch size is applied:
  - if the function takes a batch_size keyword, it is called once per batch size: function(batch_size=B);
  - otherwise it is called once and its inputs are tiled along dim 0: every tensor whose first dimension equals
    that of the first tensor in the inputs is repeated and cut to B rows; other values are passed unchanged.
Without --batch-sizes, the function's own inputs are measured as they are.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("target", metavar="TARGET", help="package.module:factory or path/to/file.py:factory")
    parser.add_argument("--device", metavar="D", help="the device to time, e.g. 'npu', 'cuda:1' (default: the "
                                                      "detected one)")
    parser.add_argument("--batch-sizes", metavar="B,B,...", help="comma-separated batch sizes, e.g. 1,4,8")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per batch size (default: 3)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per batch size (default: 20)")
    parser.add_argument("--dtype", choices=DTYPES, help="cast the model and its floating-point inputs to this dtype "
                                                        "(default: as the factory made them)")
    add_json_arguments(parser, "the results", old_file_option=True)
    parser.add_argument("--plot", metavar="OUT.png", help="write throughput and memory against batch size as a PNG "
                                                          "(matplotlib)")
    parser.add_argument("--onnx", action="store_true", help="also export the model to ONNX (dynamic batch) and time "
                                                            "it in onnxruntime on the device's execution provider "
                                                            "(default batch sizes then: 1,4,8)")
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset for --onnx (default: 18)")


def parse_batch_sizes(text: str | None) -> list[int] | None:
    """``"1,4,8"`` -> ``[1, 4, 8]``; a usage error for anything but positive integers.

    Example:
        >>> parse_batch_sizes("1, 4,8")
        [1, 4, 8]
    """
    if text is None:
        return None
    parts = [part.strip() for part in text.split(",")]
    if not parts or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise usage_error(f"--batch-sizes {text!r} is not a list of batch sizes; give positive integers separated "
                          "by commas, e.g. 1,4,8")
    return [int(part) for part in parts]


def handle(args: argparse.Namespace) -> int:
    """Load the target, sweep the batch sizes, print the table; 0 when every batch size ran, else 1."""
    import torch

    from ..bench import sweep
    from ..verify import TargetError

    sizes = parse_batch_sizes(args.batch_sizes)
    if args.onnx and sizes is None:
        sizes = [1, 4, 8]
    for name in ("warmup", "iters"):
        value, least = getattr(args, name), 0 if name == "warmup" else 1
        if value < least:
            raise usage_error(f"--{name} {value} is not allowed; give an integer >= {least}")
    to_stdout, json_path = json_outputs(args)
    check_output(args.plot, "--plot")
    factory = load_factory(args.target)
    check_device(args.device, "--device")
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    try:
        result = sweep(factory, sizes, device=args.device, dtype=dtype, warmup=args.warmup, iters=args.iters,
                       progress=True, source=f"TARGET {args.target}")
    except TargetError as exc:
        raise usage_error(str(exc)) from exc
    if not to_stdout:
        result.print()
    exported = _onnx_sweep(args, factory, sizes, quiet=to_stdout) if args.onnx else None
    if to_stdout or json_path:
        data = result.to_dict() if exported is None else {"ok": result.ok and exported.ok, "eager": result.to_dict(),
                                                          "onnxruntime": exported.to_dict()}
        write_json(json.dumps(data, indent=2), to_stdout, json_path)
    if args.plot:
        result.plot(args.plot) if exported is None else result.plot(args.plot, compare=exported)
    return 0 if result.ok and (exported is None or exported.ok) else 1


def _onnx_sweep(args: argparse.Namespace, factory: Any, sizes: list[int] | None, quiet: bool) -> Any:
    """Time the exported model in onnxruntime at the same batch sizes and print its table (quiet: on stdout
    nothing, the note about differences on stderr)."""
    from ..export import ExportError, sweep_onnx
    from ..verify import TargetError

    dtype = {"float32": "fp32", "float16": "fp16", None: "fp32"}.get(args.dtype)
    if dtype is None:
        raise usage_error(f"--onnx times fp32 or fp16 graphs; --dtype {args.dtype} has no ONNX export here")
    try:
        exported, report = sweep_onnx(factory, sizes, device=args.device, opset=args.opset, dtype=dtype,
                                      warmup=args.warmup, iters=args.iters, source=f"TARGET {args.target}")
    except (TargetError, ExportError, ImportError, ValueError) as exc:
        raise usage_error(f"--onnx: {exc}") from exc
    if not quiet:
        exported.print()
    if not report.ok:
        print(f"note: the exported model differs from PyTorch (relative error {report.rel_error:.3g}, rtol "
              f"{report.rtol:g})", file=sys.stderr if quiet else sys.stdout)
    return exported

