"""What a mode switches for the whole process when it is enabled without a model: transformers' classes, the
attention hook, ``from_pretrained``'s defaults (TF32 is a step of its own, shared with models)."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from ..backends import get_backend
from .journal import Journal
from .report import Report
from .steps import checkpoint_activations, dtype_name, quantize_linears, transformers_model

logger = logging.getLogger("torchport")


def step_classes(journal: Journal, report: Report) -> None:
    from .. import models

    before = set(models.patched_families())
    wanted = [name for name in models.supported() if name not in before]
    for name in wanted:
        models.patch_transformers(name)
    journal.undo(lambda: [models.unpatch_transformers(name) for name in wanted])
    note = f"already patched: {', '.join(sorted(before))}" if before else ""
    report.add("transformers classes", "transformers' forwards" if wanted else "torchport kernels",
               f"torchport kernels for {', '.join(models.supported())}" if wanted else "torchport kernels", note,
               changed=bool(wanted))


def step_hook(device: torch.device, journal: Journal, report: Report) -> None:
    from .. import attention

    before = attention.hook_installed()
    attention.install_hook(default=True, device=device)
    if before is None:
        journal.undo(attention.remove_hook)
    else:
        journal.undo(lambda: attention.install_hook(**before))
    report.add("attention of new models", "transformers' default; flash requests fail without flash-attn",
               f"{attention.best(device)} on {device}; flash requests fall back with one warning",
               "torchport.attention.install_hook(default=True, device=...)")


def step_from_pretrained(mode: str, device: torch.device, journal: Journal, report: Report) -> None:
    from transformers import PreTrainedModel

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

    journal.set(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
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
