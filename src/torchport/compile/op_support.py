"""Which operators a device runs, as its library registers them with PyTorch's dispatcher.

A backend states the device facts (:attr:`~torchport.backends.Backend.dispatch_key`,
:attr:`~torchport.backends.Backend.host_fallback`, :meth:`~torchport.backends.Backend.has_kernel`); this module
turns them into an answer per operator for :func:`torchport.compile.coverage`, :func:`torchport.compat.cpu_fallback`
and the simulated NPU. It imports nothing but torch and the backend registry.

Example:
    >>> from torchport.compile.op_support import device_op_support
    >>> device_op_support("cpu", "aten::erfinv")
    'native'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..backends import Backend, get_backend

__all__ = ["device_op_support", "op_support", "operator_overloads"]

# PyTorch's kernels that serve every device: written with other operators, which are dispatched one by one.
_EVERY_DEVICE = ("CompositeImplicitAutograd", "CompositeExplicitAutograd")


def _dispatcher_has(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except RuntimeError:  # no such operator in this torch
        return False


def op_support(op: str, has_kernel: Callable[[str], bool | None], host_fallback: bool = False) -> str | None:
    """How a device runs the operator ``op``, given which operators its library has kernels for.

    ``"native"``: a kernel of the device's own, or one of PyTorch's that serves every device (a composite kernel,
    or the functional and in-place variants of a structured operator, which call its out= variant: native when the
    device has that); ``"host"``: no kernel, but the device's library runs it on the CPU (``host_fallback``) and
    the CPU has one; ``"missing"``: neither; None: ``has_kernel`` cannot tell.

    Example:
        >>> op_support("aten::add_.Tensor", lambda op: op == "aten::add.out")
        'native'
    """
    own = has_kernel(op)
    if own is None:
        return None
    if own or any(_dispatcher_has(op, key) for key in _EVERY_DEVICE):
        return "native"
    if _dispatcher_has(op, "CompositeExplicitAutogradNonFunctional"):
        out = _out_variant(op)
        if out is not None and has_kernel(out):
            return "native"
    return "host" if host_fallback and _dispatcher_has(op, "CPU") else "missing"


def device_op_support(device: Backend | str, op: str) -> str | None:
    """How a device type runs ``op``: ``"native"``, ``"host"``, ``"missing"`` or None (see :func:`op_support`),
    from its backend's kernels and host fallback.

    Example:
        >>> device_op_support("cpu", "aten::erfinv")
        'native'
    """
    backend = get_backend(device) if isinstance(device, str) else device
    return op_support(op, backend.has_kernel, backend.host_fallback)


_OPERATOR_FORM = "'namespace::name' (every overload) or 'namespace::name.overload', e.g. 'aten::add.Tensor'"


def operator_overloads(entry: Any) -> list[str]:
    """The overloads an operator name or ``torch.ops`` object stands for, as the dispatcher names them (the default
    overload without a suffix): ``"aten::erfinv"`` and ``torch.ops.aten.erfinv`` give every overload,
    ``"aten::erfinv.default"`` and ``torch.ops.aten.erfinv.default`` give ``["aten::erfinv"]``.

    Raises:
        ValueError: not an operator of this torch, or not written in one of those forms.

    Example:
        >>> operator_overloads("aten::add.Tensor")
        ['aten::add.Tensor']
    """
    if isinstance(entry, torch._ops.OpOverload):
        entry = f"{entry._schema.name}.{entry._overloadname}"
    elif isinstance(entry, torch._ops.OpOverloadPacket):
        entry = entry._qualified_op_name
    if not isinstance(entry, str) or "::" not in entry:
        raise ValueError(f"{entry!r} is not an operator: write {_OPERATOR_FORM}, or pass torch.ops.aten.add.Tensor")
    namespace, _, rest = entry.partition("::")
    name, dot, overload = rest.partition(".")
    try:
        overloads = getattr(getattr(torch.ops, namespace), name).overloads()
    except (AttributeError, RuntimeError):
        raise ValueError(f"{entry!r}: torch {torch.__version__} has no operator {namespace}::{name}; write "
                         f"{_OPERATOR_FORM}") from None
    known = set(torch._C._dispatch_get_all_op_names())  # without TorchScript's scalar overloads (aten::add.int)
    names = {o: f"{namespace}::{name}" + ("" if o == "default" else f".{o}") for o in overloads}
    names = {o: qualified for o, qualified in names.items() if qualified in known}
    if dot and overload not in names:
        raise ValueError(f"{entry!r}: {namespace}::{name} has no overload {overload!r} that the dispatcher runs; its "
                         f"overloads: {', '.join(names)}")
    return [names[overload]] if dot else list(names.values())


def _out_variant(op: str) -> str | None:
    """The out= overload that a structured operator's functional or in-place overload calls: aten::add.Tensor and
    aten::add_.Tensor call aten::add.out."""
    namespace, _, rest = op.partition("::")
    name, _, overload = rest.partition(".")
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    try:
        schema = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")._schema
        packet = getattr(getattr(torch.ops, namespace), base)
    except (AttributeError, RuntimeError):
        return None
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    for candidate in packet.overloads():
        arguments = getattr(packet, candidate)._schema.arguments
        if any(a.is_out for a in arguments) and [(a.name, str(a.type)) for a in arguments if not a.is_out] == wanted:
            return f"{namespace}::{base}.{candidate}"
    return None
