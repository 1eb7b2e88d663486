"""``torchport ui``: a local web dashboard of this machine's devices, checks, kernels, verifications and migrations.

Each tab shows what a library function returns (:func:`torchport.memory`, :func:`torchport.doctor.run_checks`,
:func:`torchport.kernels.table`, :func:`torchport.verify.compare`, :func:`torchport.migrate.migrate_source`); the
functions behind the tabs live in one module per tab and need no browser. gradio (``pip install
"torchport[ui]"``) is imported only when an app is built.

Example:
    >>> import torchport.ui
    >>> torchport.ui.serve("127.0.0.1", 7860)     # open http://127.0.0.1:7860/
"""

from __future__ import annotations

from typing import Any

from .server import DEFAULT_HOST, DEFAULT_PORT, AddressError, PortInUse, check_address, is_loopback, serve

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "AddressError", "PortInUse", "build_app", "check_address", "is_loopback",
           "serve"]


def __getattr__(name: str) -> Any:
    # the tabs import doctor, verify, bench and migrate: only when an app is built, not for `torchport --help`
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(f"module 'torchport.ui' has no attribute {name!r}")
