"""Test helpers, above all the simulated Ascend NPU.

Activate it in tests (the ``npu`` device fixture does) or with ``TORCHPORT_SIMULATE=npu`` (``npu:Ascend310P3`` for
another chip: :func:`torchport.backends.npu.npu_chip_profiles` lists them); never in production code.

Example:
    >>> import torchport.testing
    >>> torchport.testing.simulate_npu()
    >>> torch.ones(2, device="npu").device
    device(type='npu', index=0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from .simulated_npu import SimulatedTensor, is_active

__all__ = ["simulate_npu", "simulated_chip", "is_simulating", "unsupported_ops", "SimulatedTensor"]


def simulate_npu(device_count: int = 1, total_memory: int | None = None, soc: str | None = None) -> None:
    """Register the simulated NPU in this process (once; a second call with the same count and chip does nothing).

    Args:
        device_count: how many ``npu`` devices to simulate (backward runs on ``npu:0`` only).
        total_memory: bytes of memory per simulated device (default: the chip's, 64 GiB on an Ascend910B3).
        soc: the chip, by the name torch_npu reports (``"Ascend310P3"``; see
            :func:`torchport.backends.npu.npu_chip_profiles`); default Ascend910B3, or the chip already simulated.

    Raises:
        ValueError: an unknown ``soc``; the message lists the known chips.
    """
    from . import simulated_npu

    simulated_npu.activate(device_count, total_memory, soc)


@contextlib.contextmanager
def simulated_chip(soc: str) -> Iterator[Any]:
    """Simulate chip ``soc`` inside a ``with`` block (the simulated NPU must be active); yields its profile.

    What torchport remembers per device is forgotten on entry and exit, as on a move to another machine: the kernel
    registry's choices and warnings (:func:`torchport.kernels.registry.refresh`), the dtype probes and the fused
    attention operators found.

    Example:
        >>> with torchport.testing.simulated_chip("Ascend310P3") as chip:
        ...     torch.npu.is_bf16_supported()
        False
    """
    from . import simulated_npu

    previous = simulated_npu.use_chip(soc)
    _forget_device_facts()
    try:
        yield simulated_npu.state().chip
    finally:
        simulated_npu.use_chip(previous.soc_version)
        _forget_device_facts()


def _forget_device_facts() -> None:
    import sys

    from ..backends import get_backend
    from ..kernels import registry

    registry.refresh()
    get_backend("npu")._probes.clear()
    attention = sys.modules.get("torchport.attention")
    if attention is not None:
        attention._operators.clear()
        attention._broken.clear()


def is_simulating() -> bool:
    """Whether the simulated NPU is active in this process."""
    return is_active()


@contextlib.contextmanager
def unsupported_ops(ops: Iterable[Any], *, torch_npu_fallback: bool = False) -> Iterator[None]:
    """Simulate an NPU software stack without kernels for ``ops``, inside a ``with`` block.

    Running one of them on an ``npu`` tensor then raises what PyTorch's dispatcher raises for a device without a
    kernel: ``NotImplementedError: Could not run 'aten::erfinv' with arguments from the 'PrivateUse1' backend...``.
    With ``torch_npu_fallback=True`` it warns and runs on the host instead, as torch_npu (2.1 and later) does for
    operators it lacks. ``torchport.compile.op_support.device_op_support("npu", op)`` answers accordingly
    ("missing" or "host"), and a kernel registered for the operator on PrivateUse1 (as
    :func:`torchport.compat.cpu_fallback` registers) runs in its place, as on a real device.
    Blocks nest; the innermost ``torch_npu_fallback`` applies.

    Args:
        ops: operator names, ``"aten::erfinv"`` for every overload or ``"aten::add.Tensor"`` for one
            (``"aten::erfinv.default"`` for the default one), or ``torch.ops`` objects. A functional or in-place
            overload of a structured operator calls its out= overload, so it stays runnable unless that one is
            declared too (declare the operator without an overload to take all of them).
        torch_npu_fallback: run them on the host with torch_npu's warning instead of failing.

    Raises:
        ValueError: a name that is not an operator of this torch, one the simulation itself needs (copies,
            allocation, views), or one with no kernel of its own on any device (a composite of other operators).

    Example:
        >>> with torchport.testing.unsupported_ops({"aten::erfinv"}):
        ...     torch.ones(2, device="npu").erfinv()
        NotImplementedError: Could not run 'aten::erfinv' with arguments from the 'PrivateUse1' backend...
    """
    from . import simulated_npu

    token = simulated_npu.declare_unsupported(ops, torch_npu_fallback)
    try:
        yield
    finally:
        simulated_npu.withdraw(token)
