"""TorchScript under the shim: ``torch.jit.script`` compiles a call to a function the shim replaced as the operator
that function stands for.

TorchScript maps each of torch's built-in functions to its operator through a table keyed by the function object
(``torch.jit._builtins``). The shim replaces some of them (the factory functions, to send ``device="cuda"`` to the
target) by Python functions, which the table does not know: TorchScript then tries to compile their source and fails
(``inspect`` finds none behind a built-in), so even torch's own scripted code, such as the functional optimizers that
``torch.distributed.optim`` compiles at import, would stop the program. Each replacement is entered in the table
under its original's operator while the shim is active, and removed by :func:`uninstall`.

Scripted code then runs the operators as written, without the shim's Python layer: a device named inside a scripted
function is not redirected (pass the device in as an argument, as device-agnostic code does). ``torch.jit.trace``
runs the Python code, so the shim redirects what it records.
"""

from __future__ import annotations

from typing import Any

from .redirect import Patcher

__all__ = ["install", "uninstall"]


def install(patcher: Patcher) -> list[Any]:
    """Enter every replacement ``patcher`` made of a TorchScript built-in in TorchScript's table, under the
    original's operator. Returns the replacements entered, for :func:`uninstall` (holding them keeps their ids
    from being reused while they are in the table).

    Example:
        >>> entered = install(patcher)   # after the shim's patches are in place
    """
    from torch.jit import _builtins

    table = _builtins._get_builtin_table()
    entered = []
    for owner, name in patcher.patched():
        replacement = getattr(owner, name, None)
        original = getattr(replacement, "__wrapped__", None)
        operator = table.get(id(original)) if original is not None else None
        if operator is not None and id(replacement) not in table:
            table[id(replacement)] = operator
            entered.append(replacement)
    return entered


def uninstall(entered: list[Any]) -> None:
    """Take the replacements :func:`install` entered out of TorchScript's table again."""
    from torch.jit import _builtins

    table = _builtins._get_builtin_table()
    for replacement in entered:
        table.pop(id(replacement), None)
    entered.clear()
