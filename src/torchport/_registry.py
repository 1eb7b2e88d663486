"""The one shape of torchport's registries: device backends, kernel ops, compile passes, quantisation formats and
migrate rules are each a :class:`Registry`.

A registry maps names to entries. ``register`` refuses a second entry of one name (unless the registry allows
replacing); ``get`` raises a ValueError that names what was asked for and lists what exists; iterating gives the
names. Built-in entries are imported on first use, all at once (``load``) or one module per name (``modules``), and
third-party packages add theirs through an entry-point group where a registry names one. ``import torchport`` imports
no entry of any registry.

Example:
    >>> formats = Registry("quantisation format")
    >>> formats.register("int8", object())
    >>> formats.get("int3")
    Traceback (most recent call last):
    ValueError: 'int3' is not a quantisation format; registered: int8
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Generic, TypeVar

__all__ = ["Registry"]

logger = logging.getLogger("torchport")

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> entries of one kind (``what``: "device type", "compile pass"...).

    Args:
        what: what an entry is, for error messages.
        load: imports the modules that register the built-in entries; called once, before the first lookup.
        modules: name -> the module that registers that built-in entry, imported when that name is first asked for.
        entry_point_group: third-party entries: each entry point of this group loads a module that registers one.
        replaceable: whether ``register(..., replace=True)`` may put a new entry in place of one of the same name.
        unknown: the start of the error for an unknown name, with ``{label}`` (``'x'`` or ``source='x'``).
        origin: where an entry comes from (its module or class), named when another entry wants its name.
    """

    def __init__(self, what: str, *, load: Callable[[], None] | None = None, modules: Mapping[str, str] | None = None,
                 entry_point_group: str | None = None, replaceable: bool = False,
                 unknown: str = "{label} is not a {what}", origin: Callable[[T], str] | None = None) -> None:
        self.what = what
        self._load = load
        self._modules = dict(modules or {})
        self._group = entry_point_group
        self._replaceable = replaceable
        self._unknown = unknown
        self._origin = origin
        self._entries: dict[str, T] = {}
        self._lock = threading.RLock()
        self._loaded = load is None
        self._loading = False
        self._plugins_loaded = entry_point_group is None

    def __repr__(self) -> str:
        return f"<torchport registry of {self.what}s: {', '.join(self.names())}>"

    def register(self, name: str, entry: T, *, replace: bool = False) -> T:
        """Add ``entry`` under ``name``; returns it. A name taken by another entry is an error naming where that
        one comes from, unless ``replace`` is given and the registry allows it."""
        if replace and not self._replaceable:
            raise ValueError(f"{self.what} entries cannot be replaced; {name!r} is registered once")
        with self._lock:
            if name in self._entries and not replace and self._entries[name] is not entry:
                where = f" ({self._origin(self._entries[name])})" if self._origin else ""
                hint = " or pass replace=True" if self._replaceable else ""
                raise ValueError(f"a {self.what} named {name!r} is already registered{where}; choose another name{hint}")
            self._entries[name] = entry
        return entry

    def get(self, name: str, *, source: str | None = None) -> T:
        """The entry registered as ``name``, importing its built-in module first when it has one.

        Raises:
            ValueError: no such entry; the message lists the registered names (``source``, where the name came
                from, starts it: ``TORCHPORT_DEVICE='gpu'``).
        """
        self._ensure_loaded()
        with self._lock:
            if name not in self._entries and name in self._modules:
                importlib.import_module(self._modules[name])
            if name not in self._entries:
                self._load_plugins()
            if name in self._entries:
                return self._entries[name]
        label = f"{source}={name!r}" if source else repr(name)
        raise ValueError(f"{self._unknown.format(label=label, what=self.what)}; registered: "
                         f"{', '.join(self.names())}")

    def names(self) -> list[str]:
        """Every name: the built-in ones in the order declared, then the others in registration order."""
        self._ensure_loaded()
        self._load_plugins()
        with self._lock:
            return [*self._modules, *(name for name in self._entries if name not in self._modules)]

    def entries(self) -> dict[str, T]:
        """The registered entries by name (built-ins of ``modules`` appear once imported)."""
        self._ensure_loaded()
        with self._lock:
            return dict(self._entries)

    def copy(self) -> Registry[T]:
        """A registry with this one's settings and entries (tests swap it in to register entries for a while)."""
        self._ensure_loaded()
        other: Registry[T] = Registry(self.what, modules=self._modules, replaceable=self._replaceable,
                                      unknown=self._unknown, origin=self._origin)
        other._group, other._plugins_loaded = self._group, self._plugins_loaded
        with self._lock:
            other._entries = dict(self._entries)
        return other

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        with self._lock:
            return name in self._entries or name in self._modules

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded or self._loading:  # a built-in module that asks the registry while it is imported
                return
            self._loading = True
            try:
                self._load()  # type: ignore[misc]  # set when not loaded
                self._loaded = True
            finally:
                self._loading = False

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for entry in metadata.entry_points(group=self._group):
            try:
                entry.load()
            except Exception as exc:  # a broken third-party plugin must not stop torchport from working
                logger.warning("torchport %s plugin %r failed to load: %s", self.what, entry.value, exc)
