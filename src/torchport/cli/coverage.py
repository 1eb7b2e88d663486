"""``torchport coverage``: :func:`torchport.compile.coverage` on a factory's model, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys

from .output import add_json_arguments, json_outputs, write_json
from .verify import DTYPES, build_target, load_factory, usage_error

__all__ = ["HELP", "add_arguments", "handle"]

HELP = ("list the aten operators a model runs, forward and backward, and whether a device has each; on an Ascend "
        "chip (--soc), what runs natively, what falls back and which dtypes work; exit 1 if any is missing")

_DESCRIPTION = """\
Build the model of TARGET, run it forward and backward (the loss is the sum of its floating-point outputs) where the
factory put it, and mark every aten operator it ran for --device: native, torchport kernel, cpu fallback (run on the
CPU by torchport.compat.cpu_fallback or by the device's own library) or missing. The device need not be present:
where its library is not installed, torchport's shipped operator list for it answers (for Ascend NPUs, torch_npu's).

Exits 0 when no operator is missing, 1 when some is, 2 on a usage error.

TARGET is package.module:function or path/to/file.py:function; the function returns (model, inputs), as for
torchport verify. --input SHAPE|FILE replaces the inputs (see torchport verify --help).

On an Ascend NPU the chip decides the rest: --soc names one (Ascend310P3, Ascend910B3, Ascend910A...; any chip
torchport knows, on any machine), else the chip of the NPU present (real, or simulated by TORCHPORT_SIMULATE=npu:<soc>)
is used. The report then adds, for each torchport kernel and fused attention, the torch_npu operator it calls,
whether that chip runs it (or the reference does), the dtypes it takes there and the documented limits that send a
call to the reference; the chip's dtypes (no bfloat16 on 910A and 310P: an operator computing in it counts as
missing); and what happens to aten operators torch_npu lacks (run on the host). Without TARGET, only that chip
report is printed, and the exit code is 0.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("target", metavar="TARGET", nargs="?",
                        help="package.module:factory or path/to/file.py:factory (optional with --device npu: the "
                             "chip report alone)")
    parser.add_argument("--device", metavar="D", required=True, help="the device type to check, e.g. 'npu' or 'cuda'")
    parser.add_argument("--soc", metavar="CHIP",
                        help="with --device npu: the Ascend chip to plan for, as torch_npu names it (Ascend310P3); "
                             "default: the NPU present, real or simulated")
    parser.add_argument("--input", metavar="SHAPE|FILE", help="inputs to use instead of the factory's")
    parser.add_argument("--dtype", choices=DTYPES, help="cast the model and its floating-point inputs to this dtype "
                                                        "first (default: as the factory made them)")
    parser.add_argument("--no-backward", dest="backward", action="store_false",
                        help="record the forward only (inference)")
    add_json_arguments(parser, "the report")


def handle(args: argparse.Namespace) -> int:
    """Load the target, record, print; 0 when nothing is missing, 1 when something is or the model fails to run.
    Without a target, print the chip report of ``--soc`` (or of the NPU present) and return 0."""
    from ..compile.op_coverage import coverage

    to_stdout, json_path = json_outputs(args)
    if args.target is None:
        return _chip_only(args, to_stdout, json_path)
    model, inputs = build_target(load_factory(args.target), args.target, args.input, args.dtype)
    try:
        report = coverage(model, inputs, args.device, backward=args.backward, soc=args.soc)
    except ValueError as exc:  # not a device type or chip, or no way to tell what it runs
        raise usage_error(str(exc)) from exc
    except NotImplementedError as exc:  # an operator neither the device nor the CPU has, met running on the device
        print(f"{args.command_prog}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    if to_stdout or json_path:
        write_json(json.dumps(report.to_dict(), indent=2), to_stdout, json_path)
    if not to_stdout:
        report.print()
    return 1 if report.missing else 0


def _chip_only(args: argparse.Namespace, to_stdout: bool, json_path: str | None) -> int:
    from ..compile.chip_coverage import chip_report

    try:
        report = chip_report(args.device, args.soc)
    except ValueError as exc:
        raise usage_error(str(exc)) from exc
    if to_stdout or json_path:
        write_json(json.dumps({"device": "npu", "chip": report.to_dict()}, indent=2), to_stdout, json_path)
    if not to_stdout:
        report.print()
    return 0
