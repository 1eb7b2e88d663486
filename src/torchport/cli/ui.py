"""``torchport ui``: serve the dashboard of :mod:`torchport.ui` on this machine (loopback unless --host says
otherwise)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["HELP", "add_arguments", "handle"]

HELP = "open a local web dashboard: live device memory, doctor, kernels, verify and migrate"

_DESCRIPTION = """\
Serve a web dashboard on this machine: every device's memory as a live chart (and utilisation where the device
reports it), the doctor's checks, the kernel registry with a short benchmark per op, a layer-by-layer verification
of a module:factory target, and a migration of a pasted or uploaded Python file with its diff.

It listens on 127.0.0.1 (this machine only) unless --host names another address. It has no login, and its Verify
tab imports and runs the Python code a target names: give --host 0.0.0.0 only on a network you trust.
Needs gradio: pip install "torchport[ui]".
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..ui.server import DEFAULT_HOST, DEFAULT_PORT

    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; 0.0.0.0: every "
                             "interface)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"TCP port (default: {DEFAULT_PORT}; 0: any free port, printed at start)")


def handle(args: argparse.Namespace) -> int:
    """Check the address, then serve until Ctrl-C; a port in use or a missing gradio is a usage error (exit 2)."""
    from ..ui.server import AddressError, PortInUse, check_address, is_loopback, serve

    try:
        port = check_address(args.host, args.port)
    except PortInUse as exc:
        raise argparse.ArgumentError(None, f"port {exc.port} on {exc.host} is in use; choose another with "
                                           "--port") from exc
    except AddressError as exc:
        raise argparse.ArgumentError(None, str(exc)) from exc
    try:
        import gradio  # noqa: F401
    except ImportError as exc:
        raise argparse.ArgumentError(None, 'the dashboard needs gradio, which is not installed: '
                                           'pip install "torchport[ui]"') from exc
    if not is_loopback(args.host):
        print(f"torchport ui: warning: listening on {args.host}, reachable from other machines; the dashboard has "
              "no login and its Verify tab runs the Python code a target names", file=sys.stderr)
    try:
        serve(args.host, port, announce=lambda line: print(line, flush=True))
    except PortInUse as exc:
        raise argparse.ArgumentError(None, f"port {exc.port} on {exc.host} is in use; choose another with "
                                           "--port") from exc
    return 0
