"""The ``torchport`` command: parses arguments and hands them to one handler per subcommand.

A subcommand is one entry in :data:`COMMANDS`: a one-line help, a function that adds its arguments to its parser,
and a handler that takes the parsed arguments and returns the exit code (0 success, 1 a check or run failed,
2 a usage error). A handler reports a bad argument by raising :class:`argparse.ArgumentError`, which becomes one
line on stderr, ``torchport <command>: error: <message>``, and exit code 2.

Example:
    $ torchport doctor --device npu:0 --json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from .. import __version__
from . import doctor, migrate, run
from . import stack
from . import bench, kernels, verify
from . import export
from . import coverage
from . import ui

__all__ = ["COMMANDS", "Command", "build_parser", "main"]


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "doctor": Command(doctor.HELP, doctor.add_arguments, doctor.handle),
    "run": Command(run.HELP, run.add_arguments, run.handle),
    "migrate": Command(migrate.HELP, migrate.add_arguments, migrate.handle),
    "stack": Command(stack.HELP, stack.add_arguments, stack.handle),
    "verify": Command(verify.HELP, verify.add_arguments, verify.handle),
    "bench": Command(bench.HELP, bench.add_arguments, bench.handle),
    "kernels": Command(kernels.HELP, kernels.add_arguments, kernels.handle),
    "export": Command(export.HELP, export.add_arguments, export.handle),
    "coverage": Command(coverage.HELP, coverage.add_arguments, coverage.handle),
    "ui": Command(ui.HELP, ui.add_arguments, ui.handle),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``torchport`` command with one subparser per entry of :data:`COMMANDS`.

    Example:
        >>> build_parser().parse_args(["doctor", "--json"]).json
        True
    """
    parser = argparse.ArgumentParser(prog="torchport", description="Write PyTorch once, run it on any device.")
    parser.add_argument("--version", action="version", version=f"torchport {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(handler=command.handler, command_prog=sub.prog)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``torchport`` command with ``argv`` (default: ``sys.argv[1:]``) and return its exit code.

    Example:
        >>> main(["doctor", "--device", "cpu"])
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    program = None
    command = next((i for i, token in enumerate(argv) if not token.startswith("-")), None)
    if command is not None and argv[command] == "run":
        # what follows the script or -m MODULE is the program's, as after `python script.py`: argparse would read
        # the program's options as torchport's, so they are set aside before it parses
        own, program = run.split_arguments(argv[command + 1:])
        argv = [*argv[:command + 1], *own]
    args = build_parser().parse_args(argv)
    if program is not None:
        args.program = program
    try:
        return args.handler(args)
    except argparse.ArgumentError as exc:
        print(f"{args.command_prog}: error: {exc.message}", file=sys.stderr)
        return 2
