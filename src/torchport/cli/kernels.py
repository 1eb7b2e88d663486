"""``torchport kernels``: which implementation each kernel uses on each device of this machine, and why others are
not used, from :func:`torchport.kernels.table`."""

from __future__ import annotations

import argparse
import json

from .output import add_json_arguments, json_outputs, write_json

__all__ = ["HELP", "add_arguments", "handle"]

HELP = "show the fused kernels: op x device x chosen implementation (TORCHPORT_KERNELS forces a choice)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", action="append", metavar="D",
                        help="a device to show, e.g. 'npu' or 'cuda:1' (repeatable; default: cpu and every "
                             "accelerator present)")
    add_json_arguments(parser, "the rows")


def handle(args: argparse.Namespace) -> int:
    """Print the table; an unknown device or an invalid TORCHPORT_KERNELS is a usage error (exit 2)."""
    from ..device import resolve
    from ..kernels import table

    to_stdout, json_path = json_outputs(args)
    try:
        devices = None
        if args.device:
            devices = [backend.device(index) for backend, index in (resolve(spec, "--device") for spec in args.device)]
        rows = table(devices)
    except (ValueError, RuntimeError) as exc:
        raise argparse.ArgumentError(None, str(exc)) from exc
    if to_stdout or json_path:
        write_json(json.dumps(rows, indent=2), to_stdout, json_path)
    if to_stdout:
        return 0
    from rich.console import Console
    from rich.table import Table

    view = Table(title="torchport kernels")
    for column in ("op", "device", "implementation", "candidates", "why not faster"):
        view.add_column(column)
    for row in rows:
        view.add_row(row["op"], row["device"], row["implementation"], ", ".join(row["candidates"]),
                     "; ".join(row["notes"]))
    Console().print(view)
    return 0
