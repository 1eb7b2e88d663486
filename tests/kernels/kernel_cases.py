"""Helpers of the kernel tests: call an implementation directly, compare with a float64 reference.

Implementations are called under a forced ``TORCHPORT_KERNELS`` setting, so a failure (forward or backward) raises
instead of falling back to the reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import torchport
from torchport.backends import get_backend
from torchport.kernels import registry, spec

# Largest relative error ||out - ref|| / ||ref|| against a float64 reference, per dtype of the tensors under test:
# the op specs' default (torchport.kernels.spec.TOLERANCE says why).
TOLERANCE = spec.TOLERANCE


@contextlib.contextmanager
def forced(name: str) -> Iterator[None]:
    with torchport.settings.override(kernels=name):
        yield


def call(op: str, name: str, *args: Any) -> Any:
    """Run implementation ``name`` of ``op`` directly, forced (so a failing backward raises); skip the test where
    the implementation cannot run on the tensors' device (a chip without the vendor's operator) or refuses these
    arguments (:class:`~torchport.kernels.registry.Unsupported`: outside the vendor operator's limits on this chip).
    Tests that expect the refusal call ``registry.implementation(op, name).fn`` themselves."""
    impl = registry.implementation(op, name)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    reason = impl.unavailable_reason(device) if device is not None and impl.serves(device.type) else None
    if reason is not None:
        pytest.skip(f"{op}: {name} cannot run on {device} ({reason})")
    with forced(name):
        try:
            return impl.fn(*args)
        except registry.Unsupported as exc:
            pytest.skip(f"{op}: {name} refuses these arguments on {device} ({exc})")


def call_backward(op: str, name: str, grads: tuple[torch.Tensor, ...], needs: tuple[bool, ...], *args: Any) -> Any:
    """Run implementation ``name``'s own backward of ``op`` (what a compiled graph's
    ``torch.ops.torchport.<op>_backward`` runs: gradients from the forward's arguments alone) directly, forced;
    skipped where it has none (that implementation's compiled backward is the recompute one) or cannot run."""
    impl = registry.implementation(op, name)
    if impl.backward is None:
        pytest.skip(f"{op}: {name} has no backward of its own (a compiled graph recomputes its forward)")
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    reason = impl.unavailable_reason(device) if impl.serves(device.type) else None
    if reason is not None:
        pytest.skip(f"{op}: {name} cannot run on {device} ({reason})")
    with forced(name), torch.no_grad():
        return impl.backward(grads, needs, *args)


def needs_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Skip where ``device`` does not compute in ``dtype`` (bfloat16 on an Ascend910A or 310P, by the dtype probe)."""
    if not get_backend(device.type).dtype_works(dtype, device.index or 0):
        pytest.skip(f"{dtype} does not work on {device} (dtype probe)")


@contextlib.contextmanager
def on_chip(soc: str) -> Iterator[None]:
    """Simulate Ascend chip ``soc`` in the block, for a test of what that chip does; skipped on a real NPU."""
    from torchport.testing import is_simulating, simulated_chip

    if not is_simulating():
        pytest.skip(f"simulates an {soc}; this NPU is a real one")
    with simulated_chip(soc):
        yield


def needs_fused(device: torch.device, name: str) -> None:
    """Skip where the vendor fused operator ``name`` cannot run on ``device`` (its software stack or chip lacks it)."""
    reason = registry.fused_op_unavailable(name, device)
    if reason is not None:
        pytest.skip(reason)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, with ||ref|| floored at 1e-2 per element (inputs are of order 1): a gradient that is zero in exact
    arithmetic (RMSNorm's dx for one column) is compared by its absolute error."""
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    diff = (out - ref).norm().item()
    scale = max(ref.double().norm().item(), 1e-2 * ref.numel() ** 0.5)
    return diff / scale if scale > 0 else diff


def check_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out.detach().cpu()).all(), f"{name}: non-finite values"
    err = relative_error(out, ref)
    assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.3g} > {TOLERANCE[dtype]:.1g} ({dtype})"


def leaf(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).detach().requires_grad_()


def gradients(fn: Callable[..., Any], inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> tuple[Any, list[Any]]:
    """Run ``fn(*inputs)``, back-propagate ``grads`` and return (outputs, input gradients)."""
    out = fn(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    torch.autograd.backward(outs, [g.to(o.device, o.dtype) for o, g in zip(outs, grads)])
    return out, [t.grad for t in inputs]
