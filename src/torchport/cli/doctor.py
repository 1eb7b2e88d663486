"""``torchport doctor``: run :func:`torchport.doctor.run_checks` and show the results as a table or as JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from .. import info
from ..doctor import Check, run_checks
from .output import add_json_arguments, json_outputs, write_json

__all__ = ["HELP", "add_arguments", "exit_code", "handle", "render_json", "render_table"]

HELP = "check torch, every device (dtypes, numerics against the CPU, memory) and optional packages"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_arguments(parser, "the results")
    parser.add_argument("--device", metavar="D", help="check only this device, e.g. 'npu:1' or 'cpu'")


def exit_code(checks: Sequence[Check]) -> int:
    """0 when every check passed, 1 when any failed; a skipped check (SKIP) does not fail.

    Example:
        >>> exit_code(run_checks("cpu"))
        0
    """
    return 0 if all(check.ok for check in checks) else 1


def handle(args: argparse.Namespace) -> int:
    """Run the checks, print them, and return :func:`exit_code`."""
    to_stdout, json_path = json_outputs(args)
    try:
        checks = run_checks(args.device)
    except (ValueError, RuntimeError) as exc:
        if args.device is None:
            raise  # with no --device, run_checks raises only on a bug, which should show its traceback
        raise argparse.ArgumentError(None, str(exc)) from exc
    if to_stdout or json_path:
        write_json(render_json(checks), to_stdout, json_path)
    if not to_stdout:
        from rich.console import Console

        render_table(checks, Console())
    return exit_code(checks)


def render_json(checks: Sequence[Check]) -> str:
    """The results and :func:`torchport.info` (without probes) as one JSON document.

    Example:
        >>> json.loads(render_json(run_checks("cpu")))["ok"]
        True
    """
    try:
        machine: dict[str, Any] = info(probe=False)
    except Exception as exc:  # e.g. TORCHPORT_DEVICE names an absent device; the settings check already says so
        machine = {"error": f"{type(exc).__name__}: {exc}"}
    document = {"ok": exit_code(checks) == 0, "checks": [check.to_dict() for check in checks], "info": machine}
    return json.dumps(document, indent=2, default=str)


_STYLES = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow"}


def render_table(checks: Sequence[Check], console: Any) -> None:
    """Print one row per check (check, device, PASS/FAIL/SKIP, detail) and a summary line on a rich Console.

    SKIP marks a check with nothing to check (an optional package that is not installed); it is not a failure.

    Example:
        >>> render_table(run_checks("cpu"), rich.console.Console())
    """
    from rich.table import Table
    from rich.text import Text

    table = Table(title="torchport doctor")
    table.add_column("check", no_wrap=True)
    table.add_column("device", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for check in checks:
        status = Text(check.status, style=_STYLES[check.status])
        # Text(), not a markup string: a detail such as "[1, 2]" must print as written
        table.add_row(Text(check.name), Text(check.device or "-"), status, Text(check.detail))
    console.print(table)
    failed = [check for check in checks if not check.ok]
    skipped = [check.name for check in checks if check.skipped]
    skips = f"; {len(skipped)} skipped, not installed: {', '.join(skipped)}" if skipped else ""
    if failed:
        names = ", ".join(f"{check.name} ({check.device})" if check.device else check.name for check in failed)
        console.print(Text(f"{len(failed)} of {len(checks)} checks failed: {names}{skips}", style="bold red"))
    else:
        console.print(Text(f"all {len(checks) - len(skipped)} checks passed{skips}", style="green"))
