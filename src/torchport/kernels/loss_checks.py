"""Argument checks of the cross-entropy ops (:mod:`.cross_entropy`, :mod:`.fused_linear_cross_entropy`, and their
custom ops): the targets, the reduction, label smoothing, and the custom ops' loss dtype. Each error names the op,
the argument and what is allowed."""

from __future__ import annotations

import torch

from . import registry
from .checks import capturing

__all__ = ["REDUCTIONS", "bad_target_error", "check_options", "check_reduction", "check_target_tensor",
           "check_targets", "loss_dtype_of", "mark_bad_targets"]

REDUCTIONS = ("mean", "sum", "none")


def check_targets(op: str, target: torch.Tensor, vocab: int,
                  ignore_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check that every target is in ``[0, vocab)`` or is ``ignore_index``; return the targets to use and the mask of
    bad ones the caller must mark in the loss (None when there is nothing to mark).

    Called eagerly, a bad target is a ``ValueError`` (:class:`~torchport.kernels.registry.InputError`) here that
    names the bad range and the allowed one (one host read of a flag: the kernels never see a bad target, and a
    device's state is never broken by a device-side assert).
    Where no host read is possible (while torch.compile traces, or while a graph is captured on the device's stream)
    the check stays on the device: rows with a bad target are treated as ignored, so that no kernel reads past the
    vocabulary, and :func:`mark_bad_targets` makes their loss NaN (every reduced loss NaN), so that a bad target is
    never silently a finite loss.
    """
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if not capturing(target.device):
        if bool(bad.any()):
            raise bad_target_error(op, vocab, ignore_index)
        return target, None
    return torch.where(bad, torch.full_like(target, ignore_index), target), bad


def bad_target_error(op: str, vocab: int, ignore_index: int) -> registry.InputError:
    """The error for a target outside ``[0, vocab)`` that is not ``ignore_index`` (a ``ValueError``)."""
    return registry.InputError(f"{op}: a target is below 0 or at least the vocabulary size {vocab}, and is not "
                               f"ignore_index={ignore_index}; targets must be class indices in [0, {vocab}) or "
                               "ignore_index")


def mark_bad_targets(loss: torch.Tensor, bad: torch.Tensor | None, reduction: str) -> torch.Tensor:
    """``loss`` with NaN where :func:`check_targets` found a bad target inside a compiled graph or a captured graph:
    per row for ``reduction="none"``, else the whole reduced loss."""
    if bad is None:
        return loss
    nan = torch.full((), float("nan"), dtype=loss.dtype, device=loss.device)
    if reduction == "none":
        return torch.where(bad.view(loss.shape), nan, loss)
    return torch.where(bad.any(), nan, loss)


def check_options(op: str, label_smoothing: float, reduction: str) -> None:
    check_reduction(op, reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing} must be in [0, 1]")


def check_target_tensor(op: str, target: torch.Tensor, expected: torch.Size, what: str) -> torch.Tensor:
    """``target`` as int64, after checking it is an integer tensor of shape ``expected``."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{op}: target must be a tensor, got {type(target).__name__}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"{op}: target has dtype {target.dtype}; allowed: integer class indices (int64, int32, ...)")
    if target.shape != expected:
        raise ValueError(f"{op}: target must have shape {list(expected)} ({what}), got {list(target.shape)}")
    return target.long()


def check_reduction(op: str, reduction: str) -> None:
    """``reduction`` is one of :data:`REDUCTIONS` (``op`` names the caller in the error: the op or its custom op,
    ``torchport::cross_entropy``)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction={reduction!r}; allowed: {', '.join(map(repr, REDUCTIONS))}")


def loss_dtype_of(x: torch.Tensor) -> torch.dtype:
    """The custom ops' loss dtype: float32, float64 for float64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
