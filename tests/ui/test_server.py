"""Serving the dashboard: the address is checked first, loopback by default, a port in use is a usage error."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from torchport.cli.main import build_parser, main
from torchport.ui import server


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another socket listens on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_free_port_is_returned_and_zero_picks_one() -> None:
    port = server.check_address("127.0.0.1", 0)
    assert 0 < port < 65536
    assert server.check_address("127.0.0.1", port) == port


def test_a_port_in_use_is_named(busy_port: int) -> None:
    with pytest.raises(server.PortInUse, match=f"port {busy_port} on 127.0.0.1 is in use; choose another port"):
        server.check_address("127.0.0.1", busy_port)


@pytest.mark.parametrize(("host", "port", "message"), [
    ("127.0.0.1", 70000, "port 70000 is not a TCP port; give 1 to 65535, or 0 for any free port"),
    ("127.0.0.1", -1, "port -1 is not a TCP port"),
    ("no-such-host.invalid", 0, "host 'no-such-host.invalid' does not resolve"),
    ("192.0.2.1", 0, "192.0.2.1 is not an address of this machine"),  # TEST-NET-1, never local
])
def test_an_address_the_dashboard_cannot_use_says_why(host: str, port: int, message: str) -> None:
    with pytest.raises(server.AddressError, match=message):
        server.check_address(host, port)


def test_loopback_is_told_apart_from_every_interface() -> None:
    assert server.is_loopback("127.0.0.1") and server.is_loopback("localhost") and server.is_loopback("::1")
    assert not server.is_loopback("0.0.0.0") and not server.is_loopback("no-such-host.invalid")


def test_urls_to_open() -> None:
    assert server.url("127.0.0.1", 7860) == "http://127.0.0.1:7860/"
    assert server.url("0.0.0.0", 80) == "http://localhost:80/"
    assert server.url("::1", 7860) == "http://[::1]:7860/"


def test_the_command_listens_on_loopback_by_default() -> None:
    args = build_parser().parse_args(["ui"])
    assert (args.host, args.port) == ("127.0.0.1", 7860)


def test_the_command_refuses_a_port_in_use_with_exit_2(busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ui", "--port", str(busy_port)]) == 2
    assert capsys.readouterr().err == (f"torchport ui: error: port {busy_port} on 127.0.0.1 is in use; choose another "
                                       "with --port\n")


def test_the_command_refuses_a_bad_address_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ui", "--host", "192.0.2.1", "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith("torchport ui: error: 192.0.2.1 is not an address of this machine")


def test_without_gradio_the_command_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio raises ImportError
    assert main(["ui", "--port", "0"]) == 2
    assert capsys.readouterr().err == ('torchport ui: error: the dashboard needs gradio, which is not installed: '
                                       'pip install "torchport[ui]"\n')


def test_the_help_says_it_listens_on_loopback_and_runs_targets(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["ui", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "listens on 127.0.0.1 (this machine only) unless --host" in text and "no login" in text
