"""``torchport verify``: :func:`torchport.verify.compare` on a factory's model, with a table, JSON and a plot."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from .output import add_json_arguments, check_output, json_outputs, write_json

__all__ = ["DTYPES", "HELP", "add_arguments", "cast", "check_device", "check_output", "handle", "load_factory",
           "read_input", "usage_error"]

HELP = "compare every module's output on a device against a float64 CPU reference; exit 1 where it diverges"

DTYPES = ("float32", "bfloat16", "float16", "float64")
_SHAPE = re.compile(r"^[1-9]\d*(x[1-9]\d*)*$")

_DESCRIPTION = """\
Run the model of TARGET on --device and on --reference (the CPU in float64 by default), with the same weights and
seed, in eval mode, and compare the output of every module call in execution order. Prints one row per call and
exits 1 at the first divergence (the table shows where), 0 when every row is within tolerance, 2 on a usage error.

TARGET is package.module:function or path/to/file.py:function; the function returns (model, inputs). Inputs are
passed as the model's one argument (a tensor), as positional arguments (a tuple or list) or as keyword arguments
(a dict).

--input replaces the factory's inputs:
  SHAPE  like 2x3x224: one float32 tensor of that shape drawn from a normal distribution (seed 0);
  FILE   a .pt/.pth file read with torch.load(weights_only=True) holding a tensor, a tuple/list (positional
         arguments) or a dict (keyword arguments); or a .safetensors file whose tensors are keyword arguments by
         name, or positional arguments when the names are 0, 1, 2...
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("target", metavar="TARGET", help="package.module:factory or path/to/file.py:factory")
    parser.add_argument("--device", metavar="D", help="the device to verify, e.g. 'npu', 'cuda:1' (default: the "
                                                      "detected one)")
    parser.add_argument("--input", metavar="SHAPE|FILE", help="inputs to use instead of the factory's (see above)")
    parser.add_argument("--reference", metavar="D", default="cpu", help="the reference device (default: cpu)")
    parser.add_argument("--reference-dtype", choices=DTYPES, default="float64",
                        help="the reference's dtype (default: float64)")
    parser.add_argument("--dtype", choices=DTYPES, help="cast the model and its floating-point inputs to this dtype "
                                                        "first (default: as the factory made them)")
    parser.add_argument("--rtol", type=float, help="relative tolerance (default: per dtype, see "
                                                   "torchport.verify.TOLERANCES)")
    parser.add_argument("--atol", type=float, help="absolute tolerance (default: per dtype)")
    parser.add_argument("--backward", action="store_true", help="also compare every parameter's gradient")
    add_json_arguments(parser, "the report", old_file_option=True)
    parser.add_argument("--plot", metavar="OUT.png", help="write the relative error by layer as a PNG (matplotlib)")


def usage_error(message: str) -> argparse.ArgumentError:
    """The error :func:`torchport.cli.main.main` prints as one line and exits 2 for."""
    return argparse.ArgumentError(None, message)


def load_factory(target: str) -> Callable[..., Any]:
    """The factory a TARGET names, or a usage error."""
    from ..verify.target import TargetError, load_target

    try:
        return load_target(target)
    except TargetError as exc:
        raise usage_error(str(exc)) from exc


def check_device(spec: str | None, option: str) -> None:
    """A usage error when ``spec`` is not a device present on this machine."""
    from ..device import resolve

    try:
        resolve(spec, source=option)
    except (ValueError, RuntimeError) as exc:
        raise usage_error(str(exc)) from exc


def read_input(spec: str) -> Any:
    """``--input``: a file's tensors (``.pt``, ``.pth``, ``.safetensors``) or a random tensor of a shape ``AxBxC``.

    Example:
        >>> read_input("2x3").shape
        torch.Size([2, 3])
    """
    import torch

    if os.path.isfile(spec):
        extension = os.path.splitext(spec)[1].lower()
        if extension in (".pt", ".pth"):
            try:
                value = torch.load(spec, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise usage_error(f"--input {spec!r} could not be read by torch.load(weights_only=True): "
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
            if not isinstance(value, (torch.Tensor, tuple, list, dict)):
                raise usage_error(f"--input {spec!r} holds a {type(value).__name__}; it must hold a tensor, a "
                                  "tuple or list of arguments, or a dict of keyword arguments")
            return value
        if extension == ".safetensors":
            from ..weights import load_safetensors

            try:
                tensors = load_safetensors(spec, device="cpu")
            except (ValueError, OSError) as exc:
                raise usage_error(f"--input {spec!r}: {exc}") from exc
            if tensors and sorted(tensors) == [str(i) for i in range(len(tensors))]:
                return tuple(tensors[str(i)] for i in range(len(tensors)))
            return tensors
        raise usage_error(f"--input {spec!r} is a {extension or 'extensionless'} file; give a .pt, .pth or "
                          ".safetensors file, or a shape like 2x3x224")
    if _SHAPE.match(spec):
        shape = [int(n) for n in spec.split("x")]
        return torch.randn(shape, generator=torch.Generator().manual_seed(0))
    raise usage_error(f"--input {spec!r} is neither an existing file nor a shape like 2x3x224")


def cast(model: Any, inputs: Any, dtype_name: str | None) -> tuple[Any, Any]:
    """The model and inputs, floating-point parts cast to ``dtype_name`` (unchanged when None)."""
    if dtype_name is None:
        return model, inputs
    import torch

    from ..verify.structure import map_tensors

    dtype = getattr(torch, dtype_name)
    return model.to(dtype), map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, inputs)


def build_target(factory: Callable[..., Any], target: str, input_spec: str | None,
                 dtype_name: str | None) -> tuple[Any, Any]:
    """The factory's model and inputs (or ``--input``'s), cast to ``--dtype``; a bad return is a usage error."""
    from ..verify import TargetError, unpack

    override = read_input(input_spec) if input_spec is not None else None
    try:
        model, inputs = unpack(factory(), f"TARGET {target}")
    except TargetError as exc:
        raise usage_error(str(exc)) from exc
    return cast(model, override if override is not None else inputs, dtype_name)


def handle(args: argparse.Namespace) -> int:
    """Load the target, compare, print the table; 0 when it matches, 1 when it diverges or fails to run."""
    import torch

    from ..verify import ModelError, StructureError, compare

    to_stdout, json_path = json_outputs(args)
    check_output(args.plot, "--plot")
    factory = load_factory(args.target)
    check_device(args.device, "--device")
    check_device(args.reference, "--reference")
    model, inputs = build_target(factory, args.target, args.input, args.dtype)
    try:
        report = compare(model, inputs, device=args.device, reference=args.reference,
                         reference_dtype=getattr(torch, args.reference_dtype), rtol=args.rtol, atol=args.atol,
                         backward=args.backward)
    except (ModelError, StructureError) as exc:
        print(f"{args.command_prog}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a tolerance or dtype compare cannot work with
        raise usage_error(str(exc)) from exc
    if not to_stdout:
        report.print()
    if to_stdout or json_path:
        write_json(report.to_json(), to_stdout, json_path)
    if args.plot:
        report.plot(args.plot)
    return 0 if report.ok else 1
