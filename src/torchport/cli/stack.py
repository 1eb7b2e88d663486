"""``torchport stack``: the memory tiers of this machine (device, host RAM, disk) with sizes and measured
bandwidths, from :func:`torchport.offload.measure_stack`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .output import add_json_arguments, json_outputs, write_json

__all__ = ["HELP", "add_arguments", "handle", "render_table"]

HELP = "show the memory tiers (device, host RAM, disk) with sizes and measured copy and read bandwidths"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", metavar="D", help="the device to measure, e.g. 'cuda:0' (default: detected)")
    parser.add_argument("--disk-dir", metavar="DIR", help="folder on the disk to measure (default: a temporary one)")
    parser.add_argument("--size", default="256MiB", metavar="BYTES",
                        help="bytes moved per measurement, e.g. '256MiB' (default), '1GiB'")
    parser.add_argument("--iterations", type=int, default=3, metavar="N", help="timed repetitions (default 3)")
    add_json_arguments(parser, "the results")


def handle(args: argparse.Namespace) -> int:
    """Measure and print; a bad argument is a usage error (exit 2)."""
    from ..offload import measure_stack, parse_budget

    to_stdout, json_path = json_outputs(args)
    try:
        size = parse_budget(args.size, None, name="--size")
        stack = measure_stack(args.device, args.disk_dir, size=size, iterations=args.iterations)
    except ValueError as exc:
        raise argparse.ArgumentError(None, str(exc)) from exc
    if to_stdout or json_path:
        write_json(json.dumps(stack, indent=2), to_stdout, json_path)
    if not to_stdout:
        from rich.console import Console

        render_table(stack, Console())
    return 0


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.1f} GB/s"


def render_table(stack: dict[str, Any], console: Any) -> None:
    """One row per tier (size, free) and one per measured bandwidth, then the notes.

    Example:
        >>> render_table(measure_stack("cpu"), rich.console.Console())
    """
    from rich.table import Table

    from ..offload import format_bytes

    dev, host, disk, bw = stack["device"], stack["host"], stack["disk"], stack["bandwidth"]
    table = Table(title=f"torchport stack (measured with {format_bytes(stack['size'])}, median of "
                        f"{stack['iterations']})")
    table.add_column("tier", no_wrap=True)
    table.add_column("what", overflow="fold")
    table.add_column("total", justify="right")
    table.add_column("free", justify="right")
    table.add_column("bandwidth to the device", overflow="fold")
    table.add_row("device", f"{dev['device']} {dev['name']}", format_bytes(dev["total"]), format_bytes(dev["free"]),
                  "-")
    table.add_row("host RAM", "pinned / pageable", format_bytes(host["total"]), format_bytes(host["available"]),
                  f"{_gbps(bw['pinned_h2d'])} / {_gbps(bw['pageable_h2d'])}")
    table.add_row("disk", disk["path"], format_bytes(disk["total"]), format_bytes(disk["free"]),
                  f"read {_gbps(bw['disk_read'])} (mmap to host, page cache dropped)")
    console.print(table)
    for note in stack["notes"]:
        console.print(f"note: {note}")
