"""What a mode does to one model: each ``step_*`` changes one setting through the journal and adds its row to the
report (or a row saying why it left the setting as it was)."""

from __future__ import annotations

import functools
import logging
import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..backends import get_backend
from ..device import resolve
from ..offload import format_bytes
from .journal import Journal
from .report import Report

logger = logging.getLogger("torchport")

#: Fraction of the device's free memory that memory mode lets a model's weights take; the rest is left for
#: activations and the KV cache.
DEFAULT_BUDGET = 0.8
_EXAMPLE_TOKENS = 8


def transformers_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside ``model`` (itself, or behind PEFT's ``base_model.model``), or None."""
    if "transformers" not in sys.modules:  # a model of it would have imported it
        return None
    from transformers import PreTrainedModel

    seen: set[int] = set()
    while not isinstance(model, PreTrainedModel) and id(model) not in seen:
        seen.add(id(model))
        inner = getattr(getattr(model, "base_model", None), "model", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return model if isinstance(model, PreTrainedModel) else None


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


def weight_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


# -- the steps -------------------------------------------------------------------------------------------------------
def _replace_tensors(model: nn.Module, convert: Callable[[torch.Tensor, bool, str, nn.Module], torch.Tensor | None],
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
                    journal.set(table, key, new)
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

    return _replace_tensors(model, convert, journal)


def _move(model: nn.Module, device: torch.device, journal: Journal) -> int:
    def convert(t: torch.Tensor, is_param: bool, key: str, module: nn.Module) -> torch.Tensor | None:
        if t.device == device:
            return None
        data = t.detach().to(device)
        return nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data

    return _replace_tensors(model, convert, journal)


def step_dtype(mode: str, model: nn.Module, device: torch.device, journal: Journal, report: Report) -> None:
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
        count = _cast(model, best, journal)
        report.add("dtype", dtype_name(current), dtype_name(best),
                   f"{count} tensors; non-persistent buffers and keep-in-fp32 modules stay")


def step_kernels(model: nn.Module, hf: nn.Module | None, report: Report, journal: Journal) -> None:
    from .. import models

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
        journal.undo(lambda: models.unpatch(model))
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


def step_attention(hf: nn.Module | None, device: torch.device, journal: Journal, report: Report) -> None:
    from .. import attention

    if hf is None:
        report.add("attention", "model's own", "model's own", "not a transformers model")
        return
    before = hf.config._attn_implementation
    for config in _configs(hf):
        journal.remember(config.__dict__, "_attn_implementation_internal")
    try:
        after = attention.apply(hf, device=device)
    except (ValueError, ImportError) as exc:
        report.add("attention", before, before, str(exc).splitlines()[0])
        return
    report.add("attention", before, after, "" if before != after else "already the best here")


def step_tf32(device: torch.device, journal: Journal, report: Report) -> None:
    backend = get_backend(device.type)
    previous = backend.enable_tf32(device.index or 0)
    if previous is None:
        report.add("tf32", "-", "-", f"{device.type} has no TF32 here")
        return
    journal.undo(lambda: backend.restore_tf32(previous))
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


def step_compile(model: nn.Module, hf: nn.Module | None, example: Any, device: torch.device, journal: Journal,
                 report: Report) -> bool:
    """Compile ``model`` in place with the torchport backend when it compiles cleanly; whether it did."""
    inputs = _example_inputs(model, hf, example, device)
    if inputs is None:
        report.add("compile", "eager", "eager", "give enable(..., example=inputs) to check that it compiles cleanly")
        return False
    # torch._dynamo.explain leaves _is_torch_compile=True on the module it traced (through OptimizedModule's
    # attribute forwarding), compiled or not
    journal.remember(model.__dict__, "_is_torch_compile")
    why = _compiles_cleanly(model, inputs)
    if why is not None:
        report.add("compile", "eager", "eager", f"not compiled: {why}")
        return False
    journal.remember(model.__dict__, "_compiled_call_impl")
    model.compile(backend="torchport")
    report.add("compile", "eager", "torch.compile(backend='torchport')",
               "no graph break on the example; compiles on the first call")
    return True


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
        journal.remember((model.get_submodule(parent_name) if parent_name else model)._modules, attr)
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
                journal.set(original._parameters, key, None)
    return fmt, len(replaced), size - weight_bytes(model)


def step_quantize(model: nn.Module, hf: nn.Module | None, device: torch.device, journal: Journal,
                  report: Report) -> None:
    result = quantize_linears(model, hf, device, journal)
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
                    journal.remember(module.__dict__, key)
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
            journal.set(block.__dict__, "forward", wrapped)
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


def step_checkpointing(model: nn.Module, hf: nn.Module | None, journal: Journal, report: Report) -> None:
    how = checkpoint_activations(model, hf, journal)
    if how.startswith("not"):
        report.add("activation checkpointing", "off", "off", how)
    else:
        report.add("activation checkpointing", "off", "on", f"{how}; applies in training")


def step_placement(model: nn.Module, where: torch.device | None, target: torch.device, budget: Any,
                   journal: Journal, report: Report) -> None:
    from ..offload import offload, parse_budget

    if target.type == "cpu":
        report.add("placement", "cpu", "cpu", "the model runs on the host: nothing to offload")
        return
    if where is not None and where != torch.device("cpu"):
        report.add("placement", str(where), str(where), "on the device already")
        return
    backend, index = resolve(target)
    info = backend.mem_get_info(index)
    limit = parse_budget(DEFAULT_BUDGET if budget is None else budget, info[0] if info else None, name="budget")
    size = weight_bytes(model)
    if size <= limit:
        _move(model, target, journal)
        report.add("placement", "cpu", str(target), f"weights {format_bytes(size)} fit the budget {format_bytes(limit)}")
        return
    for module in model.modules():  # offload replaces parameter and buffer entries: keep them all
        for table in (module._parameters, module._buffers):
            for key in list(table):
                journal.remember(table, key)
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
