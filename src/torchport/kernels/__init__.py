"""Fused kernels with one API on every device: the implementation is chosen by the input tensor's device.

Each op has a plain-PyTorch ``reference`` (every device, and the fallback), a ``triton`` kernel for CUDA/ROCm, and
an ``npu`` implementation through torch_npu's fused operators where Ascend has one. ``TORCHPORT_KERNELS`` forces a
choice (see :mod:`torchport.kernels.registry`); :func:`table` shows what each op uses on this machine.

The ops, and what this module exports for each, come from their specs
(:class:`~torchport.kernels.spec.OpSpec`, declared in ``kernels/<op>.py``):

{ops}

Example:
    >>> import torchport
    >>> y = torchport.kernels.rms_norm(x, weight)
    >>> torchport.kernels.table()[0]
    {{'op': 'geglu', 'device': 'cpu', 'implementation': 'reference', ...}}
"""

from __future__ import annotations

import importlib

from ._table import table
from .registry import KernelError, Unsupported, list_kernels, list_specs, register_kernel, register_op
from .spec import OpSpec


def _exports() -> dict[str, object]:
    """Every op's public names (its spec's ``exports``), taken from the op's module."""
    found: dict[str, object] = {}
    for spec in list_specs().values():
        module = importlib.import_module(spec.call.__module__)
        found.update({name: getattr(module, name) for name in spec.exports})
    return found


def _ops_table() -> str:
    rows = [(f"``{spec.name}``", spec.summary, ", ".join(f"``{name}``" for name in spec.exports))
            for spec in list_specs().values()]
    header = ("op", "computes", "exports")
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    rule = "  ".join("=" * width for width in widths)
    lines = [rule, "  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip(), rule]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([*lines, rule])


globals().update(_exports())
__doc__ = __doc__.format(ops=_ops_table())
__all__ = sorted([*_exports(), "KernelError", "OpSpec", "Unsupported", "list_kernels", "list_specs",
                  "register_kernel", "register_op", "table"])
