"""The undo journal of a mode: every change :func:`torchport.enable` made, and how to put it back exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _patching
from .._patching import MISSING as Missing  # the one "no value" marker: a key or attribute that did not exist

__all__ = ["Journal", "Missing"]


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


class Journal(_patching.Journal):
    """Every change :func:`enable` made, in order, and how to put it back: dictionary entries (a module's
    ``_parameters``, ``_buffers``, ``_modules`` or ``__dict__``, a class's attributes) with their first value, and
    undo functions. Tensors that lived on a device are parked in host memory until they are put back (a mode that
    moves or casts weights would otherwise keep the device copies alive)."""

    def __init__(self) -> None:
        super().__init__()
        self._parked: dict[int, _Parked] = {}  # id(original) -> parked copy, while enable runs

    def _keep(self, original: Any) -> Callable[[], Any]:
        if not (isinstance(original, torch.Tensor) and original.device.type not in ("cpu", "meta")):
            return super()._keep(original)  # a host tensor (or any value) comes back by identity
        parked = self._parked.get(id(original))
        if parked is None:
            parked = self._parked[id(original)] = _Parked(original)
        return parked.restore

    def settled(self) -> None:
        """enable finished: originals no longer live under their ids."""
        self._parked.clear()

    def restore(self) -> list[str]:
        failures = super().restore()
        self._parked.clear()
        return failures
