"""``torch.compile(model, backend="torchport")``: torchport's FX passes, then the best compiler for the device.

Also the questions asked before a port: which aten ops does my model run, and which of them does the target
device lack (:func:`coverage`)?

Example:
    >>> compiled = torch.compile(model, backend="torchport")
    >>> torchport.compile.explain(model, x)        # which pass changed what
"""

from __future__ import annotations

import importlib

__all__ = ["backend", "coverage", "explain", "passes"]

# name -> (module, attribute); attribute None: the module itself
_LAZY = {
    "backend": ("dynamo_backend", "torchport_backend"),
    "explain": ("dynamo_backend", "explain"),
    "coverage": ("op_coverage", "coverage"),
    "passes": ("passes", None),
}


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attribute = _LAZY[name]
        module = importlib.import_module(f"{__name__}.{module_name}")
        return module if attribute is None else getattr(module, attribute)
    raise AttributeError(f"module 'torchport.compile' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
