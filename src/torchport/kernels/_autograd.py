"""Autograd inside a custom op's implementation: what :mod:`torchport.kernels.library` and the ops' own backwards
(``cross_entropy``, ``fused_linear_cross_entropy``, ``rope``) share.

The dispatcher runs a custom op's implementation below autograd, so a backward that differentiates the kernel's
forward must switch autograd recording back on (:func:`autograd_enabled`); and a custom op's outputs must have the
layout its fake implementation promised and share memory with none of its inputs (:func:`fresh`).

Importing this module registers nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["apply", "autograd_enabled", "fresh", "vjp"]


def _keys_excluded_below_autograd() -> torch._C.DispatchKeySet:
    """The keys the dispatcher excludes below autograd, found from an empty exclusion set: this module may be
    imported where some are excluded already (inside a compiler call or a custom op), and a difference taken there
    would miss them."""
    current = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), current - current), \
            torch._C._AutoDispatchBelowAutograd():
        return torch._C._dispatch_tls_local_exclude_set()


_AUTOGRAD_KEYS = _keys_excluded_below_autograd()


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Autograd recording inside a custom op's implementation, which the dispatcher runs below autograd.

    The recompute backward needs it: the kernel's forward must record a graph for ``torch.autograd.grad``. The
    dispatcher's other exclusions (autocast) stay as they are.
    """
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


class _NoGradients:
    """``needs_input_grad`` of :class:`_Discard`: False for every input."""

    __slots__ = ()

    def __getitem__(self, index: int) -> bool:
        return False


class _Discard:
    """The ``ctx`` an autograd Function's forward gets from :func:`apply` when no gradient can be asked for: no
    input needs a gradient, and whatever the forward saves or marks for its backward is dropped."""

    __slots__ = ()
    needs_input_grad = _NoGradients()

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        pass

    mark_dirty = mark_non_differentiable = save_for_backward

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def __setattr__(self, name: str, value: object) -> None:
        pass


_DISCARD = _Discard()


def apply(function: type[torch.autograd.Function], *args: object) -> object:
    """``function.apply(*args)`` where autograd records and a tensor argument requires a gradient; otherwise
    ``function.forward`` called directly with a context that keeps nothing. Inference (``torch.no_grad``, or inputs
    without gradients) then gets the same outputs without an autograd node built and discarded per call.

    Example:
        >>> y = apply(_NormFunction, x, weight, None, settings)
    """
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return function.apply(*args)
    return function.forward(_DISCARD, *args)


def fresh(out: torch.Tensor, like: torch.Tensor, inputs: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``out`` with the strides ``torch.empty_like(like)`` has (what the fake implementation promises the
    compiler) and sharing memory with none of ``inputs`` (a custom op's output may not alias its inputs).

    Copies only when needed: the references follow their input's layout, the Triton kernels write contiguous rows.
    """
    storage = out.untyped_storage().data_ptr()
    aliased = out.numel() > 0 and any(t is not None and storage == t.untyped_storage().data_ptr() for t in inputs)
    if not aliased and out.shape == like.shape:
        # torch.empty_like of a contiguous tensor has the row-major strides: the common case, without a meta tensor
        layout = _row_major(like.shape) if like.is_contiguous() else \
            torch.empty_like(like, dtype=out.dtype, device="meta").stride()
        if out.stride() == layout:
            return out
    copy = torch.empty_like(like, dtype=out.dtype)
    copy.copy_(out)
    return copy


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def vjp(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], inputs: Sequence[torch.Tensor | None],
        grads: Sequence[torch.Tensor], needs: Sequence[bool] | None = None) -> list[torch.Tensor | None]:
    """Gradients of ``fn(*inputs)`` for the upstream gradients ``grads`` (one per output), with respect to the
    inputs that ``needs`` marks (all by default): the kernel's forward runs again on detached inputs and its own
    backward differentiates it. None for an input that is None or not needed; zeros for one the output does not
    depend on."""
    needs = [True] * len(inputs) if needs is None else needs
    with autograd_enabled():
        leaves = [None if t is None else t.detach().requires_grad_(bool(need) and t.is_floating_point())
                  for t, need in zip(inputs, needs)]
        out = fn(*leaves)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        found = iter(torch.autograd.grad(outs, wanted, [g.to(o.dtype) for o, g in zip(outs, grads)],
                                         allow_unused=True) if wanted else ())
    result: list[torch.Tensor | None] = []
    for leaf in leaves:
        if leaf is None or not leaf.requires_grad:
            result.append(None)
            continue
        g = next(found)
        result.append(torch.zeros_like(leaf) if g is None else g)
    return result
