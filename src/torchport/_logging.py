"""The ``torchport`` loggers, switched on per topic by ``TORCHPORT_LOG`` (see :mod:`torchport._settings`).

Each topic logs through ``logging.getLogger("torchport.<topic>")``. When ``TORCHPORT_LOG`` names a topic and the
application configured no handler for torchport, messages go to standard error, one line each, prefixed with
``[torchport.<topic>]``; an application that configured logging keeps full control.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from . import _settings

__all__ = ["enabled", "log"]

_lock = threading.Lock()
_handler: logging.Handler | None = None


def enabled(topic: str) -> bool:
    """Whether messages of this topic are wanted (``TORCHPORT_LOG`` names it, or ``all``)."""
    return _settings.logging_enabled(topic)


def log(topic: str, message: str, *args: Any) -> None:
    """Log ``message % args`` at INFO under ``torchport.<topic>`` if ``TORCHPORT_LOG`` asks for the topic."""
    if not enabled(topic):
        return
    logger = logging.getLogger(f"torchport.{topic}")
    _ensure_handler()
    logger.info(message, *args)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each message (it may be replaced after start-up)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


def _ensure_handler() -> None:
    global _handler
    root = logging.getLogger("torchport")
    if _handler is not None or root.handlers:
        return
    with _lock:
        if _handler is None and not root.handlers:
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
            root.addHandler(handler)
            if root.level == logging.NOTSET or root.level > logging.INFO:
                root.setLevel(logging.INFO)
            _handler = handler
