"""One switch: ``torchport.enable("speed" | "balanced" | "memory", model=None)`` and ``torchport.disable()``.

Each mode composes what torchport already has, and reports exactly what it changed:

``balanced``
    the device's best dtype (:func:`torchport.dtype`), torchport's fused kernels in Hugging Face models
    (:func:`torchport.patch`), the device's best attention (:func:`torchport.attention.best`).
``speed``
    balanced, plus TF32 for float32 matmuls and convolutions where the device has it (the backend says; CUDA from
    Ampere on), plus ``torch.compile(backend="torchport")`` where the model compiles cleanly: ``torch._dynamo.explain``
    on an example finds no graph break. The model is patched first: its patched forwards call torchport's kernels
    as ``torch.library`` custom ops, which the compiled graph keeps (the compiler fuses everything around them).
``memory``
    balanced, plus weight-only low-bit weights (:func:`torchport.quantize` in
    :func:`torchport.quant.default_format`; ``lm_head``, embeddings and tied weights stay as they are), activation
    checkpointing, and, for a model on the host that is larger than the device budget, :func:`torchport.offload`.
    The dtype is never widened in memory mode (a bfloat16 model on a CPU without native bfloat16 stays bfloat16).

``enable(mode)`` (no model) sets process-wide switches that reach the models the program builds afterwards, which is
what ``torchport run`` with ``TORCHPORT_MODE`` does: transformers' classes are patched
(:func:`torchport.patch_transformers`), models are built with the best attention and a flash-attention request that
cannot run here gets the best available one (:func:`torchport.attention.install_hook`), ``from_pretrained`` loads in
the best dtype unless given one, plus TF32 in speed mode, and in memory mode ``from_pretrained`` returns models with
low-bit weights and activation checkpointing. ``enable(mode, model)`` changes that model in place, plus the
process-wide flags its speed depends on (TF32); nothing reaches other models. The choices are made for ``device=``
(default :func:`torchport.device`; ``torchport run --device`` passes its target).

``disable()`` undoes everything ``enable`` did, exactly: parameters and buffers (their values, dtypes, devices,
``requires_grad`` and tying; a model that lived on the host gets its very tensors back, one on a device gets copies
of the originals, which waited in host memory), replaced modules, forwards, attention implementations, activation
checkpointing flags and hooks, the compiled forward, patched classes, the attention hook, ``from_pretrained``, and
TF32. Models built while a global mode was on keep what they were built with (dtype, attention, low-bit weights);
the patched classes go back, so they run transformers' own forwards again. Parameters are replaced, not changed in
place: create optimizers after ``enable`` (and again after ``disable``).

Example:
    >>> report = torchport.enable("balanced", model)
    >>> print(report)                        # one row per setting: before, after, note
    >>> torchport.disable()                  # the model and the process as they were
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _settings
from .._unwrap import transformers_model
from ..device import DeviceLike, resolve
from ..device import device as default_device
from . import memory, process, steps
from .journal import Journal
from .report import Change, Report
from .steps import StepContext

Step = Callable[[StepContext], None]

__all__ = ["MODES", "Change", "Report", "active", "disable", "enable"]

logger = logging.getLogger("torchport")

MODES = _settings.MODES

# What each mode does, in order: to a model given to enable(mode, model), and to the process without one. Each step
# takes the StepContext and adds one report row.
MODEL_STEPS: dict[str, tuple[Step, ...]] = {
    "balanced": (steps.step_dtype, steps.step_attention, steps.step_kernels),
    # patched forwards call torchport's custom ops under torch.compile, so speed mode compiles the patched model
    "speed": (steps.step_dtype, steps.step_attention, steps.step_kernels, steps.step_tf32, steps.step_compile),
    "memory": (steps.step_dtype, steps.step_attention, steps.step_kernels, memory.step_quantize,
               memory.step_checkpointing, memory.step_placement),
}
PROCESS_STEPS: dict[str, tuple[Step, ...]] = {
    "balanced": (process.step_transformers,),
    "speed": (process.step_transformers, steps.step_tf32, steps.note_compile),
    "memory": (process.step_transformers, memory.note_placement),
}


@dataclasses.dataclass
class _Active:
    report: Report
    journal: Journal
    model: nn.Module | None


_lock = threading.RLock()
_active: _Active | None = None


def _check_mode(mode: str | None) -> str:
    if mode is None:
        mode = _settings.value("mode")
        if mode is None:
            raise ValueError(f"torchport.enable: no mode given and TORCHPORT_MODE is not set; modes: "
                             f"{', '.join(MODES)}")
        return mode
    if not isinstance(mode, str) or mode.strip().lower() not in MODES:
        raise ValueError(f"torchport.enable: {mode!r} is not a mode; modes: {', '.join(MODES)}")
    return mode.strip().lower()


def enable(mode: str | None = None, model: nn.Module | None = None, *, device: DeviceLike = None,
           example: Any = None, budget: int | float | str | None = None) -> Report:
    """Switch torchport to ``mode`` for ``model`` (changed in place), or, without a model, for the models the
    program builds from now on (see the module docstring for what each mode changes and what ``model=None`` means).

    Args:
        mode: ``"speed"``, ``"balanced"`` or ``"memory"``; None reads ``TORCHPORT_MODE``.
        model: a model on one device (a transformers model, a PEFT model, or any ``nn.Module``); memory mode also
            takes a model on the host and places it on ``device``, offloading blocks when its weights exceed
            ``budget``.
        device: the device the models run on (default :func:`torchport.device`): what the choices are made for
            without a model, and where memory mode places a model that is on the host.
        example: speed mode: inputs to check that the model compiles cleanly (a tensor, a tuple of positional
            arguments, or a dict of keyword arguments); transformers models with ``input_ids`` get one of 8 tokens.
        budget: memory mode: device bytes for the weights, in :func:`torchport.offload`'s forms (default 0.8 of
            the free device memory).

    Returns:
        A :class:`Report`: every setting, before and after, and what was left as it was and why.

    Raises:
        ValueError: an unknown mode (the valid ones are listed), a model on the meta device or on several devices.
        RuntimeError: a mode is already enabled (call :func:`disable` first).
        TypeError: ``model`` is not an ``nn.Module`` (or is a ``torch.compile`` wrapper).

    If a step fails, everything done so far is undone before the error is raised.

    Example:
        >>> print(torchport.enable("speed", model))
    """
    global _active
    mode = _check_mode(mode)
    if example is not None and (mode != "speed" or model is None):
        raise ValueError("torchport.enable: example= is the input speed mode compiles a given model with; "
                         f"enable({mode!r}{', model' if model is not None else ''}) takes none")
    if budget is not None and (mode != "memory" or model is None):
        raise ValueError("torchport.enable: budget= is the device memory memory mode fits a given model into; "
                         f"enable({mode!r}{', model' if model is not None else ''}) takes none")
    if model is not None:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            raise TypeError("torchport.enable: pass the model itself, not torch.compile's wrapper; speed mode "
                            "compiles it")
        if not isinstance(model, nn.Module):
            raise TypeError(f"torchport.enable: model must be an nn.Module, got {type(model).__name__}")
    with _lock:
        if _active is not None:
            current = _active.report
            raise RuntimeError(f"torchport.enable({mode!r}): {current.mode!r} is already enabled for "
                               f"{current.target}; call torchport.disable() first")
        journal = Journal()
        try:
            present = default_device() if device is None else _device(device)
            report = _enable_model(mode, model, present, example, budget, journal) if model is not None else \
                _enable_process(mode, present, journal)
        except BaseException:
            failures = journal.restore()
            if failures:
                logger.error("torchport.enable: undoing a failed enable left %d problem(s): %s", len(failures),
                             "; ".join(failures))
            raise
        journal.settled()
        _active = _Active(report, journal, model)
    logger.info("%s", report)
    return report


def _device(spec: DeviceLike) -> torch.device:
    backend, index = resolve(spec, source="device")
    return backend.device(index)


def _enable_model(mode: str, model: nn.Module, present: torch.device, example: Any, budget: Any,
                  journal: Journal) -> Report:
    where = steps.placement(model)
    # memory mode places a model that is on the host; the other modes leave the model where it is
    target = present if mode == "memory" and (where is None or where.type == "cpu") else where or present
    report = Report(mode, type(model).__name__, str(target))
    if target.type == "cpu" and present.type != "cpu":
        report.add("device", "cpu", "cpu", f"{present} is present: move the model there first "
                   "(model.to(torchport.device())); enable applies the cpu's choices", changed=False)
    ctx = StepContext(mode, target, journal, report, model=model, hf=transformers_model(model), where=where,
                      example=example, budget=budget)
    for step in MODEL_STEPS[mode]:
        step(ctx)
    return report


def _enable_process(mode: str, target: torch.device, journal: Journal) -> Report:
    ctx = StepContext(mode, target, journal, Report(mode, "process", str(target)))
    for step in PROCESS_STEPS[mode]:
        step(ctx)
    return ctx.report


def disable() -> Report | None:
    """Undo :func:`enable`: every change it made goes back, the model's and the process's (see the module
    docstring). Safe to call when no mode is enabled.

    Returns:
        The report of the mode that was undone, or None when none was enabled.

    Raises:
        RuntimeError: some changes could not be undone (each is listed; the others were undone).

    Example:
        >>> torchport.disable()
    """
    global _active
    with _lock:
        if _active is None:
            return None
        current, _active = _active, None
        failures = current.journal.restore()
    if failures:
        raise RuntimeError(f"torchport.disable: {len(failures)} change(s) of {current.report.mode!r} mode could not "
                           f"be undone: {'; '.join(failures)}")
    logger.info("torchport: %s mode disabled", current.report.mode)
    return current.report


def active() -> Report | None:
    """The report of the mode enabled now, or None.

    Example:
        >>> torchport.modes.active().mode
        'balanced'
    """
    with _lock:
        return None if _active is None else _active.report
