"""``torchport export``: a factory's model to ONNX, checked in onnxruntime against PyTorch, and the ATC script."""

from __future__ import annotations

import argparse
import json

from .bench import parse_batch_sizes
from .output import add_json_arguments, check_output, json_outputs, stdout_to_stderr, write_json
from .verify import check_device, load_factory, usage_error

__all__ = ["HELP", "add_arguments", "handle"]

HELP = "export a model to ONNX, check it in onnxruntime against PyTorch, and write the Ascend ATC command"

_DESCRIPTION = """\
Export the model of TARGET (package.module:function or path/to/file.py:function returning (model, inputs)) to
the ONNX file --onnx, from the CPU in eval mode, then check the file with onnx.checker and run it in onnxruntime
on the same inputs (and, with --dynamic-batch, at one more batch size), printing the largest absolute error and
the relative error against PyTorch. Exit 1 when onnxruntime differs beyond tolerance, 2 on a usage error or when
the model cannot be exported (the message names the operator and the exporter).

Opsets 11-17 are written by torch's TorchScript-based exporter, 18 and newer by its torch.export-based one.
--atc (opsets up to 18, which ATC reads; 15 by default, which older CANN releases read too) also writes NAME_atc.sh beside the file: the atc command that compiles it into
an Ascend offline model NAME.om, and runs it when atc is on PATH.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..export.atc import PRECISION_MODES, SOC_EXAMPLES

    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("target", metavar="TARGET", help="package.module:factory or path/to/file.py:factory")
    parser.add_argument("--onnx", metavar="OUT.onnx", required=True, help="the ONNX file to write")
    parser.add_argument("--opset", type=int, help="ONNX opset (default: 15 with --atc, else 18; ATC reads 9 to 18)")
    parser.add_argument("--dynamic-batch", action="store_true", help="make dim 0 of the batch inputs and outputs "
                                                                     "dynamic")
    parser.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32", help="precision of the graph's weights "
                                                                                  "and inputs (default: fp32)")
    parser.add_argument("--input-names", metavar="A,B", help="graph input names (default: the dict keys or the "
                                                             "forward's argument names)")
    parser.add_argument("--output-names", metavar="Y,Z", help="graph output names (default: from the output)")
    parser.add_argument("--device", metavar="D", help="where onnxruntime runs the check (default: cpu); with --atc "
                                                      "and no --soc-version, the NPU whose chip to compile for "
                                                      "(default: the detected device)")
    parser.add_argument("--rtol", type=float, help="relative tolerance (default: per dtype, see "
                                                   "torchport.export.TOLERANCES)")
    parser.add_argument("--atol", type=float, help="absolute tolerance (default: per dtype)")
    parser.add_argument("--atc", action="store_true", help="write (and run, when atc is on PATH) the ATC command")
    parser.add_argument("--soc-version", metavar="CHIP", help=f"ATC --soc_version, e.g. {', '.join(SOC_EXAMPLES)} "
                                                              "(default: the NPU's chip)")
    parser.add_argument("--batch-sizes", metavar="B,B,...", help="batch sizes ATC compiles a dynamic batch for "
                                                                 "(default: 1,2,4,8)")
    parser.add_argument("--precision-mode", choices=PRECISION_MODES, metavar="MODE",
                        help=f"ATC --precision_mode: {', '.join(PRECISION_MODES)} (default: ATC's)")
    add_json_arguments(parser, "the report", old_file_option=True)


def _names(text: str | None, option: str) -> list[str] | None:
    if text is None:
        return None
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise usage_error(f"{option} {text!r} has an empty name; give names separated by commas")
    return names


def handle(args: argparse.Namespace) -> int:
    """Export, check, print the report; with --atc write the script and run or explain it. 0 when within
    tolerance, 1 when not."""
    from ..export import ExportError, atc, onnx
    from ..verify.target import TargetError, unpack

    atc_options = {}
    opset = args.opset if args.opset is not None else 15 if args.atc else 18
    sizes = parse_batch_sizes(args.batch_sizes)
    if not args.atc and (args.soc_version or sizes or args.precision_mode):
        raise usage_error("--soc-version, --batch-sizes and --precision-mode are ATC options; add --atc")
    try:
        if args.atc:
            atc.check_opset(opset)
            if sizes is not None and not args.dynamic_batch:
                raise ValueError("--batch-sizes needs --dynamic-batch: ATC compiles several batch sizes only for a "
                                 "model whose batch is dynamic")
            atc_options = {"soc_version": atc.soc_version(args.soc_version, args.device),
                           "batch_sizes": sizes, "precision_mode": args.precision_mode}
    except (ValueError, RuntimeError) as exc:
        raise usage_error(f"--atc: {exc}") from exc
    check_output(args.onnx, "--onnx")
    to_stdout, json_path = json_outputs(args)
    check_device(args.device, "--device")
    factory = load_factory(args.target)
    try:
        model, inputs = unpack(factory(), f"TARGET {args.target}")
        report = onnx(model, inputs, args.onnx, opset=opset, dynamic_batch=args.dynamic_batch, dtype=args.dtype,
                      input_names=_names(args.input_names, "--input-names"),
                      output_names=_names(args.output_names, "--output-names"),
                      device=args.device or "cpu", rtol=args.rtol, atol=args.atol)
    except (TargetError, ExportError, ImportError, ValueError, TypeError) as exc:
        raise usage_error(str(exc)) from exc
    if not to_stdout:
        report.print()
    if to_stdout or json_path:
        write_json(json.dumps(report.to_dict(), indent=2), to_stdout, json_path)
    code = 0 if report.ok else 1
    if args.atc:
        try:
            script = atc.write_atc_script(args.onnx, **atc_options)
        except ValueError as exc:
            raise usage_error(f"--atc: {exc}") from exc
        with stdout_to_stderr(to_stdout):  # with --json, stdout holds only the JSON
            code = _atc(args, script, code)
    return code


def _atc(args: argparse.Namespace, script: object, code: int) -> int:
    """Run the ATC script where atc is installed, or say how to; the exit code, 1 when atc failed."""
    from ..export import atc

    print(f"ATC command written to {script}")
    returned = atc.run_atc(script)
    if returned is None:
        print(f"atc is not on PATH here. On the Ascend machine, copy {args.onnx} and {script} together, then:\n"
              f"  source /usr/local/Ascend/ascend-toolkit/set_env.sh\n  sh {script}")
    elif returned != 0:
        print(f"atc failed (exit {returned}); its messages are above")
        return 1
    return code
