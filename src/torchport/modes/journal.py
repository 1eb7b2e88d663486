"""The undo journal of a mode: every change :func:`torchport.enable` made, and how to put it back exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Journal", "Missing"]


class Missing:
    """No entry (a key that did not exist before)."""


class _Parked:
    """A tensor that lived on a device, kept as a host copy while the mode is on; :meth:`restore` makes the same
    tensor on its device again (once: slots that shared it share the copy)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device, self.requires_grad = tensor.device, tensor.requires_grad
        self.is_parameter = isinstance(tensor, nn.Parameter)
        self.host = tensor.detach().to("cpu", copy=True)
        self.grad = None if tensor.grad is None else tensor.grad.detach().to("cpu", copy=True)
        self._restored: torch.Tensor | None = None

    def restore(self) -> torch.Tensor:
        if self._restored is None:
            data = self.host.to(self.device)
            tensor = nn.Parameter(data, requires_grad=self.requires_grad) if self.is_parameter else data
            if self.grad is not None:
                tensor.grad = self.grad.to(self.device)
            self._restored = tensor
        return self._restored


def _on_device(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta")


class Journal:
    """Every change :func:`enable` made, in order, and how to put it back: dictionary entries (a module's
    ``_parameters``, ``_buffers``, ``_modules`` or ``__dict__``, a class's attributes) with their first value, and
    undo functions. Tensors that lived on a device are parked in host memory until they are put back."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []
        self._recorded: set[tuple[int, Any]] = set()
        self._parked: dict[int, _Parked] = {}  # id(original) -> parked copy, while enable runs

    def undo(self, step: Callable[[], None]) -> None:
        """Run ``step`` when the mode is disabled (steps run last-registered first)."""
        self._steps.append(step)

    def remember(self, table: dict, key: Any) -> None:
        """Keep ``table[key]`` as it is now, to put it back at disable (only the first value counts)."""
        slot = (id(table), key)
        if slot in self._recorded:
            return
        self._recorded.add(slot)
        original = table.get(key, Missing)
        if _on_device(original):
            parked = self._parked.get(id(original))
            if parked is None:
                parked = self._parked[id(original)] = _Parked(original)
            saved: Callable[[], Any] = parked.restore
        else:
            saved = lambda: original  # noqa: E731 - a host tensor (or any value) comes back by identity
        self._steps.append(lambda: _put(table, key, saved()))

    def set(self, table: dict, key: Any, value: Any) -> None:
        """``table[key] = value`` (``Missing`` deletes the key), remembering the first value."""
        self.remember(table, key)
        _put(table, key, value)

    def set_attr(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value`` for a class or module object, remembering the first value."""
        original = owner.__dict__.get(name, Missing)
        self._steps.append(lambda: _put_attr(owner, name, original))
        setattr(owner, name, value)

    def settled(self) -> None:
        """enable finished: originals no longer live under their ids."""
        self._parked.clear()

    def run(self) -> list[str]:
        """Undo every change, last first; returns the failures (each is tried)."""
        failures = []
        while self._steps:
            step = self._steps.pop()
            try:
                step()
            except Exception as exc:  # keep undoing the rest; the caller reports what failed
                failures.append(f"{type(exc).__name__}: {exc}")
        self._recorded.clear()
        self._parked.clear()
        return failures


def _put(table: dict, key: Any, value: Any) -> None:
    if value is Missing:
        table.pop(key, None)
    else:
        table[key] = value


def _put_attr(owner: Any, name: str, value: Any) -> None:
    if value is Missing:
        if name in owner.__dict__:
            delattr(owner, name)
    else:
        setattr(owner, name, value)
