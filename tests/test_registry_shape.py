"""The one registry shape: register, refuse a taken name, get with an error listing what exists, lazy built-ins."""

from __future__ import annotations

import sys
import types

import pytest

from torchport._registry import Registry


def test_register_get_and_iterate() -> None:
    reg: Registry[int] = Registry("widget", origin=lambda entry: f"entry {entry}")
    reg.register("a", 1)
    reg.register("b", 2)
    assert reg.get("b") == 2 and list(reg) == ["a", "b"] and "a" in reg and len(reg) == 2
    with pytest.raises(ValueError, match=r"a widget named 'a' is already registered \(entry 1\); choose another name$"):
        reg.register("a", 3)
    with pytest.raises(ValueError, match=r"^--kind='c' is not a widget; registered: a, b$"):
        reg.get("c", source="--kind")
    with pytest.raises(ValueError, match="cannot be replaced"):
        reg.register("a", 3, replace=True)


def test_replace_where_allowed() -> None:
    reg: Registry[int] = Registry("widget", replaceable=True)
    reg.register("a", 1)
    with pytest.raises(ValueError, match="or pass replace=True"):
        reg.register("a", 2)
    reg.register("a", 2, replace=True)
    assert reg.get("a") == 2


def test_builtins_load_once_on_first_use() -> None:
    calls = []
    reg: Registry[int] = Registry("widget", load=lambda: (calls.append(1), reg.register("x", 1), reg.names()))
    reg.register("early", 0)  # registering does not load
    assert calls == []
    assert reg.names() == ["early", "x"] and reg.get("x") == 1
    assert calls == [1]


def test_one_module_per_name(monkeypatch: pytest.MonkeyPatch) -> None:
    reg: Registry[str] = Registry("widget", modules={"lazy": "torchport_test_lazy_widget"})
    module = types.ModuleType("torchport_test_lazy_widget")
    imported = []

    def fake_import(name: str) -> types.ModuleType:
        imported.append(name)
        reg.register("lazy", "made")
        return module

    monkeypatch.setattr("torchport._registry.importlib.import_module", fake_import)
    assert reg.names() == ["lazy"] and imported == []  # known by name before its module is imported
    assert reg.get("lazy") == "made" and imported == ["torchport_test_lazy_widget"]
    assert "torchport_test_lazy_widget" not in sys.modules
    copy = reg.copy()
    copy.register("other", "x")
    assert "other" not in reg and copy.get("lazy") == "made"
