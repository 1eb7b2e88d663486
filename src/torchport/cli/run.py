"""``torchport run``: run a CUDA-written program as ``python`` would, with CUDA calls sent to the device present."""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Sequence
from types import TracebackType

__all__ = ["HELP", "add_arguments", "handle", "run_program", "split_arguments"]

HELP = "run a CUDA-written script (or -m module) unchanged on the device present: NPU, GPU or CPU"
_CHILD_HOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat", "child")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", metavar="D", help="run on this device: CUDA calls go there and "
                        "torchport.device() answers it (default: the detected one)")
    parser.add_argument("--report", action="store_true",
                        help="at exit, print what was redirected and what cannot run on the device (stderr)")
    parser.add_argument("--mode", metavar="MODE", help="enable a torchport mode for the program's models before it "
                        "starts: speed, balanced or memory (default: TORCHPORT_MODE)")
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a library module as a script")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="script.py [args ...]",
                        help="the script and its arguments (with -m: the module's arguments). As with python, "
                             "everything after the script or module belongs to the program; a '--' before the "
                             "script or right after the script or module is dropped, to pass a literal '--' write "
                             "it twice")
    group = parser.add_argument_group(
        "several processes", "start the program once per device through torchrun (torch.distributed.run); the "
        "other options are passed on to torchrun for multi-node runs")
    group.add_argument("--nproc-per-node", metavar="N",
                       help="processes on this node: a number, or 'auto' for one per device of the chosen type")
    for flag in _TORCHRUN_VALUES:
        group.add_argument(flag, metavar="VALUE", help=argparse.SUPPRESS)
    group.add_argument("--standalone", action="store_true", help=argparse.SUPPRESS)


# torchrun options taking a value that `torchport run --nproc-per-node` passes through
_TORCHRUN_VALUES = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-backend", "--rdzv-endpoint",
                    "--rdzv-id", "--rdzv-conf", "--max-restarts", "--monitor-interval", "--log-dir", "--local-addr")


# torchport run's own options that take a value (the others are switches); -m ends the options, as in python
_VALUED = ("--device", "--mode", "--nproc-per-node", *_TORCHRUN_VALUES)
_SWITCHES = ("-h", "--help", "--report", "--standalone")


def split_arguments(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split what follows ``torchport run`` into its own options and the program's command line, as python does.

    Options come first; the program starts at the first word that is not an option nor an option's value (the
    script), or after ``-m MODULE``. Everything from there on is the program's, options included. One ``--`` is
    dropped: before the script, or as the first argument after the script or module (``torchport run -m pkg.mod --
    --flag`` passes ``--flag``, as ``python -m pkg.mod --flag`` does).

    Returns:
        (torchport's options, with ``-m MODULE`` when given; the script and its arguments, or the module's
        arguments).

    Example:
        >>> split_arguments(["--device", "cpu", "-m", "pkg.mod", "--", "--flag"])
        (['--device', 'cpu', '-m', 'pkg.mod'], ['--flag'])
    """
    own: list[str] = []
    rest = list(tokens)
    while rest:
        token = rest.pop(0)
        if token == "--":
            return own, _drop_separator(rest, dropped=True)
        if token == "-m" or (token.startswith("-m") and not token.startswith("--")):
            module = token[2:] or (rest.pop(0) if rest else None)
            if module is None:
                return own + [token], []  # argparse says that -m needs a module
            return own + ["-m", module], _drop_separator(rest, dropped=False)
        if not token.startswith("-") or token == "-":
            return own, [token, *_drop_separator(rest, dropped=False)]
        own.append(token)
        if "=" not in token and _takes_value(token) and rest:
            own.append(rest.pop(0))
    return own, []


def _takes_value(option: str) -> bool:
    """Whether ``option`` is one of torchport run's options with a value, or an abbreviation of only such ones
    (argparse accepts ``--dev cpu`` for ``--device cpu``)."""
    if option in _VALUED or option in _SWITCHES:
        return option in _VALUED
    matches = [name for name in (*_VALUED, *_SWITCHES) if option.startswith("--") and name.startswith(option)]
    return bool(matches) and all(name in _VALUED for name in matches)


def _drop_separator(arguments: list[str], dropped: bool) -> list[str]:
    """The program's arguments without a leading ``--``, unless one was dropped already."""
    return arguments[1:] if not dropped and arguments[:1] == ["--"] else arguments


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
    passed = _torchrun_arguments(args)
    if args.nproc_per_node is None and passed:
        raise argparse.ArgumentError(None, f"{passed[0]} is a torchrun option: give --nproc-per-node N with it")
    if args.nproc_per_node is not None:
        return _launch(args, passed)
    try:
        report = args.report or _settings.value("report")
        mode = _mode(args.mode)
        resolve(args.device, source="--device")
        device = compat.patch(args.device)
    except (ValueError, RuntimeError) as exc:
        raise argparse.ArgumentError(None, str(exc)) from exc
    if report:  # the device library's own CPU fallback (torch_npu's) is counted per call, with its call site
        from ..compat.cpu_fallback import count_host_fallbacks

        count_host_fallbacks(device)
    # Child processes (DataLoader workers, torch.multiprocessing, subprocess) get the same shim at start-up.
    os.environ["TORCHPORT_SHIM"] = str(device)
    if args.device:
        # the program's own questions (torchport.device(), torchport.distributed.init()) get the device type the
        # flag named, not the detected one: `--device cpu` on a GPU machine runs every rank on the CPU. The type
        # only: the index is the current device's (compat.patch made a named index current; a rank sets its own)
        os.environ["TORCHPORT_DEVICE"] = _settings.parse_device_spec(args.device, "--device")[0]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_CHILD_HOOK, os.environ.get("PYTHONPATH")]))
    if mode is not None:
        from .. import modes

        os.environ["TORCHPORT_MODE"] = mode  # a program that starts `torchport run` again (torchrun) keeps it
        enabled = modes.enable(mode, device=device)
        if report:
            print(enabled, file=sys.stderr)
    try:
        return run_program(args.module, args.program)
    finally:
        if report:
            sys.stdout.flush()
            compat.print_report()


def _mode(flag: str | None) -> str | None:
    """The mode from --mode, else TORCHPORT_MODE; an error that lists the modes for any other value."""
    from .. import _settings

    if flag is None:
        return _settings.value("mode")
    if flag.strip().lower() not in _settings.MODES:
        raise ValueError(f"--mode {flag!r} is not a mode; modes: {', '.join(_settings.MODES)}")
    return flag.strip().lower()


def _torchrun_arguments(args: argparse.Namespace) -> list[str]:
    passed: list[str] = []
    for flag in _TORCHRUN_VALUES:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            passed += [flag, value]
    if args.standalone:
        passed.append("--standalone")
    return passed


def _process_count(value: str, device: str | None) -> int:
    from ..device import resolve

    try:
        backend, _ = resolve(device, source="--device")
    except (ValueError, RuntimeError) as exc:
        raise argparse.ArgumentError(None, str(exc)) from exc
    host = backend.device(0).index is None  # the CPU: any number of processes share it
    count = 1 if host else backend.device_count()
    if value == "auto":
        return count
    try:
        wanted = int(value)
    except ValueError:
        wanted = 0
    if wanted < 1:
        raise argparse.ArgumentError(None, f"--nproc-per-node {value!r}: give a positive number, or 'auto'")
    if not host and wanted > count:
        raise argparse.ArgumentError(
            None,
            f"--nproc-per-node {wanted} but this node has {count} {backend.name} device(s): each process needs its "
            f"own device; use at most {count}, or --device cpu to run the processes on the CPU",
        )
    return wanted


def _launch(args: argparse.Namespace, passed: list[str]) -> int:
    """Start ``torchrun --nproc-per-node N [passed] -m torchport run ...``; return its exit code."""
    count = _process_count(args.nproc_per_node, args.device)
    multi_node = any(flag in passed for flag in ("--nnodes", "--rdzv-endpoint", "--master-addr"))
    rendezvous = [] if multi_node or "--standalone" in passed else ["--standalone"]
    inner = ["-m", "torchport", "run"]
    if args.device:
        inner += ["--device", args.device]
    if args.report:
        inner.append("--report")
    if args.mode:
        inner += ["--mode", args.mode]
    # with "--" the program's arguments reach it unchanged whatever they are, a leading "--" included
    inner += ["-m", args.module, "--", *args.program] if args.module else ["--", *args.program]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(count), *rendezvous, *passed,
               *inner]
    process = subprocess.Popen(command)
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:  # torchrun got the same signal and stops its workers; wait for it
            continue


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
