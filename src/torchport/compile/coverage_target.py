"""How a target device runs an operator, for :func:`torchport.compile.coverage`: asked of this process's dispatcher
where the device's library is loaded, else of the operator list its backend ships (``data/``)."""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Callable
from typing import Any

import torch

from ..backends import Backend
from ..compat.cpu_fallback import registered
from .op_support import op_support

__all__ = ["Target", "target_source"]

_ALLOCATOR_OP = "aten::empty.memory_format"


class Target:
    """How the target device runs an operator: by this process's dispatcher, or by its backend's operator list."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.host_fallback = backend.host_fallback
        self.chip: Any = None  # the chip_coverage.ChipCoverage of the target's chip
        if backend.has_kernel(_ALLOCATOR_OP) is not None:
            self.has_kernel: Callable[[str], bool | None] = backend.has_kernel
            versions = ", ".join(f"{k} {v}" for k, v in backend.versions().items() if v)
            self.source = f"dispatcher{f' ({versions})' if versions else ''}"
        elif backend.op_snapshot is not None:
            ops, version = _snapshot(backend.op_snapshot)
            self.has_kernel = ops.__contains__
            self.source = f"snapshot {backend.op_snapshot} ({version})"
        else:
            raise ValueError(f"cannot tell which operators {backend.name} runs: its library is not loaded in this "
                             f"process ({backend.unavailable_reason()}) and torchport ships no operator list for it; "
                             f"run torchport coverage where {backend.name} is installed")

    def status(self, op: str) -> tuple[str, str]:
        """(status, note) of ``op`` on the target."""
        if op.startswith("torchport::"):
            return "torchport kernel", self._kernel_note(op)
        if op in registered(self.backend.name):
            return "cpu fallback", "torchport.compat.cpu_fallback"
        support = op_support(op, self.has_kernel, self.host_fallback)
        if support == "native":
            return "native", ""
        if support == "host":
            return "cpu fallback", f"{self.backend.name}'s library runs it on the CPU itself"
        return "missing", ""

    def _kernel_note(self, op: str) -> str:
        """What runs for torchport kernel ``op`` on the target's chip ("" without a chip)."""
        if self.chip is None:
            return ""
        name = op.partition("::")[2]
        kernel = name.removesuffix("_backward")
        row = next((row for row in self.chip.kernels if row.kernel == kernel), None)
        if row is None:
            return ""
        chip = self.chip.chip
        if row.fused:
            runs = f"torch_npu.{row.operator}"
        elif row.operator:
            runs = f"{row.implementation} (no {row.operator} on {chip.family})"
        else:
            runs = f"{row.implementation} (PyTorch operators)"
        return f"{'backward through ' if name != kernel else ''}{runs} on {chip.soc_version}"

    def lacks(self, dtypes: set[torch.dtype]) -> list[torch.dtype]:
        """The dtypes of ``dtypes`` the target's chip does not compute in."""
        return [] if self.chip is None else [d for d in self.chip.lacks_dtypes if d in dtypes]


def target_source(backend: Backend) -> tuple[str, int | None]:
    """What says which aten operators ``backend``'s device runs: ``"dispatcher (...)"`` where its library is loaded,
    else ``"snapshot <file> (<version>)"``; with the number of operator overloads the snapshot lists (None for the
    dispatcher).

    Raises:
        ValueError: neither can (the library is not loaded and torchport ships no list for it).
    """
    target = Target(backend)
    listed = _snapshot(backend.op_snapshot)[0] if target.source.startswith("snapshot") else None
    return target.source, None if listed is None else len(listed)


@functools.lru_cache(maxsize=None)
def _snapshot(name: str) -> tuple[frozenset[str], str]:
    """The operators of a shipped list and its version line."""
    text = importlib.resources.files("torchport.compile").joinpath("data", name).read_text(encoding="utf-8")
    version = next((line.partition(":")[2].strip() for line in text.splitlines() if line.startswith("# version:")),
                   "version unknown")
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")), version
