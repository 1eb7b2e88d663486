"""Which operators a model runs, forward and backward, and how a target device runs each: :func:`coverage`.

The model runs once, forward then backward (the loss is the sum of its floating-point outputs), where it is: on the
CPU, or on the target device itself when it is there. A ``TorchDispatchMode`` records each operator overload that
reaches the dispatcher's backends, with its calls and phase. Each is then marked for the target device:

* **torchport kernel**: an operator of the ``torchport`` namespace (``torch.ops.torchport.rms_norm``...). What runs
  inside it (the vendor's fused operator on Ascend, Triton on a GPU, the reference elsewhere) is the kernel's own
  per-device choice, vouched for by the kernel registry, and is not listed.
* **cpu fallback**: :func:`torchport.compat.cpu_fallback` runs it on the CPU, or the device's library does so by
  itself (torch_npu runs every operator it has no kernel for on the CPU, warning once).
* **native**: the device has a kernel of its own, or PyTorch's composite kernel serves it (its parts are recorded
  and marked one by one), or it is a structured operator's functional or in-place variant whose out= variant the
  device has.
* **missing**: none of these; running it there fails.

Where the device's library is loaded, the dispatcher answers (:func:`torchport.compile.op_support.device_op_support`).
Where it is not, the backend's shipped operator list does (for Ascend: ``data/torch_npu_ops-<release>.txt``, torch_npu's
operator registration list of a named release; its header says what it covers and what not).

On an Ascend NPU the chip matters too (``soc=``, or the chip of the NPU present): the report then carries
:func:`torchport.compile.chip_coverage.chip_coverage`'s answer (each torchport kernel's torch_npu operator on that
chip, its dtypes and limits), each ``torchport::`` row says what runs for it there, and an operator that computes in a
dtype the chip lacks (bfloat16 on the 910A and 310P) is **missing**: it fails there.

Recording on another device than the target: where PyTorch builds an operator from others, the recording device's
choice is what gets recorded. Two cases are corrected, since they are where devices differ: an operator the target
registers itself (torch_npu has ``scaled_dot_product_attention``) is recorded whole, in place of its parts and their
backward; and a part PyTorch picks only for the CPU (``_scaled_dot_product_flash_attention_for_cpu``) is recorded
as the operator that picked it, which the target decomposes with its own choice. Other data-dependent choices of the
model (which branch its Python takes on the CPU) are recorded as the CPU takes them.

The report is :mod:`torchport.compile.coverage_report`'s, the target's answers are
:mod:`torchport.compile.coverage_target`'s, and the recording is :mod:`torchport.compile.coverage_recorder`'s.

Example:
    >>> report = torchport.compile.coverage(model, inputs, "npu", soc="Ascend310P3")
    >>> report.missing                # operators the NPU cannot run
    >>> report.print()                # a table; report.to_json() for machines
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..backends import get_backend
from ..verify.structure import call_model, leaves
from .coverage_recorder import Composites, Recorder
from .coverage_report import STATUSES, Coverage, OpRow
from .coverage_target import Target

__all__ = ["Coverage", "OpRow", "STATUSES", "coverage"]


def coverage(model: torch.nn.Module, inputs: Any, device: str | torch.device, *, backward: bool = True,
             soc: str | None = None) -> Coverage:
    """Run ``model`` on ``inputs`` forward and backward, record the operators it runs, and mark each for ``device``.

    Args:
        model: the model, wherever it is (the CPU, or ``device`` itself when that is present); it is not moved.
        inputs: a tensor (the one argument), a tuple or list (positional arguments) or a dict (keyword arguments).
        device: the target device type (``"npu"``, ``"cuda:1"``...); it need not be present.
        backward: also run the backward of the sum of the floating-point outputs (their gradients are discarded:
            the parameters' ``.grad`` are restored afterwards).
        soc: for ``"npu"``, the Ascend chip to report on (``"Ascend310P3"``; any known chip, on any machine); None:
            the chip of the NPU present (real or simulated), else no chip.

    Returns:
        A :class:`Coverage`: ``rows`` ordered missing first, ``missing``, ``to_json()``, ``print()``.

    Raises:
        ValueError: ``device`` is not a device type, or neither its library nor a shipped list can say which
            operators it has; ``soc`` is not a known chip, or is given for a device type other than ``"npu"``.
        NotImplementedError: running on the device, an operator that neither the device nor the CPU has; the
            message says which and what to do.

    Example:
        >>> report = coverage(model, torch.randint(0, 96, (2, 12)), "npu")
        >>> report.missing
        []
    """
    if isinstance(device, torch.device):
        kind = device.type
    else:
        from .._settings import parse_device_spec

        kind = parse_device_spec(device, "device")[0]
    from .chip_coverage import chip_coverage, resolve_chip

    target = Target(get_backend(kind, source="device"))
    chip = resolve_chip(kind, soc)
    if chip is not None:
        target.chip = chip_coverage(chip)
    recorded_on = _where(model, inputs)
    recorder = Recorder(target, recorded_on)
    saved = {p: p.grad for p in model.parameters()}
    saved.update({t: t.grad for _, t in leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad})
    try:
        with torch.enable_grad() if backward else torch.no_grad():
            with Composites(recorder) if recorded_on != kind else contextlib.nullcontext(), recorder:
                out = call_model(model, inputs)
            floating = [t for _, t in leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
                        and t.requires_grad]
            ran_backward = backward and bool(floating)
            if ran_backward:
                loss = sum(t.float().sum() for t in floating)
                recorder.phase = "backward"
                with recorder:
                    loss.backward()
    finally:
        for tensor, grad in saved.items():
            tensor.grad = grad
    dtypes = sorted({str(d).removeprefix("torch.") for found in recorder.dtypes.values() for d in found})
    return Coverage(kind, target.source, recorded_on, ran_backward, recorder.rows(), dtypes, target.chip)


def _where(model: torch.nn.Module, inputs: Any) -> str:
    for tensor in [*model.parameters(), *model.buffers(), *(t for _, t in leaves(inputs))]:
        if isinstance(tensor, torch.Tensor):
            return tensor.device.type
    return "cpu"
