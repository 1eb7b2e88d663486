"""Print, check or rewrite the settings table of docs/settings.md, made from the rows of torchport._settings.

Usage: .venv/bin/python scripts/settings_table.py          print the table
       .venv/bin/python scripts/settings_table.py --write  rewrite it in docs/settings.md (between its two markers)
       .venv/bin/python scripts/settings_table.py --check  exit 1 when docs/settings.md differs from the rows
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from torchport import _settings  # noqa: E402

PAGE = ROOT / "docs" / "settings.md"
START, END = "<!-- settings-table: start -->", "<!-- settings-table: end -->"


def rewritten(text: str) -> str:
    """``text`` with the lines between the markers replaced by the generated table."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise SystemExit(f"{PAGE}: expected one {START} and one {END} line around the table")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{_settings.markdown_table()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="rewrite the table in docs/settings.md")
    group.add_argument("--check", action="store_true", help="exit 1 when docs/settings.md is out of date")
    args = parser.parse_args()
    if not (args.write or args.check):
        print(_settings.markdown_table())
        return 0
    text = PAGE.read_text(encoding="utf-8")
    new = rewritten(text)
    if args.check:
        if new != text:
            print(f"{PAGE} is out of date: run .venv/bin/python scripts/settings_table.py --write", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
