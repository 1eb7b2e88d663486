"""Test helpers, above all the simulated Ascend NPU.

Activate it in tests (the ``npu`` device fixture does) or with ``TORCHPORT_SIMULATE=npu``; never in production code.

Example:
    >>> import torchport.testing
    >>> torchport.testing.simulate_npu()
    >>> torch.ones(2, device="npu").device
    device(type='npu', index=0)
"""

from __future__ import annotations

from .simulated_npu import SimulatedTensor, is_active

__all__ = ["simulate_npu", "is_simulating", "SimulatedTensor"]


def simulate_npu(device_count: int = 1, total_memory: int = 64 * 1024**3) -> None:
    """Register the simulated NPU in this process (once; a second call with the same count does nothing).

    Args:
        device_count: how many ``npu`` devices to simulate (backward runs on ``npu:0`` only).
        total_memory: bytes of memory per simulated device (64 GiB, as on a 910B, by default).
    """
    from . import simulated_npu

    simulated_npu.activate(device_count, total_memory)


def is_simulating() -> bool:
    """Whether the simulated NPU is active in this process."""
    return is_active()
