"""The settings' rows are the one source: the dataclass, the parsers, the docs table and every variable the docs
name follow them."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchport import _settings

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "settings_table.py"


def _script():
    spec = importlib.util.spec_from_file_location("settings_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dataclass_fields_are_the_rows() -> None:
    fields = dataclasses.fields(_settings.Settings)
    assert [f.name for f in fields] == [row.field for row in _settings.ROWS] == list(_settings.VARIABLES)
    assert all(row.variable.startswith("TORCHPORT_") for row in _settings.ROWS)
    assert len({row.variable for row in _settings.ROWS}) == len(_settings.ROWS)
    defaults = _settings.Settings()
    for row in _settings.ROWS:
        assert getattr(defaults, row.field) == row.default_value()
    assert defaults.kernels is not _settings.Settings().kernels  # each instance gets its own mapping


def test_docs_table_is_generated_from_the_rows() -> None:
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert _script().rewritten(text) == text, "docs/settings.md is out of date: run scripts/settings_table.py --write"
    for row in _settings.ROWS:
        assert f"| `{row.variable}` |" in text


def test_the_check_fails_on_drift(tmp_path: Path) -> None:
    module = _script()
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    drifted = text.replace("| `TORCHPORT_MODE` |", "| `TORCHPORT_MOOD` |")
    assert module.rewritten(drifted) == text
    with pytest.raises(SystemExit, match="expected one"):
        module.rewritten(text.replace(module.START, ""))
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == _settings.markdown_table()


def test_every_variable_the_docs_name_is_a_setting() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    known = set(_settings.VARIABLES.values())
    for page in pages:
        named = set(re.findall(r"TORCHPORT_[A-Z_]*[A-Z]", page.read_text(encoding="utf-8")))
        assert named <= known, f"{page.name} names {sorted(named - known)}, which are not settings"


def test_module_docstring_lists_every_variable_once() -> None:
    for row in _settings.ROWS:
        assert _settings.__doc__.count(f"``{row.variable}``") == 1


@pytest.mark.parametrize("row", _settings.ROWS, ids=lambda row: row.variable)
def test_every_row_parses_its_default_and_rejects_nonsense(row: _settings.Row, monkeypatch) -> None:
    monkeypatch.delenv(row.variable, raising=False)
    assert _settings.value(row.field) == row.default_value()
    if row.field == "cache_dir":  # any text is a folder
        return
    monkeypatch.setenv(row.variable, "no such value!")
    with pytest.raises(ValueError) as err:
        _settings.value(row.field)
    message = str(err.value)
    assert message.startswith(f"{row.variable}='no such value!'"), message  # the variable and the value
    assert "valid" in message or "write" in message, message  # then what is allowed


def test_kernel_modes_are_asked_of_one_place(monkeypatch) -> None:
    monkeypatch.setattr(_settings, "kernel_modes", lambda: ("auto", "reference", "chunked"))
    _settings._parse_kernels_text.cache_clear()
    try:
        assert _settings.value("kernels") == {"*": "auto"}
        with _settings.override(kernels="rms_norm=chunked") as s:
            assert s.kernels == {"*": "auto", "rms_norm": "chunked"}
        with pytest.raises(ValueError, match="valid modes: auto, reference, chunked"):
            _settings._validate("kernels", "triton", "TORCHPORT_KERNELS")
        assert "`auto`, `reference` or `chunked`, and/or per-op" in _settings.markdown_table()  # the docs follow
    finally:
        _settings._parse_kernels_text.cache_clear()
