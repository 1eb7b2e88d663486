"""What :func:`torchport.verify.compare` found: one row per module call (and per parameter gradient)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
from typing import Any

__all__ = ["LayerRow", "Report"]


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One module call (``kind="output"``) or one parameter gradient (``kind="grad"``), target against reference.

    ``shape`` and ``dtype`` are those of the first tensor of the output on the target. ``max_abs_error`` and
    ``rel_error`` are the largest over the output's tensors; ``worst`` is the path of the tensor with the largest
    relative error inside the output (``""`` when the output is one tensor, ``"[0]"``, ``".logits"``...).
    """

    index: int
    name: str
    type: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    max_abs_error: float
    rel_error: float
    ok: bool
    tensors: int = 1
    worst: str = ""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["shape"] = list(self.shape)
        data["max_abs_error"] = _json_float(self.max_abs_error)
        data["rel_error"] = _json_float(self.rel_error)
        return data


def _json_float(x: float) -> float | str:
    # JSON has no inf or nan; strict parsers reject Python's Infinity/NaN, so they are written as strings
    return x if math.isfinite(x) else str(x)


def _format(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}" if math.isfinite(x) else str(x)


@dataclasses.dataclass
class Report:
    """The rows of a comparison, in execution order (forward rows, then gradient rows in the order the reference's
    backward produced them), and the settings they were judged by.

    A row passes when ``rel_error <= rtol`` or ``max_abs_error <= atol``.

    Example:
        >>> report = torchport.verify.compare(model, x, device="npu")
        >>> report.ok, report.first_divergence
        (False, 'blocks.3.mlp.act')
    """

    device: str
    dtype: str
    reference: str
    reference_dtype: str
    rtol: float
    atol: float
    backward: bool
    layers: list[LayerRow]

    @property
    def ok(self) -> bool:
        """Whether every row is within tolerance."""
        return all(row.ok for row in self.layers)

    @property
    def first_divergence(self) -> str | None:
        """The name of the first row out of tolerance, or None."""
        row = self.first_failing()
        return None if row is None else row.name

    def first_failing(self) -> LayerRow | None:
        """The first row out of tolerance, or None."""
        return next((row for row in self.layers if not row.ok), None)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-serialisable; infinite and NaN errors are written as strings).

        Example:
            >>> report.to_dict()["first_divergence"]
            'blocks.3.mlp.act'
        """
        return {
            "ok": self.ok,
            "first_divergence": self.first_divergence,
            "device": self.device,
            "dtype": self.dtype,
            "reference": self.reference,
            "reference_dtype": self.reference_dtype,
            "rtol": self.rtol,
            "atol": self.atol,
            "backward": self.backward,
            "layers": [row.to_dict() for row in self.layers],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string (strict JSON: no Infinity or NaN).

        Example:
            >>> Path("verify.json").write_text(report.to_json())
        """
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def summary(self) -> str:
        """One line: whether the target matches, and where it first diverged."""
        where = f"{self.device} ({self.dtype}) against {self.reference} ({self.reference_dtype})"
        if not self.layers:
            return f"no module output to compare, {where}"
        row = self.first_failing()
        if row is None:
            return (f"all {len(self.layers)} rows within tolerance (rtol {self.rtol:g}, atol {self.atol:g}), {where}; "
                    f"largest relative error {_format(max(r.rel_error for r in self.layers))}")
        failing = sum(not r.ok for r in self.layers)
        return (f"first divergence: {row.name} ({row.type}), relative error {_format(row.rel_error)} > rtol "
                f"{self.rtol:g}, max abs error {_format(row.max_abs_error)} > atol {self.atol:g}; {failing} of "
                f"{len(self.layers)} rows out of tolerance, {where}")

    def table(self) -> Any:
        """A ``rich.table.Table`` with one line per row; failing rows in red.

        Example:
            >>> rich.console.Console().print(report.table())
        """
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"torchport verify: {self.device} ({self.dtype}) against {self.reference} "
                            f"({self.reference_dtype})")
        for column, justify in (("#", "right"), ("module", "left"), ("type", "left"), ("shape", "left"),
                                ("dtype", "left"), ("max abs err", "right"), ("rel err", "right"),
                                ("status", "left")):
            table.add_column(column, justify=justify, overflow="fold")
        first = self.first_failing()
        for row in self.layers:
            name = row.name + ("" if not row.worst else f" {row.worst}")
            status = Text("ok", style="green") if row.ok else Text(
                "FIRST" if row is first else "FAIL", style="bold red")
            if row.note:
                status.append(f" {row.note}")
            table.add_row(str(row.index), Text(name), Text(row.type), Text("x".join(map(str, row.shape)) or "()"),
                          Text(row.dtype), _format(row.max_abs_error), _format(row.rel_error), status)
        return table

    def print(self, console: Any = None) -> None:
        """Print :meth:`table` and :meth:`summary` on a rich Console (default: stdout)."""
        from rich.console import Console
        from rich.text import Text

        console = console or Console()
        console.print(self.table())
        console.print(Text(self.summary(), style="green" if self.ok else "bold red"), soft_wrap=True)

    def plot(self, path: str | os.PathLike[str]) -> str:
        """Write a PNG: relative error of each row in execution order (log scale), the tolerance, and the first
        divergence marked. Needs matplotlib. Returns the path.

        Example:
            >>> report.plot("verify.png")
        """
        from .plot import plot_report

        return plot_report(self, path)

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        self.print(Console(file=buffer, width=140, color_system=None, highlight=False))
        return buffer.getvalue()
