"""What a mode does to one model: each ``step_*(ctx)`` changes one setting through the context's journal and adds
its row to the report (or a row saying why it left the setting as it was). The steps of each mode, in order, are
the tables in :mod:`torchport.modes`; memory mode's own steps are in :mod:`torchport.modes.memory`."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..backends import get_backend
from .journal import Journal
from .report import Report

logger = logging.getLogger("torchport")

_EXAMPLE_TOKENS = 8


@dataclasses.dataclass
class StepContext:
    """What the steps of one :func:`torchport.enable` read and change: the mode, the device its choices are made
    for (``target``), the journal every change goes through and the report every step adds its row to; with a
    model, the model, the transformers model inside it (``hf``, None for other models), the device it was on
    (``where``), the user's ``example`` and ``budget``, and whether a step compiled it (``compiled``)."""

    mode: str
    target: torch.device
    journal: Journal
    report: Report
    model: nn.Module | None = None
    hf: nn.Module | None = None
    where: torch.device | None = None
    example: Any = None
    budget: Any = None
    compiled: bool = False


def placement(model: nn.Module) -> torch.device | None:
    """The one device holding the model's tensors (None: it has none); an error for meta or mixed devices."""
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if any(d.type == "meta" for d in devices):
        raise ValueError(f"torchport.enable: {type(model).__name__} has tensors on the meta device (not loaded); "
                         "load its weights first (from_pretrained, load_state_dict(assign=True), to_empty)")
    if len(devices) > 1:
        raise ValueError(f"torchport.enable: {type(model).__name__} is spread over "
                         f"{', '.join(sorted(map(str, devices)))}; enable handles a model on one device: move it with "
                         "model.to(torchport.device()) first (or offload it with memory mode from the host)")
    return next(iter(devices), None)


def _floating_dtype(model: nn.Module) -> torch.dtype | None:
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def dtype_name(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


# -- the steps -------------------------------------------------------------------------------------------------------
def replace_tensors(model: nn.Module, convert: Callable[[torch.Tensor, bool, str, nn.Module], torch.Tensor | None],
                     journal: Journal) -> int:
    """Put ``convert(tensor, is_parameter, name, module)`` (None: keep) in every parameter and buffer slot; a
    tensor in several slots (tied weights) is converted once and stays shared. Returns the tensors replaced."""
    done: dict[int, torch.Tensor | None] = {}
    for module_name, module in model.named_modules(remove_duplicate=True):
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for key, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in done:
                    done[id(tensor)] = convert(tensor, is_param, key, module)
                new = done[id(tensor)]
                if new is not None:
                    journal.set_item(table, key, new)
    return sum(new is not None for new in done.values())


def _cast(model: nn.Module, dtype: torch.dtype, journal: Journal) -> int:
    """Floating parameters and persistent buffers to ``dtype``, except in transformers' keep-in-fp32 modules;
    non-persistent buffers (rotary tables, masks: constants the model computes in its own precision) stay."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or []) | set(
        getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    kept = {id(m) for name, m in model.named_modules() if keep and any(k in name.split(".") for k in keep)}

    def convert(t: torch.Tensor, is_param: bool, key: str, module: nn.Module) -> torch.Tensor | None:
        if not t.is_floating_point() or t.dtype == dtype or id(module) in kept:
            return None
        if not is_param and key in module._non_persistent_buffers_set:
            return None
        data = t.detach().to(dtype)
        return nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data

    return replace_tensors(model, convert, journal)


def step_dtype(ctx: StepContext) -> None:
    mode, model, device, report = ctx.mode, ctx.model, ctx.target, ctx.report
    backend = get_backend(device.type)
    best = backend.preferred_dtype(device.index or 0)
    current = _floating_dtype(model)
    if current is None:
        report.add("dtype", "-", "-", "no floating parameters")
        return
    wider = torch.finfo(best).bits > torch.finfo(current).bits
    if best == current:
        report.add("dtype", dtype_name(current), dtype_name(best), f"already {device.type}'s best")
    elif mode == "memory" and wider:
        report.add("dtype", dtype_name(current), dtype_name(current),
                   f"{device.type}'s best is {dtype_name(best)}, but memory mode does not widen weights")
    else:
        count = _cast(model, best, ctx.journal)
        report.add("dtype", dtype_name(current), dtype_name(best),
                   f"{count} tensors; non-persistent buffers and keep-in-fp32 modules stay")


def step_kernels(ctx: StepContext) -> None:
    from .. import models

    model, hf, report = ctx.model, ctx.hf, ctx.report
    if hf is None:
        report.add("kernels", "model's forwards", "model's forwards",
                   "not a transformers model: use torchport.kernels in its modules")
    elif getattr(hf.config, "model_type", None) not in models.supported():
        report.add("kernels", "transformers' forwards", "transformers' forwards",
                   f"model_type {getattr(hf.config, 'model_type', None)!r} is not one torchport.patch knows "
                   f"({', '.join(models.supported())})")
    elif models.is_patched(model):
        report.add("kernels", "torchport.patch", "torchport.patch", "patched already: left as it is")
    else:
        models.patch(model)
        ctx.journal.undo(lambda: models.unpatch(model))
        report.add("kernels", "transformers' forwards", "torchport kernels",
                   "RMSNorm, gated MLP, RoPE, training loss (torchport.patch)")


def _configs(hf: nn.Module) -> list[Any]:
    from transformers import PreTrainedModel

    found: dict[int, Any] = {}
    pending = [hf.config] + [m.config for m in hf.modules() if isinstance(m, PreTrainedModel)]
    while pending:
        config = pending.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                pending.append(sub)
    return list(found.values())


def step_attention(ctx: StepContext) -> None:
    from .. import attention

    hf, report = ctx.hf, ctx.report
    if hf is None:
        report.add("attention", "model's own", "model's own", "not a transformers model")
        return
    before = hf.config._attn_implementation
    for config in _configs(hf):
        ctx.journal.remember_item(config.__dict__, "_attn_implementation_internal")
    try:
        after = attention.apply(hf, device=ctx.target)
    except (ValueError, ImportError) as exc:
        report.add("attention", before, before, str(exc).splitlines()[0])
        return
    report.add("attention", before, after, "" if before != after else "already the best here")


def step_tf32(ctx: StepContext) -> None:
    device, report = ctx.target, ctx.report
    backend = get_backend(device.type)
    previous = backend.enable_tf32(device.index or 0)
    if previous is None:
        report.add("tf32", "-", "-", f"{device.type} has no TF32 here")
        return
    ctx.journal.undo(lambda: backend.restore_tf32(previous))
    turned = [name for name, value in previous.items() if value not in (True, "tf32")]
    note = ", ".join(turned) if turned else "on already"
    report.add("tf32", "off" if turned else "on", "on", note, changed=bool(turned))


def _example_inputs(model: nn.Module, hf: nn.Module | None, example: Any,
                    device: torch.device) -> tuple[tuple, dict] | None:
    if example is not None:
        if isinstance(example, dict):
            return (), example
        return (example if isinstance(example, tuple) else (example,)), {}
    if hf is not None and getattr(hf, "main_input_name", None) == "input_ids":
        vocab = int(getattr(hf.config, "vocab_size", 0) or getattr(hf.config.get_text_config(), "vocab_size", 0) or 2)
        ids = (torch.arange(_EXAMPLE_TOKENS) % vocab).unsqueeze(0).to(device)
        return (), {"input_ids": ids}
    return None


def _compiles_cleanly(model: nn.Module, inputs: tuple[tuple, dict]) -> str | None:
    """None when dynamo captures the model's forward in one graph on these inputs, else why not. (explain resets
    dynamo's caches: functions compiled before recompile on their next call.)"""
    args, kwargs = inputs
    dynamo_log = logging.getLogger("torch._dynamo")
    level = dynamo_log.level
    dynamo_log.setLevel(logging.ERROR)  # each graph break is logged as a warning; the report gives the first
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            explanation = torch._dynamo.explain(model)(*args, **kwargs)
    except Exception as exc:  # the model does not trace at all
        return f"tracing failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    finally:
        dynamo_log.setLevel(level)
    if explanation.graph_break_count:
        first = str(explanation.break_reasons[0].reason).strip().splitlines()[0] if explanation.break_reasons else ""
        return f"{explanation.graph_break_count} graph break(s), first: {first}"
    return None


def step_compile(ctx: StepContext) -> None:
    """Compile the model in place with the torchport backend when it compiles cleanly (``ctx.compiled`` says so)."""
    model, journal, report = ctx.model, ctx.journal, ctx.report
    inputs = _example_inputs(model, ctx.hf, ctx.example, ctx.where or ctx.target)
    if inputs is None:
        report.add("compile", "eager", "eager", "give enable(..., example=inputs) to check that it compiles cleanly")
        return
    # torch._dynamo.explain leaves _is_torch_compile=True on the module it traced (through OptimizedModule's
    # attribute forwarding), compiled or not
    journal.remember_item(model.__dict__, "_is_torch_compile")
    why = _compiles_cleanly(model, inputs)
    if why is not None:
        report.add("compile", "eager", "eager", f"not compiled: {why}")
        return
    journal.remember_item(model.__dict__, "_compiled_call_impl")
    model.compile(backend="torchport")
    report.add("compile", "eager", "torch.compile(backend='torchport')",
               "no graph break on the example; compiles on the first call")
    ctx.compiled = True


def note_compile(ctx: StepContext) -> None:
    """Without a model there is nothing to compile: say so."""
    ctx.report.add("compile", "eager", "eager", "speed mode compiles the model given to enable(mode, model)")
