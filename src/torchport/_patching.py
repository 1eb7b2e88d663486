"""Changing attributes and dictionary entries, and putting back exactly what was there.

One marker, :data:`MISSING`, stands for "there was no value" (an attribute a class did not define itself, a key a
dictionary did not have): putting it back deletes. One :class:`Journal` records each change with its first value,
and undo functions, and undoes them last first; :class:`SharedPatches` patches an attribute once for several
holders and puts it back when the last one lets go. The CUDA shim (:mod:`torchport.compat`), model patching
(:mod:`torchport.models`) and modes (:mod:`torchport.modes`) change things through it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["MISSING", "Journal", "Missing", "SharedPatches", "get_attr", "put_attr", "put_item"]


class Missing:
    """No value: the attribute or key did not exist. A class, so that copies and pickles keep its identity."""


#: The one "no value" marker.
MISSING = Missing


def get_attr(owner: Any, name: str) -> Any:
    """``owner``'s own value for ``name`` (not one it inherits), :data:`MISSING` when it has none; objects without
    a ``__dict__`` answer ``getattr``."""
    if hasattr(owner, "__dict__"):
        return vars(owner).get(name, MISSING)
    return getattr(owner, name)


def put_attr(owner: Any, name: str, value: Any) -> None:
    """``owner.name = value``; :data:`MISSING` deletes the attribute (nothing happens when it is already gone)."""
    if value is MISSING:
        try:
            delattr(owner, name)
        except AttributeError:
            pass
    else:
        setattr(owner, name, value)


def put_item(table: dict, key: Any, value: Any) -> None:
    """``table[key] = value``; :data:`MISSING` removes the key."""
    if value is MISSING:
        table.pop(key, None)
    else:
        table[key] = value


# A journal entry: an attribute change (owner, name, first value) or an undo function.
_Entry = tuple[Any, str, Any] | Callable[[], None]


class Journal:
    """Changes in order, with how to undo them: attributes (:meth:`set`, :meth:`wrap`), dictionary entries
    (:meth:`set_item`, :meth:`remember_item`) and undo functions (:meth:`undo`). :meth:`restore` undoes them last
    first. ``lock`` serialises callers that patch shared objects.

    Example:
        >>> journal = Journal()
        >>> journal.set(torch.Tensor, "cuda", to_target)
        >>> journal.restore()       # torch.Tensor.cuda is torch's own again
    """

    def __init__(self, attrs: Iterable[tuple[Any, str, Any]] = ()) -> None:
        self._entries: list[_Entry] = list(attrs)
        self._remembered: set[tuple[int, Any]] = set()
        self.lock = threading.RLock()

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value``, keeping the value ``owner`` had itself to put back."""
        self._entries.append((owner, name, get_attr(owner, name)))
        setattr(owner, name, value)

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` by ``make(current)``; skipped when ``owner`` has no such attribute."""
        current = getattr(owner, name, MISSING)
        if current is not MISSING:
            self.set(owner, name, make(current))

    def remember_item(self, table: dict, key: Any) -> None:
        """Keep ``table[key]`` as it is now (or its absence), to put back; only the first value of a key counts."""
        slot = (id(table), key)
        if slot in self._remembered:
            return
        self._remembered.add(slot)
        saved = self._keep(table.get(key, MISSING))
        self._entries.append(lambda: put_item(table, key, saved()))

    def set_item(self, table: dict, key: Any, value: Any) -> None:
        """``table[key] = value`` (:data:`MISSING` removes the key), remembering the first value."""
        self.remember_item(table, key)
        put_item(table, key, value)

    def undo(self, step: Callable[[], None]) -> None:
        """Run ``step`` at :meth:`restore`, in its place among the changes."""
        self._entries.append(step)

    def _keep(self, original: Any) -> Callable[[], Any]:
        """How a remembered value comes back; by identity here (a subclass may keep a copy instead)."""
        return lambda: original

    def attrs(self) -> list[tuple[Any, str, Any]]:
        """The attribute changes, as ``(owner, name, first value)`` in order: plain data that copies and pickles."""
        return [entry for entry in self._entries if isinstance(entry, tuple)]

    def patched(self) -> list[tuple[Any, str]]:
        """The attributes changed, as ``(owner, name)`` in order."""
        return [(owner, name) for owner, name, _ in self.attrs()]

    def restore(self) -> list[str]:
        """Undo everything, last first. Each step is tried; returns the failures (empty when all went back)."""
        failures = []
        while self._entries:
            entry = self._entries.pop()
            try:
                if isinstance(entry, tuple):
                    put_attr(*entry)
                else:
                    entry()
            except Exception as exc:  # keep undoing the rest; the caller reports what failed
                failures.append(f"{type(exc).__name__}: {exc}")
        self._remembered.clear()
        return failures

    def __len__(self) -> int:
        return len(self._entries)


class SharedPatches:
    """Attributes several holders need replaced the same way (a class's forward, a module-level function): each is
    replaced once, by the first :meth:`hold`, and put back when the last holder is released. Callers serialise.

    Example:
        >>> shared = SharedPatches()
        >>> shared.hold(modeling, "apply_rotary_pos_emb", make_rope, holder=id(model))
        >>> shared.release(id(model))   # the last holder: modeling's own function is back
    """

    def __init__(self) -> None:
        # (id(owner), name) -> (owner, name, the value before, its holders)
        self._entries: dict[tuple[int, str], tuple[Any, str, Any, set[Any]]] = {}

    def hold(self, owner: Any, name: str, make: Callable[[Any], Any], holder: Any) -> None:
        """Replace ``owner.name`` by ``make(current)`` unless it is held already, and count ``holder`` in."""
        key = (id(owner), name)
        if key not in self._entries:
            original = get_attr(owner, name)
            put_attr(owner, name, make(getattr(owner, name, None)))
            self._entries[key] = (owner, name, original, set())
        self._entries[key][3].add(holder)

    def release(self, holder: Any) -> None:
        """Let go of everything ``holder`` holds; what nobody holds any more is put back."""
        for key, (owner, name, original, holders) in list(self._entries.items()):
            holders.discard(holder)
            if not holders:
                put_attr(owner, name, original)
                del self._entries[key]

    def original(self, owner: Any, name: str) -> Any:
        """``owner.name`` as it was before it was held (as it is, when it is not held)."""
        entry = self._entries.get((id(owner), name))
        return getattr(owner, name) if entry is None else entry[2]

    def holders(self) -> set[Any]:
        """Everyone who holds something now."""
        return set().union(*(entry[3] for entry in self._entries.values()))

    def __bool__(self) -> bool:
        return bool(self._entries)
