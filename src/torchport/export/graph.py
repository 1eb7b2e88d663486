"""The model and its inputs as an ONNX graph sees them: the model on the CPU in eval mode, each top-level tensor
argument a graph input with a name, every tensor of the output a graph output."""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..verify.structure import leaves

__all__ = ["Graph", "batch_of", "cast", "default_output_names", "prepared", "tensor_inputs", "tile"]


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` on the CPU, detached; in ``dtype`` when it is floating-point."""
    t = t.detach().to("cpu")
    return t.to(dtype) if t.is_floating_point() else t


def prepared(model: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.nn.Module, Callable[[], None]]:
    """The model on the CPU in ``dtype`` and eval mode, and how to put the caller's model back as it was."""
    tensors = [*model.parameters(), *model.buffers()]
    moved = any(t.device.type != "cpu" for t in tensors)
    recast = any(t.is_floating_point() and t.dtype != dtype for t in tensors)
    training = model.training
    if moved or recast:
        model = copy.deepcopy(model).to("cpu", dtype)
        model.eval()
        return model, lambda: None
    model.eval()
    return model, lambda: model.train(training)


def tensor_inputs(model: torch.nn.Module, inputs: Any) -> tuple[list[str], list[torch.Tensor], Callable[..., Any]]:
    """(default names, tensors, call): each top-level tensor of the inputs becomes a graph input; ``call(model,
    tensors)`` calls the model with the tensors in their places and every other value fixed."""
    if isinstance(inputs, torch.Tensor):
        return _argument_names(model, 1), [inputs], lambda m, t: m(t[0])
    if isinstance(inputs, Mapping):
        keys = [key for key, value in inputs.items() if isinstance(value, torch.Tensor)]
        _refuse_nested(inputs.items(), "keyword argument")
        fixed = {key: value for key, value in inputs.items() if key not in keys}
        return [str(key) for key in keys], [inputs[key] for key in keys], \
            lambda m, t: m(**fixed, **dict(zip(keys, t)))
    if isinstance(inputs, (tuple, list)):
        _refuse_nested(enumerate(inputs), "argument")
        slots = [i for i, value in enumerate(inputs) if isinstance(value, torch.Tensor)]
        names = _argument_names(model, len(inputs))

        def call(m: torch.nn.Module, t: Sequence[torch.Tensor]) -> Any:
            args = list(inputs)
            for slot, tensor in zip(slots, t):
                args[slot] = tensor
            return m(*args)

        return [names[i] for i in slots], [inputs[i] for i in slots], call
    raise TypeError(f"example_inputs must be a tensor, a tuple or list of arguments, or a dict of keyword "
                    f"arguments; got {type(inputs).__name__}")


def _refuse_nested(items: Any, what: str) -> None:
    for key, value in items:
        if not isinstance(value, torch.Tensor) and any(isinstance(leaf, torch.Tensor) for _, leaf in leaves(value)):
            raise TypeError(f"{what} {key!r} holds tensors inside a {type(value).__name__}; ONNX graph inputs are "
                            "tensors: pass each tensor as its own argument")


def _argument_names(model: torch.nn.Module, count: int) -> list[str]:
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    names = []
    for parameter in parameters:
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            break
        names.append(parameter.name)
    return [names[i] if i < len(names) else f"input_{i}" for i in range(count)]


def default_output_names(out: Any) -> list[str]:
    """Graph output names from the output's structure (``logits``, ``output_0``...), one per tensor, unique."""
    names = []
    for path, leaf in leaves(out):
        if not isinstance(leaf, torch.Tensor):
            continue
        name = re.sub(r"[^0-9A-Za-z_]+", "_", path).strip("_")
        names.append(name if path.startswith(".") else f"output_{name}" if name else "output")
    return [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]


class Graph(torch.nn.Module):
    """The model as the exporters see it: tensors in, a flat tuple of the output's tensors out."""

    def __init__(self, model: torch.nn.Module, call: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.flatten(self.call(self.model, tensors))

    @staticmethod
    def flatten(out: Any) -> tuple[torch.Tensor, ...]:
        return tuple(leaf for _, leaf in leaves(out) if isinstance(leaf, torch.Tensor))


def batch_of(tensors: list[torch.Tensor]) -> int | None:
    """The batch size: the first dim of the first tensor that has one."""
    return next((t.shape[0] for t in tensors if t.dim() > 0), None)


def tile(tensors: list[torch.Tensor], dynamic: list[bool], size: int) -> list[torch.Tensor]:
    """The tensors, those marked ``dynamic`` repeated along dim 0 to ``size`` rows."""
    out = []
    for t, flag in zip(tensors, dynamic):
        if flag:
            t = t.repeat(-(-size // t.shape[0]), *([1] * (t.dim() - 1)))[:size]
        out.append(t)
    return out
