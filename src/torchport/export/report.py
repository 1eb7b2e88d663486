"""What :func:`torchport.export.onnx` did: the file, the exporter, the graph's inputs and outputs, and how far
onnxruntime's outputs are from PyTorch's."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

__all__ = ["Check", "ExportReport", "GraphInput"]


@dataclasses.dataclass(frozen=True)
class GraphInput:
    """One input of the exported graph: its name, the shape it was exported with, and whether dim 0 is dynamic."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    dynamic_batch: bool

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "dynamic_batch": self.dynamic_batch}

    def __str__(self) -> str:
        dims = ["B" if self.dynamic_batch and i == 0 else str(d) for i, d in enumerate(self.shape)]
        return f"{self.name} {'x'.join(dims) or 'scalar'} {self.dtype}"


@dataclasses.dataclass(frozen=True)
class Check:
    """onnxruntime against PyTorch on one set of inputs: the largest absolute error and the relative error
    ‖ort − torch‖₂ / ‖torch‖₂ over every output (the worst output counts)."""

    batch_size: int | None
    max_abs_error: float
    rel_error: float
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """The result of :func:`torchport.export.onnx`. ``ok`` is True when every check is within tolerance: a check
    passes when its relative error is at most ``rtol`` or its largest absolute error at most ``atol``."""

    path: str
    opset: int
    exporter: str
    dtype: str
    inputs: tuple[GraphInput, ...]
    outputs: tuple[str, ...]
    provider: str
    rtol: float
    atol: float
    checks: tuple[Check, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def max_abs_error(self) -> float:
        return max(check.max_abs_error for check in self.checks)

    @property
    def rel_error(self) -> float:
        return max(check.rel_error for check in self.checks)

    @property
    def dynamic_batch(self) -> bool:
        return any(item.dynamic_batch for item in self.inputs)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, JSON-serialisable.

        Example:
            >>> json.dumps(torchport.export.onnx(model, x, "m.onnx").to_dict())
        """
        return {"ok": self.ok, "path": self.path, "opset": self.opset, "exporter": self.exporter, "dtype": self.dtype,
                "inputs": [item.to_dict() for item in self.inputs], "outputs": list(self.outputs),
                "provider": self.provider, "rtol": self.rtol, "atol": self.atol,
                "max_abs_error": self.max_abs_error, "rel_error": self.rel_error,
                "checks": [check.to_dict() for check in self.checks], "notes": list(self.notes)}

    def print(self, console: Any = None) -> None:
        """Print a summary and one row per check on a rich Console (default: stdout)."""
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        console = console or Console()
        inputs = ", ".join(map(str, self.inputs))
        console.print(Text(f"{self.path}: ONNX opset {self.opset}, {self.dtype}, exported by {self.exporter}\n"
                           f"inputs: {inputs}\noutputs: {', '.join(self.outputs)}"), soft_wrap=True)
        table = Table(title=f"onnxruntime ({self.provider}) against PyTorch, rtol {self.rtol:g}, atol {self.atol:g}")
        for column in ("batch", "max abs error", "relative error", "result"):
            table.add_column(column, justify="right")
        for check in self.checks:
            verdict = Text("ok", style="green") if check.ok else Text("over tolerance", style="bold red")
            table.add_row(str(check.batch_size) if check.batch_size is not None else "-",
                          f"{check.max_abs_error:.3g}", f"{check.rel_error:.3g}", verdict)
        console.print(table)
        for note in self.notes:
            console.print(Text(f"note: {note}"), soft_wrap=True)

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        self.print(Console(file=buffer, width=120, color_system=None, highlight=False))
        return buffer.getvalue()
