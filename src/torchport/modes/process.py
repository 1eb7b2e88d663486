"""What a mode switches for the whole process when it is enabled without a model: transformers' classes, the
attention hook, ``from_pretrained``'s defaults (TF32 is a step of its own, shared with models). Each step needs
transformers: :func:`step_transformers` runs them, or says that it is not installed."""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

import torch
from torch import nn

from .._unwrap import transformers_model
from ..backends import get_backend
from .memory import checkpoint_activations, quantize_linears
from .report import Report
from .steps import StepContext, dtype_name

logger = logging.getLogger("torchport")


def step_classes(ctx: StepContext) -> None:
    from .. import models

    journal, report = ctx.journal, ctx.report
    before = set(models.patched_families())
    wanted = [name for name in models.supported() if name not in before]
    for name in wanted:
        models.patch_transformers(name)
    journal.undo(lambda: [models.unpatch_transformers(name) for name in wanted])
    note = f"already patched: {', '.join(sorted(before))}" if before else ""
    report.add("transformers classes", "transformers' forwards" if wanted else "torchport kernels",
               f"torchport kernels for {', '.join(models.supported())}" if wanted else "torchport kernels", note,
               changed=bool(wanted))


def step_hook(ctx: StepContext) -> None:
    from .. import attention

    device, journal = ctx.target, ctx.journal
    before = attention.hook_installed()
    attention.install_hook(default=True, device=device)
    if before is None:
        journal.undo(attention.remove_hook)
    else:
        journal.undo(lambda: attention.install_hook(**before))
    ctx.report.add("attention of new models", "transformers' default; flash requests fail without flash-attn",
               f"{attention.best(device)} on {device}; flash requests fall back with one warning",
               "torchport.attention.install_hook(default=True, device=...)")


def step_from_pretrained(ctx: StepContext) -> None:
    from transformers import PreTrainedModel

    mode, device, report = ctx.mode, ctx.target, ctx.report
    best = get_backend(device.type).preferred_dtype(device.index or 0)
    dtype = None if mode == "memory" and best == torch.float32 else best  # memory mode never widens weights
    original = PreTrainedModel.__dict__["from_pretrained"]
    load = original.__func__

    @functools.wraps(load)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if dtype is not None and "dtype" not in kwargs and "torch_dtype" not in kwargs:
            kwargs["dtype"] = dtype
        model = load(cls, *args, **kwargs)
        if mode == "memory":
            _memory_on_load(model, device, report)
        return model

    ctx.journal.set(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    after = [f"dtype {dtype_name(dtype)} unless given" if dtype is not None else "dtype as given (or the checkpoint's)"]
    if mode == "memory":
        after.append("low-bit weights and activation checkpointing")
    report.add("from_pretrained", "dtype as given (or the checkpoint's)", "; ".join(after),
               "models loaded later keep these after disable()")


def _memory_on_load(model: nn.Module, device: torch.device, report: Report) -> None:
    hf = transformers_model(model)
    result = quantize_linears(model, hf, device, None)
    quantized = result if isinstance(result, str) else f"{result[0]}: {result[1]} linear layers"
    checkpointing = checkpoint_activations(model, hf, None)
    logger.info("torchport memory mode: %s loaded with low-bit weights (%s), activation checkpointing (%s)",
                type(model).__name__, quantized, checkpointing)
    report.add(f"loaded {type(model).__name__}", "dense", quantized, checkpointing,
               changed=not isinstance(result, str))


def step_transformers(ctx: StepContext) -> None:
    """The steps above, in order, or a row saying that transformers is not installed."""
    if importlib.util.find_spec("transformers") is None:
        ctx.report.add("transformers models", "-", "-", "transformers is not installed")
        return
    step_classes(ctx)
    step_hook(ctx)
    step_from_pretrained(ctx)
