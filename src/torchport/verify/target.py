"""Command-line targets: ``package.module:factory`` or ``path/to/file.py:factory``, a function that returns
``(model, inputs)``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TargetError", "load_target", "unpack"]


class TargetError(ValueError):
    """A target that cannot be used: malformed, not found, not callable, or not returning ``(model, inputs)``."""


def load_target(spec: str) -> Callable[..., Any]:
    """Import the factory named by ``package.module:factory`` (the current directory is searched first, as with
    ``python -m``) or ``path/to/file.py:factory``.

    Raises:
        TargetError: the spec is malformed, the module or file cannot be found, or the name is not a callable in it.

    Example:
        >>> factory = load_target("examples/verify_target.py:factory")
        >>> model, inputs = unpack(factory(), "factory()")
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise TargetError(f"TARGET={spec!r} is not package.module:factory or path/to/file.py:factory")
    if where.endswith(".py") or "/" in where or os.sep in where:
        if not os.path.isfile(where):
            raise TargetError(f"TARGET={spec!r}: file {where!r} does not exist (looked in {os.getcwd()})")
        module = _import_file(where)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name is None or not where.startswith(exc.name):
                raise  # the target exists but imports something missing: show its own traceback
            raise TargetError(f"TARGET={spec!r}: no module named {exc.name!r} (sys.path starts with "
                             f"{sys.path[0]!r}); give an importable module or a path ending in .py") from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        what = "is not callable" if factory is not None else "does not exist"
        raise TargetError(f"TARGET={spec!r}: {name!r} {what} in {module.__name__}; its functions and classes: "
                         f"{', '.join(found) or 'none'}")
    return factory


def _import_file(path: str) -> Any:
    name = f"_torchport_target_{os.path.splitext(os.path.basename(path))[0]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)  # the file's siblings import as they would when it runs as a script
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        sys.path.remove(folder)
    return module


def unpack(result: Any, source: str) -> tuple[torch.nn.Module, Any]:
    """Check that a factory's result is ``(model, inputs)`` with a ``torch.nn.Module`` first, and return it.

    Example:
        >>> model, inputs = unpack(factory(), "examples/verify_target.py:factory")
    """
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module):
        return result
    if isinstance(result, tuple):
        got = f"a tuple of {len(result)}: ({', '.join(type(item).__name__ for item in result)})"
    else:
        got = f"a {type(result).__name__}"
    raise TargetError(f"{source} must return (model, inputs), a torch.nn.Module and the inputs to call it with "
                     f"(a tensor, a tuple of arguments or a dict of keyword arguments); it returned {got}")
