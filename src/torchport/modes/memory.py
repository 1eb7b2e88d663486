"""Memory mode's own steps: low-bit weights, activation checkpointing, and placing (or offloading) a model that is on
the host; :mod:`torchport.modes.process` applies the first two to models loaded while the mode is on."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._bytes import format_bytes, weight_bytes
from ..device import resolve
from .journal import Journal
from .steps import StepContext, replace_tensors

#: Fraction of the device's free memory that memory mode lets a model's weights take; the rest is left for
#: activations and the KV cache.
DEFAULT_BUDGET = 0.8


def _move(model: nn.Module, device: torch.device, journal: Journal) -> int:
    def convert(t: torch.Tensor, is_param: bool, key: str, module: nn.Module) -> torch.Tensor | None:
        if t.device == device:
            return None
        data = t.detach().to(device)
        return nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data

    return replace_tensors(model, convert, journal)


def _keep_dense(hf: nn.Module | None, model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """The low-bit filter: every nn.Linear except output layers (lm_head, the output embeddings)."""
    outputs: set[int] = set()
    for owner in (hf, model):
        getter = getattr(owner, "get_output_embeddings", None)
        if callable(getter):
            try:
                head = getter()
            except (NotImplementedError, AttributeError):
                head = None
            if head is not None:
                outputs.add(id(head))
    return lambda name, module: id(module) not in outputs and name.rsplit(".", 1)[-1] != "lm_head"


def quantize_linears(model: nn.Module, hf: nn.Module | None, device: torch.device,
                     journal: Journal | None) -> tuple[str, int, int] | str:
    """Low-bit weights for the model's linear layers; ``(format, layers, bytes saved)`` or why not."""
    try:
        from .. import quant
    except ImportError as exc:
        return f"torchport.quant is unavailable ({exc})"
    if hf is not None and getattr(hf, "is_quantized", False):
        return "the model is quantised already (transformers quantization_config)"
    if quant.quantized_modules(model):
        return "the model has low-bit layers already"
    selector = _keep_dense(hf, model)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name in linears if journal is not None else ():  # quantize replaces them in their parents
        parent_name, _, attr = name.rpartition(".")
        journal.remember_item((model.get_submodule(parent_name) if parent_name else model)._modules, attr)
    fmt = quant.default_format(device)
    spec = quant.get_format(fmt)
    inputs = [m.in_features for name, m in linears.items() if selector(name, m)]
    group = None
    if spec.fixed_group is None and spec.default_group and any(n % spec.default_group for n in inputs):
        # the format's default group does not divide every layer's inputs: the largest one that does
        group = math.gcd(spec.default_group, *inputs)
    size = weight_bytes(model)
    try:
        quant.quantize(model, fmt, group_size=group, modules=selector)
    except quant.QuantizationError as exc:
        return f"not quantised: {exc}"
    replaced = quant.quantized_modules(model)
    if group is not None:
        fmt = f"{fmt} (groups of {group})"
    if journal is not None:
        for name in replaced:
            original = linears.get(name)
            if original is None:
                continue
            # the dense layer is out of the model now: let go of its weights (the journal holds the originals)
            for key in list(original._parameters):
                journal.set_item(original._parameters, key, None)
    return fmt, len(replaced), size - weight_bytes(model)


def step_quantize(ctx: StepContext) -> None:
    report = ctx.report
    result = quantize_linears(ctx.model, ctx.hf, ctx.target, ctx.journal)
    if isinstance(result, str):
        report.add("low-bit weights", "dense", "dense", result)
        if result.startswith("not quantised"):
            warnings.warn(f"torchport memory mode: {result}", RuntimeWarning, stacklevel=4)
        return
    fmt, layers, saved = result
    report.add("low-bit weights", "dense", f"{fmt}: {layers} linear layers",
               f"{format_bytes(saved)} less; lm_head, embeddings and tied weights kept; low-bit layers do not train")


def checkpoint_activations(model: nn.Module, hf: nn.Module | None, journal: Journal | None) -> str:
    """Switch activation checkpointing on; returns how, or why not (starting with "not")."""
    if hf is not None:
        if not getattr(hf, "supports_gradient_checkpointing", False):
            return f"not available: {type(hf).__name__} does not support gradient checkpointing"
        if journal is not None:
            for module in hf.modules():
                for key in ("gradient_checkpointing", "_gradient_checkpointing_func", "_require_grads_hook",
                            "_require_grads_hooks"):
                    journal.remember_item(module.__dict__, key)
            _undo_new_hooks(hf, journal)
        enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
        enable()
        return "transformers' activation checkpointing (recomputed in backward)"
    from ..offload import find_blocks

    try:
        blocks = find_blocks(model)
    except ValueError as exc:
        return f"not available: no repeated blocks found ({str(exc).splitlines()[0]})"
    for block in blocks.modules:
        wrapped = _checkpointed(block.forward, block)
        if journal is not None:
            journal.set_item(block.__dict__, "forward", wrapped)
        else:
            block.__dict__["forward"] = wrapped
    return f"torch.utils.checkpoint around {len(blocks.modules)} blocks ({blocks.names[0]}, ...)"


def _checkpointed(forward: Callable[..., Any], block: nn.Module) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if block.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


def _undo_new_hooks(model: nn.Module, journal: Journal) -> None:
    """At disable, remove the forward hooks registered on ``model``'s modules from now on."""
    before = {id(m): set(m._forward_hooks) for m in model.modules()}
    modules = list(model.modules())

    def remove() -> None:
        for m in modules:
            for key in set(m._forward_hooks) - before.get(id(m), set()):
                m._forward_hooks.pop(key, None)
                m._forward_hooks_with_kwargs.pop(key, None)
                m._forward_hooks_always_called.pop(key, None)

    journal.undo(remove)


def step_checkpointing(ctx: StepContext) -> None:
    report = ctx.report
    how = checkpoint_activations(ctx.model, ctx.hf, ctx.journal)
    if how.startswith("not"):
        report.add("activation checkpointing", "off", "off", how)
    else:
        report.add("activation checkpointing", "off", "on", f"{how}; applies in training")


def step_placement(ctx: StepContext) -> None:
    from ..offload import offload, parse_budget

    model, where, target, journal, report = ctx.model, ctx.where, ctx.target, ctx.journal, ctx.report
    if target.type == "cpu":
        report.add("placement", "cpu", "cpu", "the model runs on the host: nothing to offload")
        return
    if where is not None and where != torch.device("cpu"):
        report.add("placement", str(where), str(where), "on the device already")
        return
    backend, index = resolve(target)
    info = backend.mem_get_info(index)
    limit = parse_budget(DEFAULT_BUDGET if ctx.budget is None else ctx.budget, info[0] if info else None, name="budget")
    size = weight_bytes(model)
    if size <= limit:
        _move(model, target, journal)
        report.add("placement", "cpu", str(target),
                   f"weights {format_bytes(size)} fit the budget {format_bytes(limit)}")
        return
    for module in model.modules():  # offload replaces parameter and buffer entries: keep them all
        for table in (module._parameters, module._buffers):
            for key in list(table):
                journal.remember_item(table, key)
    offload(model, limit, device=target, progress=False)
    state = model.__dict__["_torchport_offload"]

    def undo_offload() -> None:  # torchport.offload has no undo of its own: its hooks, pipeline and marker
        for handle in state.handles:
            handle.remove()
        state.close()
        model.__dict__.pop("_torchport_offload", None)

    journal.undo(undo_offload)
    tiers = state.plan.tiers()
    offloaded = sum(tier != "device" for tier in tiers.values())
    report.add("placement", "cpu", f"{target}, {offloaded} of {len(tiers)} blocks offloaded to the host",
               f"weights {format_bytes(size)} exceed the budget {format_bytes(limit)}; inference only")


def note_placement(ctx: StepContext) -> None:
    """Without a model there is nothing to place or offload: say how to."""
    ctx.report.add("placement", "as the program places models", "as the program places models",
                   "offload needs the model: enable('memory', model) or torchport.offload(model, budget)")
