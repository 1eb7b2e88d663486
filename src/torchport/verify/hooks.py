"""Forward hooks on every module of a model: each call gets a name, and a failure names the module that raised."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

__all__ = ["ROOT", "Recorder"]

#: The name rows use for the model itself (its qualified name is the empty string).
ROOT = "(root)"


class Recorder:
    """Calls ``on_output(call_name, module, output)`` after every module's forward, in execution order.

    A module's first call is named by its qualified name (``encoder.layers.0.attn``), later calls ``name#2``,
    ``name#3``... The model itself is :data:`ROOT`. Modules registered under two names keep the first.
    While a forward runs, :meth:`running` says which modules have started and not finished: after an exception,
    the last of them is the one that raised.

    Example:
        >>> with Recorder(model, lambda call, module, out: print(call)):
        ...     model(x)
    """

    def __init__(self, model: torch.nn.Module, on_output: Callable[[str, torch.nn.Module, Any], None]) -> None:
        self._names = {id(module): name or ROOT for name, module in model.named_modules()}
        self._on_output = on_output
        self._calls: Counter[str] = Counter()
        self._stack: list[tuple[str, torch.nn.Module]] = []
        self._handles: list[Any] = []
        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._exit))

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append((self._names[id(module)], module))

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # pop down to this module: entries above it belong to children whose exception the model caught itself
        while self._stack and self._stack.pop()[1] is not module:
            pass
        name = self._names[id(module)]
        self._calls[name] += 1
        count = self._calls[name]
        self._on_output(name if count == 1 else f"{name}#{count}", module, output)

    def running(self) -> list[tuple[str, torch.nn.Module]]:
        """(name, module) of the modules whose forward started and has not returned, outermost first."""
        return list(self._stack)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()
