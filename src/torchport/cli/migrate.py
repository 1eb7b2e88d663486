"""``torchport migrate``: rewrite CUDA-specific source with :mod:`torchport.migrate` and report what changed.

The migrate package (and libcst) is imported in :func:`handle` only, so other commands do not pay for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["HELP", "add_arguments", "handle"]

HELP = "rewrite CUDA-specific source into device-agnostic PyTorch (prints a diff; --write to apply)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="Python files, or directories walked for .py files")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--diff", dest="mode", action="store_const", const="diff",
                      help="print a unified diff on stdout and write nothing (the default)")
    mode.add_argument("--write", dest="mode", action="store_const", const="write",
                      help="rewrite in place the files that change")
    mode.add_argument("--check", dest="mode", action="store_const", const="check",
                      help="write nothing; exit 1 when a file would change or could not be read (for CI)")
    parser.set_defaults(mode="diff")
    parser.add_argument("--report", metavar="FILE.json", help="also write the report as JSON to this file")
    parser.add_argument("--exclude", metavar="GLOB", action="append", default=[],
                        help="skip paths (relative to a named directory) or path parts matching this glob; repeatable")


def handle(args: argparse.Namespace) -> int:
    """Migrate, print the diff (stdout) and the report table (stderr), write files and JSON as asked.

    Exit code: 0; with ``--check``, 1 when a file would change or was skipped; 2 on a bad argument.
    """
    from rich.console import Console

    from ..migrate import migrate_paths
    from ..migrate.report import render_diff, render_json, render_table

    missing = [path for path in args.paths if not Path(path).exists()]
    if missing:
        raise argparse.ArgumentError(None, f"no such file or directory: {', '.join(missing)}")
    if args.report and not Path(args.report).resolve().parent.is_dir():
        raise argparse.ArgumentError(None, f"--report {args.report}: its directory does not exist")
    results = migrate_paths(args.paths, excludes=args.exclude, write=args.mode == "write")
    if args.mode == "diff":
        sys.stdout.write(render_diff(results))
        sys.stdout.flush()
    render_table(results, Console(stderr=True), mode=args.mode)
    if args.report:
        Path(args.report).write_text(render_json(results) + "\n", encoding="utf-8")
    if args.mode == "check" and any(result.changed or result.skipped for result in results):
        return 1
    return 0
