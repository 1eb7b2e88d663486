"""A simulated Ascend NPU: tensors whose ``device.type`` is ``"npu"`` and whose arithmetic runs on the host.

It registers PyTorch's PrivateUse1 backend under the name ``npu`` (as torch_npu does) and installs a ``torch.npu``
module with torch_npu's public API (see :mod:`torchport.testing.npu_module`). Tensors are wrapper subclasses that
hold a CPU tensor; one ``__torch_dispatch__`` unwraps the arguments, runs the op on the CPU and wraps the results,
and one PrivateUse1 fallback does the same for factory functions (``torch.zeros(..., device="npu")``), so no op
is registered one by one. This module starts the device; its state (devices, memory, generators) is
:mod:`torchport.testing.npu_state`, its tensors and the path every operator on them takes are
:mod:`torchport.testing.npu_tensor`, and the operators declared missing are :mod:`torchport.testing.npu_unsupported`.

What it keeps faithful, because code under test depends on it:

- devices mix like on a real accelerator: an op on an ``npu`` tensor and a host tensor of one or more dimensions
  raises "Expected all tensors to be on the same device"; copies, ``.to()`` and indexing with host indices work;
- memory counters count the bytes of live simulated storages (views share), with a caching-allocator model
  (freed bytes stay reserved until ``empty_cache``), peaks, and an out-of-memory error past the device's size;
- each device has its own random generator, seeded by ``torch.manual_seed`` and ``torch.npu.manual_seed``;
- ``torch.autocast("npu")`` casts like CUDA's autocast (matmul-like ops to the low dtype; reductions, norms and
  losses to float32; mixed-dtype ops to the widest).
- operators can be declared missing (:func:`torchport.testing.unsupported_ops`): running one then fails as
  PyTorch's dispatcher fails for a device without a kernel ("Could not run 'aten::erfinv' with arguments from the
  'PrivateUse1' backend..."), or, with ``torch_npu_fallback=True``, runs on the host after torch_npu's warning, as
  torch_npu's own CPU fallback does (and fails, as torch_npu's does, when ``TORCH_NPU_FALLBACK_CPU_DISABLE`` is a
  non-zero integer); the npu backend's ``has_kernel`` and ``op_support`` agree with that, and a kernel registered
  for the operator on PrivateUse1 (:func:`torchport.compat.cpu_fallback`) runs instead, as the real dispatcher
  would run it.
- the device is one Ascend chip (:class:`torchport.backends.npu.ChipProfile`, Ascend910B3 unless
  ``TORCHPORT_SIMULATE=npu:<soc>`` or :func:`torchport.testing.simulated_chip` says otherwise): its name, cores and
  memory are what ``torch.npu`` reports; on a chip without bfloat16 (Ascend910A, Ascend310P) an operator computing
  on bfloat16 tensors fails (copies and views of them work), and a torch_npu fused operator the chip lacks fails
  when called (:mod:`torchport.testing.npu_fused_ops`).

Limits, all from PyTorch's Python backend mechanism: backward runs on ``npu:0`` only (the autograd engine sizes its
device queues from a C++ device guard that reports one device), ``torch.Generator("npu")`` cannot be made
(PrivateUse1 generators need a C++ hook), so :func:`torchport.generator` hands out a host generator for it, and
under a ``TorchDispatchMode`` ``torch.tensor(data, device="npu")`` fails an internal assertion of PyTorch's
trampoline for Python-registered kernels (seen with torch 2.13; ``.to("npu")`` works).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

from ..backends.npu import ChipProfile, chip_profile
from . import npu_pinned, npu_state, npu_tensor
from .npu_state import NPU, is_active, state
from .npu_tensor import SimulatedTensor
from .npu_tensor import _rebuild  # noqa: F401  (files saved by earlier releases name it here)
from .npu_unsupported import declare_unsupported, dispatcher_has, has_privateuse1_kernel, withdraw

__all__ = ["SimulatedTensor", "activate", "declare_unsupported", "is_active", "state", "use_chip", "withdraw"]

_activate_lock = threading.Lock()
_libraries: list[torch.library.Library] = []


def activate(device_count: int = 1, total_memory: int | None = None, soc: str | None = None) -> None:
    """Register the simulated NPU in this process (idempotent for the same device count and chip).

    ``soc`` names the chip (:func:`torchport.backends.npu.chip_profile`; None: the one already active, else
    Ascend910B3); ``total_memory`` defaults to the chip's memory.

    Raises:
        RuntimeError: a real torch_npu is imported, PrivateUse1 is already taken by another backend, or the
            simulated NPU is already active with another device count or chip.
        ValueError: an unknown ``soc`` (the message lists the known chips).
    """
    chip = None if soc is None else chip_profile(soc)
    with _activate_lock:
        if is_active():
            active = state()
            if active.device_count != device_count:
                raise RuntimeError(
                    f"the simulated NPU is already active with {active.device_count} device(s); "
                    f"asked for {device_count}. The device count is fixed for the life of the process."
                )
            if chip is not None and chip != active.chip:
                raise RuntimeError(
                    f"the simulated NPU is already active as {active.chip.soc_version}; asked for "
                    f"{chip.soc_version}. Tests switch chips with torchport.testing.simulated_chip()."
                )
            return
        if "torch_npu" in sys.modules:
            raise RuntimeError(
                "a real torch_npu is imported in this process, so the simulated NPU cannot start: PyTorch lets "
                "one backend take the 'npu' (PrivateUse1) name per process. Unset TORCHPORT_SIMULATE to use the "
                "real NPU."
            )
        taken = torch._C._get_privateuse1_backend_name()
        if taken != "privateuseone":
            raise RuntimeError(
                f"PrivateUse1 is already registered as {taken!r} in this process; the simulated NPU needs it"
            )
        if not 1 <= device_count <= 16:
            raise ValueError(f"device_count={device_count} is not allowed; use 1 to 16")

        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        from . import npu_module

        chip = chip or chip_profile()
        started = npu_state.start(device_count, chip.memory_bytes if total_memory is None else total_memory, chip)
        _setup_privateuseone_for_python_backend(NPU, backend_module=npu_module.build(started))
        sys.modules["torch.npu"] = torch.npu
        sys.modules["torch.npu.amp"] = torch.npu.amp

        _libraries.extend(npu_tensor.register())
        _libraries.extend(npu_module.register_autocast())
        npu_pinned.install()

        from ..backends import register_backend
        from ..backends.npu import NpuBackend

        @register_backend(NPU, replace=True)
        class SimulatedNpuBackend(NpuBackend):
            """The npu backend, except for what a Python-registered device cannot do."""

            safetensors_direct = False
            # PyTorch's Python backend hooks cannot provide a pinned allocator: pin_memory() and is_pinned() are
            # answered in Python (npu_pinned), and so are the pinned buffers torchport allocates
            pins_memory = True
            profiler_activity = None

            def empty_pinned(self, nbytes: int) -> torch.Tensor:
                return npu_pinned.empty_pinned(nbytes)  # torch.empty(pin_memory=True) needs the C++ allocator

            def versions(self) -> dict[str, str | None]:
                return {"torch_npu": None, "cann": None, "simulated": "torchport.testing"}

            def new_generator(self, index: int) -> torch.Generator:
                return torch.Generator()

            def fused_op(self, name: str) -> Any:
                from . import npu_fused_ops

                return npu_fused_ops.lookup(name)

            def has_kernel(self, op: str) -> bool | None:
                # every operator with a host kernel runs, except those declared missing (torchport.testing.
                # unsupported_ops); kernels registered on PrivateUse1 count, as they do for a real device
                if has_privateuse1_kernel(op):
                    return True
                return op not in state().missing and dispatcher_has(op, "CPU")

            @property
            def host_fallback(self) -> bool:  # type: ignore[override]
                # declared with torch_npu_fallback=True, and not turned off by TORCH_NPU_FALLBACK_CPU_DISABLE
                return state().host_fallback and NpuBackend.host_fallback.fget(self)


def use_chip(soc: str) -> ChipProfile:
    """Make the simulated device chip ``soc`` from now on; returns the chip it was. Device memory keeps its size.

    Raises:
        ValueError: an unknown ``soc`` (the message lists the known chips).
    """
    st = state()
    chip = chip_profile(soc)
    with st.lock:
        previous, st.chip = st.chip, chip
    return previous
