"""The report of a migration: a unified diff, a rich table, and a JSON document with the same facts.

Line and column numbers refer to the files as they were before migration.
"""

from __future__ import annotations

import difflib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import FileResult

__all__ = ["render_diff", "render_json", "render_table", "to_dict"]


def _site(item: dict[str, Any]) -> str:
    return f"{item['path']}:{item['line']}:{item['col']}"


def to_dict(results: Sequence[FileResult]) -> dict[str, Any]:
    """The report as plain data: files, changed/written/skipped files, every change, unconverted site and site to
    review, counts.

    Example:
        >>> to_dict(migrate_paths(["train.py"]))["counts"]["rules"]
        {'tensor-cuda': 3, 'cuda-query': 1}
    """
    changes = sorted((c for r in results for c in r.changes), key=lambda c: (c.path, c.line, c.col))
    unconverted = sorted((u for r in results for u in r.unconverted), key=lambda u: (u.path, u.line, u.col))
    review = sorted((v for r in results for v in r.review), key=lambda v: (v.path, v.line, v.col))
    return {
        "files": len(results),
        "changed": [r.path for r in results if r.changed],
        "written": [r.path for r in results if r.written],
        "skipped": [{"path": r.path, "reason": r.skipped} for r in results if r.skipped],
        "changes": [asdict(c) for c in changes],
        "unconverted": [asdict(u) for u in unconverted],
        "review": [asdict(v) for v in review],
        "counts": {
            "rules": dict(Counter(c.rule for c in changes).most_common()),
            "files": {r.path: {"changes": len(r.changes), "unconverted": len(r.unconverted), "review": len(r.review)}
                      for r in results if r.changes or r.unconverted or r.review},
        },
    }


def render_json(results: Sequence[FileResult]) -> str:
    """:func:`to_dict` as an indented JSON document."""
    return json.dumps(to_dict(results), indent=2)


def render_diff(results: Sequence[FileResult]) -> str:
    """One unified diff (``a/PATH`` -> ``b/PATH``) for every file that changes; empty when none does.

    Example:
        >>> print(render_diff(migrate_paths(["train.py"])))  # doctest: +SKIP
    """
    chunks = []
    for result in results:
        if result.changed:
            chunks.extend(difflib.unified_diff(result.original.splitlines(keepends=True),
                                               result.code.splitlines(keepends=True),
                                               f"a/{result.path}", f"b/{result.path}"))
            if chunks and not chunks[-1].endswith("\n"):
                chunks.append("\n\\ No newline at end of file\n")
    return "".join(chunks)


def _short(code: str, limit: int = 80) -> str:
    line = " ".join(code.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def render_table(results: Sequence[FileResult], console: Console, *, mode: str = "diff") -> None:
    """Print the changes, the sites left as written, the sites to review, the skipped files, the counts per rule,
    and a summary line.

    ``mode`` (``diff``, ``write`` or ``check``) only words the summary line.
    """
    report = to_dict(results)
    if report["changes"]:
        table = Table(title="torchport migrate: rewritten sites")
        for name in ("site", "rule", "before", "after"):
            table.add_column(name, overflow="fold", no_wrap=name in ("rule",))
        for c in report["changes"]:
            table.add_row(Text(_site(c)), Text(c["rule"]), Text(_short(c["before"])), Text(_short(c["after"])))
        console.print(table)
    for key, title, last in (("unconverted", "left as written: port by hand", "hint"),
                             ("review", "to review: stops without a GPU; how to run it on a CPU", "how")):
        if report[key]:
            table = Table(title=title)
            for name in ("site", "what", last):
                table.add_column(name, overflow="fold")
            for item in report[key]:
                table.add_row(Text(_site(item)), Text(item["what"]), Text(item["hint"]))
            console.print(table)
    if report["counts"]["rules"]:
        table = Table(title="changes per rule")
        table.add_column("rule")
        table.add_column("sites", justify="right")
        for rule, count in report["counts"]["rules"].items():
            table.add_row(rule, str(count))
        console.print(table)
    for skipped in report["skipped"]:
        console.print(Text(f"skipped {skipped['path']}: {skipped['reason']}", style="yellow"))
    verb = {"write": "rewritten", "check": "would change", "diff": "would change"}[mode]
    count = len(report["written"] if mode == "write" else report["changed"])
    per_file = report["counts"]["files"]
    console.print(Text(
        f"{report['files']} files read, {count} {verb}, {len(report['changes'])} sites rewritten in "
        f"{sum(1 for f in per_file.values() if f['changes'])} files, {len(report['unconverted'])} left as written, "
        f"{len(report['review'])} to review, {len(report['skipped'])} skipped", style="bold"))

