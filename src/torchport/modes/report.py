"""The report of a mode: one row per setting, before and after, whether it changed, and why."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Change", "Report"]


@dataclasses.dataclass
class Change:
    """One row of a :class:`Report`: a setting, its value before and after, whether it changed, and why."""

    setting: str
    before: str
    after: str
    changed: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Report:
    """What :func:`enable` changed (``changes``) and what it left as it was, with the reason (``kept``).

    ``print(report)`` shows a table; ``report.to_dict()`` the same as plain data.
    """

    mode: str
    target: str  # the model's class name, or "process"
    device: str
    rows: list[Change] = dataclasses.field(default_factory=list)

    def add(self, setting: str, before: Any, after: Any, note: str = "", changed: bool | None = None) -> None:
        before, after = str(before), str(after)
        self.rows.append(Change(setting, before, after, before != after if changed is None else changed, note))

    @property
    def changes(self) -> list[Change]:
        return [row for row in self.rows if row.changed]

    @property
    def kept(self) -> list[Change]:
        return [row for row in self.rows if not row.changed]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "target": self.target, "device": self.device,
                "rows": [row.to_dict() for row in self.rows]}

    def __str__(self) -> str:
        head = f"torchport {self.mode} mode on {self.device} for {self.target}: {len(self.changes)} change(s)"
        table = [("", "setting", "before", "after", "note")] + [
            ("*" if row.changed else "-", row.setting, row.before, row.after, row.note) for row in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(4)]
        lines = [head] + ["  ".join(cell.ljust(width) for cell, width in zip(line[:4], widths)) + "  " + line[4]
                          for line in table]
        return "\n".join(line.rstrip() for line in lines) + "\n(* changed, - kept as it was)"
