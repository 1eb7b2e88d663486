"""What an op's implementation is, and the checks implementations declare: a vendor fused operator present on the
device (:func:`fused_op_reason`), Triton installed. :mod:`torchport.kernels.registry` chooses among them and
re-exports these names.

Example:
    >>> from torchport.kernels.registry import fused_op_unavailable
    >>> fused_op_unavailable("npu_rms_norm", torch.device("cpu"))
    'the cpu software stack has no fused operator npu_rms_norm'
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from ..backends import get_backend

__all__ = ["Implementation", "InputError", "KernelError", "Unsupported", "fused_op", "fused_op_reason",
           "fused_op_unavailable", "triton_reason"]


class Unsupported(RuntimeError):
    """Raised by an implementation that cannot handle these arguments or this device (the message says why)."""


class InputError(ValueError):
    """Raised by an implementation that finds the caller's data invalid where only the device can see it (a target
    outside the classes, read on the device): the caller's error, which :func:`~torchport.kernels.registry.call`
    raises as it is, never a reason to fall back to another implementation."""


class KernelError(RuntimeError):
    """A forced implementation could not run; the message names the op, the implementation and the reason."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to compute an op.

    Attributes:
        op: the op's name (``"rms_norm"``).
        name: the implementation's name (``"reference"``, ``"triton"``, ``"npu"``).
        fn: the function; it takes the op's arguments and raises :class:`Unsupported` for arguments it cannot handle.
        devices: the device types it serves, or None for every device.
        priority: the highest-priority implementation serving a device is chosen in auto mode.
        requires: returns why the implementation cannot run on a device (a library or vendor operator is
            missing), or None when it can; checked once per device type.
        backward: ``(grads, needs, *args) -> gradients``, the backward of ``torch.ops.torchport.<op>`` (compiled
            graphs) with this implementation, from the forward's arguments alone (one upstream gradient per output;
            one gradient per tensor argument, None where ``needs`` is False); None: the custom op's backward runs
            the forward again with autograd (:mod:`torchport.kernels.library`).
    """

    op: str
    name: str
    fn: Callable[..., Any]
    devices: frozenset[str] | None
    priority: int
    requires: Callable[[torch.device], str | None] | None = None
    backward: Callable[..., Any] | None = None

    def serves(self, device_type: str) -> bool:
        return self.devices is None or device_type in self.devices

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None if self.requires is None else self.requires(device)


def triton_reason(device: torch.device) -> str | None:
    # Triton implementations import triton when first called; without it they could only fail there, so the
    # registry skips them (auto) or refuses them (forced) with this reason, and `torchport kernels` shows it.
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    return None


def fused_op(name: str, device: torch.device) -> Callable[..., Any]:
    """The vendor fused operator ``name`` on ``device``'s backend, or :class:`Unsupported` naming what is missing."""
    op = get_backend(device.type).fused_op(name)
    if op is None:
        raise Unsupported(f"the {device.type} software stack has no fused operator {name}")
    return op


def fused_op_unavailable(name: str, device: torch.device) -> str | None:
    """Why the vendor fused operator ``name`` cannot run on ``device``, or None when it can: the device's software
    stack lacks it, or its chip does (a vendor library defines every operator on every chip, and the call fails on
    a chip without a kernel for it; backends that know their chips say so through ``chip_lacks``)."""
    backend = get_backend(device.type)
    if backend.fused_op(name) is None:
        return f"the {device.type} software stack has no fused operator {name}"
    chip_lacks = getattr(backend, "chip_lacks", None)
    return None if chip_lacks is None else chip_lacks(name, device.index or 0)


def fused_op_reason(name: str) -> Callable[[torch.device], str | None]:
    """A ``requires`` check for :func:`register_kernel`: operator ``name`` must run on the device (its software stack
    has it and its chip runs it). A chip without it is an expected fallback, warned once, never a kernel failure."""
    return functools.partial(fused_op_unavailable, name)  # a partial: coverage reads which operator it needs
