"""What ``--json`` means, the same in every command: ``--json`` prints the command's result as JSON on stdout and
nothing else there (tables and messages are left out or go to stderr); ``--json-out PATH`` writes the same JSON
to a file and leaves the usual output as it is. Both may be given.

``bench``, ``verify`` and ``export`` once took ``--json OUT`` for the file; that spelling still writes the file,
with a note on stderr, until the next release.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["add_json_arguments", "check_output", "json_outputs", "stdout_to_stderr", "write_json"]


def check_output(path: str | None, option: str) -> None:
    """Fail before any work when an output file cannot be written where asked."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise argparse.ArgumentError(None, f"{option} {path!r}: folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise argparse.ArgumentError(None, f"{option} {path!r} is a folder; give a file name")
    if option == "--plot":
        from ..verify.plot import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            raise argparse.ArgumentError(None, f"--plot: {exc}") from exc


def add_json_arguments(parser: argparse.ArgumentParser, what: str, *, old_file_option: bool = False) -> None:
    """Add ``--json`` and ``--json-out PATH`` to a command whose result is ``what`` ("the report", ...).

    ``old_file_option``: the command once took ``--json OUT``; a value after ``--json`` is still read as that file.
    """
    printed = f"print {what} as JSON on stdout, nothing else"
    if old_file_option:
        parser.add_argument("--json", nargs="?", const=True, default=False, metavar="OUT",
                            help=f"{printed} (--json OUT, the old way to write a file, is --json-out OUT now)")
    else:
        parser.add_argument("--json", action="store_true", help=printed)
    parser.add_argument("--json-out", metavar="PATH", help=f"write {what} as JSON to this file")


def json_outputs(args: argparse.Namespace) -> tuple[bool, str | None]:
    """Whether to print the JSON on stdout, and the file to write it to (None: none), from ``--json`` and
    ``--json-out``. The old ``--json OUT`` becomes ``--json-out OUT`` with a deprecation note on stderr.

    Example:
        >>> json_outputs(argparse.Namespace(json=True, json_out=None, command_prog="torchport verify"))
        (True, None)
    """
    chosen, path = args.json, args.json_out
    if isinstance(chosen, str):
        if path is not None:
            raise argparse.ArgumentError(None, f"--json {chosen} and --json-out {path} both name a file; give "
                                               "--json-out PATH (and --json alone to print the JSON too)")
        print(f"{args.command_prog}: warning: --json {chosen} is deprecated and stops working in the next release; "
              f"write --json-out {chosen} (--json alone prints the JSON on stdout)", file=sys.stderr)
        chosen, path = False, chosen
    check_output(path, "--json-out")
    return bool(chosen), path


def write_json(text: str, to_stdout: bool, path: str | None) -> None:
    """Print ``text`` (one JSON document) on stdout and/or write it to ``path``, as :func:`json_outputs` chose."""
    if to_stdout:
        print(text)
    if path is not None:
        Path(path).write_text(text + "\n", encoding="utf-8")


@contextlib.contextmanager
def stdout_to_stderr(active: bool = True) -> Iterator[None]:
    """Send what is written to stdout inside the block to stderr, the output of child processes included (file
    descriptor 1 is pointed at 2), so that stdout keeps only the JSON. Does nothing when ``active`` is False."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
