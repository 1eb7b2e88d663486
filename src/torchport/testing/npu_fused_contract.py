"""What every simulated torch_npu fused operator does first, and the backward of one without a derivative.

:func:`start` counts the call (in :data:`calls`, which tests read), fails on a chip that torch_npu does not document
the operator for, and returns the operator's documented limits; :func:`without_backward` makes an output whose
backward fails as autograd fails for a derivative that is not implemented.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch

from ..backends.npu import operator_limits
from .npu_state import state

__all__ = ["calls", "chip_family", "dtype_name", "start", "without_backward"]

calls: collections.Counter[str] = collections.Counter()


def start(name: str) -> dict[str, Any]:
    """Count the call, fail as torch_npu does on a chip without the operator; returns the operator's limits."""
    calls[name] += 1
    chip = state().chip
    reason = chip.lacks(name)
    if reason is not None:
        raise RuntimeError(f"{name}: NPU function error: the operator has no kernel for {chip.soc_version}: {reason} "
                           "(simulated chip, torchport.testing)")
    return operator_limits(name)


def chip_family() -> str:
    """The family of the simulated chip (``"A2"``, ``"310P"``...), which some limits depend on."""
    return state().chip.family


def dtype_name(t: torch.Tensor) -> str:
    """``t``'s dtype without the ``torch.`` prefix (``"bfloat16"``), as the operators' limits name dtypes."""
    return str(t.dtype).removeprefix("torch.")


class _NoDerivative(torch.autograd.Function):
    """Forward as given; the backward fails as autograd does for an operator without a derivative formula."""

    @staticmethod
    def forward(ctx: Any, name: str, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.name = name
        return out.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(f"the derivative for '{ctx.name}' is not implemented (torch_npu's derivatives.yaml has "
                           "no entry for it; simulated by torchport.testing)")


def without_backward(name: str, out: torch.Tensor, inputs: Iterable[Any]) -> torch.Tensor:
    """``out``, whose backward fails (as for an operator without a derivative) when an input requires grad."""
    grads = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not grads or not torch.is_grad_enabled():
        return out
    return _NoDerivative.apply(name, out.detach(), *grads)
