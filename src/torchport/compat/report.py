"""What the shim redirected and what it met that cannot run on the target, printed at exit on request."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Any

__all__ = ["Recorder", "Finding", "call_site"]

_OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/torchport
_TORCH = None


def _where(frame: Any) -> str:
    filename = frame.f_code.co_filename
    return f"{os.path.relpath(filename) if not filename.startswith('<') else filename}:{frame.f_lineno}"


def call_site(program: bool = True) -> str:
    """file:line of the first frame outside torchport and torch. With ``program`` (what the shim's report wants: the
    line of the program that made the call), also outside the libraries the shim knows (transformers'
    ``model.cuda()`` is the program's call) and code generated with ``exec`` (a dataclass's ``__init__``); where
    there is no such frame, the first outside torchport and torch (a library acting on its own). Without it, the
    nearest library line (the operator an operator fallback ran is in a model's own file)."""
    global _TORCH
    if _TORCH is None:
        import torch

        _TORCH = os.path.dirname(torch.__file__)
    from .redirect import _LIBRARIES

    frame, fallback = sys._getframe(2), None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_OWN_CODE, _TORCH)) and "importlib" not in filename:
            if not program:
                return _where(frame)
            package = (frame.f_globals.get("__name__") or "").partition(".")[0]
            if package not in _LIBRARIES and filename != "<string>":
                return _where(frame)
            fallback = fallback or frame
        frame = frame.f_back
    return _where(fallback) if fallback is not None else "?"


@dataclasses.dataclass
class Finding:
    """Something CUDA-only that the program used, with where and what to do instead."""

    name: str
    site: str
    hint: str


class Recorder:
    """Counts redirected calls per API and keeps the first call site of each."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.sites: dict[str, str] = {}
        self.findings: list[Finding] = []
        self._lock = threading.Lock()

    def record(self, api: str) -> None:
        count = self.counts.get(api)
        if count is None:
            site = call_site()  # walked once per API: cheap enough for calls in a training loop
            with self._lock:
                self.sites.setdefault(api, site)
                self.counts[api] = self.counts.get(api, 0) + 1
        else:
            self.counts[api] = count + 1

    def find(self, name: str, hint: str) -> None:
        site = call_site()
        with self._lock:
            if not any(f.name == name and f.site == site for f in self.findings):
                self.findings.append(Finding(name, site, hint))

    def to_dict(self) -> dict[str, Any]:
        from .cpu_fallback import calls

        return {
            "redirected": [{"api": api, "count": n, "first_site": self.sites.get(api, "?")}
                           for api, n in sorted(self.counts.items(), key=lambda item: -item[1])],
            "cuda_only": [dataclasses.asdict(f) for f in self.findings],
            "cpu_fallback": calls(),  # operators run on the CPU: cpu_fallback's, and the device library's own
        }

    def print(self, target: str, file: Any = None) -> None:
        """A table of redirected APIs and one of CUDA-only things, on stderr."""
        from rich.console import Console
        from rich.table import Table

        console = Console(file=file or sys.stderr, width=120)
        table = Table(title=f"torchport: CUDA calls redirected to {target}")
        for column in ("API", "calls", "first call site"):
            table.add_column(column)
        data = self.to_dict()
        for row in data["redirected"]:
            table.add_row(row["api"], str(row["count"]), row["first_site"])
        console.print(table if data["redirected"] else f"torchport: no CUDA call was redirected to {target}")
        if data["cuda_only"]:
            found = Table(title=f"CUDA-only code that cannot run on {target}")
            for column in ("what", "where", "what to do"):
                found.add_column(column, overflow="fold")
            for row in data["cuda_only"]:
                found.add_row(row["name"], row["site"], row["hint"])
            console.print(found)
        if data["cpu_fallback"]:
            fallback = Table(title=f"operators run on the CPU instead of {target} (host fallbacks: every call copies "
                                   "its tensors there and back)")
            for column in ("operator", "device", "calls", "first call site"):
                fallback.add_column(column, overflow="fold")
            for row in data["cpu_fallback"]:
                fallback.add_row(row["op"], row["device"], str(row["calls"]), row["first_site"])
            console.print(fallback)
