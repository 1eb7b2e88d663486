"""What :func:`torchport.compile.coverage` reports: one row per operator and phase, with its status on the target."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

__all__ = ["Coverage", "OpRow", "STATUSES"]

#: Every status, the most urgent first (the table's order).
STATUSES = ("missing", "cpu fallback", "torchport kernel", "native")


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One operator overload in one phase: how often the model ran it and how the target device runs it."""

    op: str  # "aten::add.Tensor"; the default overload has no suffix
    phase: str  # "forward" or "backward"
    calls: int
    status: str  # one of STATUSES
    note: str = ""


@dataclasses.dataclass
class Coverage:
    """The operators a model ran and how ``device`` runs each; see :func:`coverage`."""

    device: str
    source: str  # what answered: "dispatcher (...)" or "snapshot <file> (<version>)"
    recorded_on: str
    backward: bool
    rows: list[OpRow]
    dtypes: list[str] = dataclasses.field(default_factory=list)  # the floating dtypes operators computed in
    chip: Any = None  # the chip_coverage.ChipCoverage of the target's chip, or None

    def ops(self, status: str) -> list[str]:
        """The operators (any phase) with ``status``, sorted.

        Example:
            >>> report.ops("cpu fallback")
            ['aten::erfinv']
        """
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {', '.join(STATUSES)}")
        return sorted({row.op for row in self.rows if row.status == status})

    @property
    def missing(self) -> list[str]:
        """The operators the device cannot run, sorted."""
        return self.ops("missing")

    def summary(self) -> dict[str, int]:
        """Distinct operators per status."""
        return {status: len(self.ops(status)) for status in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "source": self.source, "recorded_on": self.recorded_on,
                "backward": self.backward, "summary": self.summary(), "dtypes": list(self.dtypes),
                "chip": None if self.chip is None else self.chip.to_dict(),
                "rows": [dataclasses.asdict(row) for row in self.rows]}

    def to_json(self) -> str:
        """The report as JSON: device, source, recorded_on, backward, summary, dtypes, chip (None unless the target
        is a known Ascend chip) and one object per row."""
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> Any:
        """The rows as a ``rich`` table."""
        from rich.table import Table

        colours = {"missing": "red", "cpu fallback": "yellow", "torchport kernel": "cyan", "native": "green"}
        summary = ", ".join(f"{n} {status}" for status, n in self.summary().items())
        table = Table(title=f"operators on {self.device} ({self.source}; recorded on {self.recorded_on})",
                      caption=f"{len({row.op for row in self.rows})} operators: {summary}")
        for column in ("operator", "phase", "calls", "status", "note"):
            table.add_column(column, overflow="fold")
        for row in self.rows:
            table.add_row(row.op, row.phase, str(row.calls), f"[{colours[row.status]}]{row.status}[/]", row.note)
        return table

    def print(self, file: Any = None) -> None:
        """Print :meth:`table`, then the chip's tables where there is a chip (stdout by default)."""
        from rich.console import Console

        console = Console(file=file or sys.stdout, width=140)
        console.print(self.table())
        for table in self.chip.tables() if self.chip is not None else ():
            console.print(table)

