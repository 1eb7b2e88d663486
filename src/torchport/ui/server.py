"""Serving the dashboard: the address is checked before anything starts, loopback is the default, and the page
loads nothing from outside this machine (no analytics, no share link, no server-side rendering)."""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "AddressError", "PortInUse", "check_address", "is_loopback", "serve",
           "url"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860
MAX_UPLOAD = "16mb"  # uploads are Python files; the Migrate tab refuses those over 4 MiB with its own message


class AddressError(ValueError):
    """The dashboard cannot listen on this host and port (not an address of this machine, a privileged port...)."""


class PortInUse(AddressError):
    """Another program listens on the port."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(f"port {port} on {host} is in use; choose another port")
        self.host, self.port = host, port


def check_address(host: str, port: int) -> int:
    """Check that the dashboard can listen on ``host:port`` by binding it once; return the port (with ``port=0``,
    a free one chosen by the system).

    Raises:
        PortInUse: another program listens there.
        AddressError: the host does not resolve or is not an address of this machine, the port is out of range or
            privileged.

    Example:
        >>> check_address("127.0.0.1", 0) > 0
        True
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise AddressError(f"port {port!r} is not a TCP port; give 1 to 65535, or 0 for any free port")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise AddressError(f"host {host!r} does not resolve to an address ({exc.strerror}); give an address of "
                           f"this machine such as {DEFAULT_HOST}") from exc
    with socket.socket(family, kind, proto) as probe:
        # as uvicorn binds: a port left in TIME_WAIT by a previous run is free, one with a listener is not
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(host, port) from exc
            if exc.errno == errno.EADDRNOTAVAIL:
                raise AddressError(f"{host} is not an address of this machine; give one of its addresses, e.g. "
                                   f"{DEFAULT_HOST}") from exc
            if exc.errno == errno.EACCES:
                raise AddressError(f"port {port} on {host} needs administrator rights; choose a port above "
                                   "1023") from exc
            raise AddressError(f"cannot listen on {host} port {port}: {exc.strerror}") from exc
        return int(probe.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (reachable from this machine only).

    Example:
        >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("0.0.0.0")
        (True, True, False)
    """
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return bool(found) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in found)


def url(host: str, port: int) -> str:
    """The address to open in a browser.

    Example:
        >>> url("::1", 7860)
        'http://[::1]:7860/'
    """
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    return f"http://[{shown}]:{port}/" if ":" in shown else f"http://{shown}:{port}/"


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
          announce: Callable[[str], None] = print) -> None:
    """Build the dashboard and serve it on ``host:port`` until interrupted (Ctrl-C). ``announce`` is given the
    line that says where it is, once it answers.

    Raises:
        PortInUse, AddressError: as :func:`check_address`, before anything is built.

    Example:
        >>> torchport.ui.serve("127.0.0.1", 7860)   # then open http://127.0.0.1:7860/
    """
    port = check_address(host, port)
    from .app import CSS, build_app, theme

    app = build_app()
    try:
        app.launch(server_name=host, server_port=port, prevent_thread_lock=True, quiet=True, show_error=True,
                   share=False, inbrowser=False, ssr_mode=False, mcp_server=False, pwa=False,
                   enable_monitoring=False, max_file_size=MAX_UPLOAD, footer_links=["api", "settings"],
                   theme=theme(), css=CSS)
    except OSError as exc:  # taken between the check and the start
        if "port" in str(exc).lower():
            raise PortInUse(host, port) from exc
        raise
    announce(f"torchport ui: serving on {url(host, port)} (Ctrl-C to stop)")
    app.block_thread()
