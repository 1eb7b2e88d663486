"""``torchport run``: run a CUDA-written program as ``python`` would, with CUDA calls sent to the device present."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from types import TracebackType

__all__ = ["HELP", "add_arguments", "handle", "run_program"]

HELP = "run a CUDA-written script (or -m module) unchanged on the device present: NPU, GPU or CPU"
_CHILD_HOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat", "child")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", metavar="D", help="send CUDA calls to this device (default: the detected one)")
    parser.add_argument("--report", action="store_true",
                        help="at exit, print what was redirected and what cannot run on the device (stderr)")
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a library module as a script")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py [args ...]",
                        help="the script and its arguments (with -m: the module's arguments)")


def handle(args: argparse.Namespace) -> int:
    """Check the arguments, install the shim, run the program, return its exit code."""
    from .. import _settings, compat
    from ..device import resolve

    if args.module is None:
        if not args.program:
            raise argparse.ArgumentError(None, "give a script to run, or -m MODULE")
        script = args.program[0]
        if not os.path.isfile(script):
            raise argparse.ArgumentError(None, f"script {script!r} does not exist (looked in {os.getcwd()})")
    try:
        report = args.report or _settings.value("report")
        resolve(args.device, source="--device")
        device = compat.patch(args.device)
    except (ValueError, RuntimeError) as exc:
        raise argparse.ArgumentError(None, str(exc)) from exc
    # Child processes (DataLoader workers, torch.multiprocessing, subprocess) get the same shim at start-up.
    os.environ["TORCHPORT_SHIM"] = str(device)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_CHILD_HOOK, os.environ.get("PYTHONPATH")]))
    try:
        return run_program(args.module, args.program)
    finally:
        if report:
            sys.stdout.flush()
            compat.print_report()


def run_program(module: str | None, program: list[str]) -> int:
    """Run ``script args`` or ``-m module args`` as ``__main__``; return the exit code ``python`` would give."""
    if module is None:
        owner = os.path.abspath(program[0])
        sys.argv = [program[0], *program[1:]]
        sys.path[0] = os.path.dirname(owner)
        runner = lambda: runpy.run_path(program[0], run_name="__main__")  # noqa: E731 - argv[0] as given
    else:
        sys.argv = [module, *program]  # runpy puts the module's file name in argv[0], as python -m does
        sys.path[0] = os.getcwd()
        runner, owner = (lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)), None  # noqa: E731
    try:
        runner()
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt as exc:
        _print_user_traceback(exc, owner)
        return 130
    except BaseException as exc:  # the program's own error: shown as python shows it, exit code 1
        _print_user_traceback(exc, owner)
        return 1
    return 0


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _print_user_traceback(exc: BaseException, script: str | None) -> None:
    """The traceback from the program's first frame on, without torchport's and runpy's frames above it."""
    tb: TracebackType | None = exc.__traceback__
    own = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(runpy.__file__) + os.sep)
    while tb is not None:
        filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if (script is not None and filename == script) or (script is None and not filename.startswith(own)):
            break
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)
