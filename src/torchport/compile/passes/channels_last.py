"""Run 2-D convolutions in channels-last (NHWC) memory where the device's convolutions prefer it."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

from ...backends import get_backend, list_backends
from . import context, note, register_pass
from .constant_fold import known_value
from .dead_code import is_pure_function, writes_in_place

__all__ = ["channels_last"]

_CONV_FUNCTIONS = frozenset({torch.conv2d, torch.conv_transpose2d})  # F.conv2d is torch.conv2d
_CONV_MODULES = (nn.Conv2d, nn.ConvTranspose2d)
# Results that depend on strides, not only on values: a graph reading them cannot change layouts unnoticed.
_STRIDE_READERS = frozenset({"stride", "is_contiguous", "data_ptr", "storage", "untyped_storage", "storage_offset",
                             "as_strided", "as_strided_", "set_", "numpy", "__array__"})
# Calls that return a view of a contiguous tensor but a copy of a channels-last one: a write after them could reach
# the base before the change and no longer after it.
_RELAYOUTS = frozenset({"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "contiguous"})
# Methods that need strides compatible with the requested shape ("view size is not compatible...").
_VIEWS = frozenset({"view", "view_as"})


def _name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _conv_input(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node | None:
    """The input of a 2-D convolution whose input is known to be 4-D (batched)."""
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), _CONV_MODULES):
        x = node.args[0] if len(node.args) == 1 and not node.kwargs else None
    elif node.op == "call_function" and node.target in _CONV_FUNCTIONS:
        x = node.args[0] if node.args else node.kwargs.get("input")
    else:
        return None
    value = known_value(x) if isinstance(x, torch.fx.Node) else None
    return x if value is not None and value.dim() == 4 else None


def _downstream(starts: list[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.users)
    return seen


def _unknown_code(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A call whose body may read strides: a user's module or function."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return isinstance(module, torch.fx.GraphModule) or not type(module).__module__.startswith("torch.nn.modules.")
    return node.op == "call_function" and not is_pure_function(node.target)


def _static(value: torch.Tensor) -> bool:
    return all(isinstance(n, int) for n in (*value.shape, *value.stride()))


def _output_layouts(region: set[torch.fx.Node], output: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The outputs to make contiguous again (those that were contiguous), or None when an output's layout cannot
    be restored (unknown, symbolic, or neither contiguous nor channels-last)."""
    restore: list[torch.fx.Node] = []
    for node in output.all_input_nodes:
        if node not in region:
            continue
        value = known_value(node)
        if value is None:
            if "example_value" in node.meta or "val" in node.meta:
                continue  # recorded, and not a tensor (a size, say)
            return None
        if not _static(value):
            return None
        if value.is_contiguous():
            restore.append(node)
        elif not (value.dim() == 4 and value.is_contiguous(memory_format=torch.channels_last)):
            return None
    return restore


def _prefers_channels_last() -> bool:
    device = context().device
    if device.type not in list_backends():
        return False
    backend = get_backend(device.type)
    index = device.index if device.index is not None else backend.current_index()
    return backend.preferred_conv_memory_format(index) == torch.channels_last


@register_pass("channels_last", order=500)
def channels_last(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give 2-D convolutions channels-last inputs on devices whose convolutions compute in NHWC.

    The device's backend says so (``Backend.preferred_conv_memory_format``); its convolutions then skip a
    transpose in and out of every call. Values are unchanged; so are the strides of the graph's outputs.

    Pattern::

        y = self.conv(x)               # nn.Conv2d / ConvTranspose2d, torch.conv2d, F.conv2d..., x 4-D
        z = y.view(n, -1)
        return y.relu()
    ->
        y = self.conv(x.contiguous(memory_format=torch.channels_last))   # y comes out channels-last too
        z = y.contiguous().view(n, -1)                                   # view needs compatible strides
        return y.relu().contiguous()                                     # an output keeps its layout

    Later convolutions receive channels-last tensors already (element-wise ops, pooling and batch norm keep the
    layout), so their conversion costs nothing. Left as it is: a graph on a device that prefers the default
    layout, a graph where a tensor computed from a convolution reaches a user's module or function, a stride
    reader (``stride()``, ``is_contiguous()``, ``data_ptr()``, ``as_strided``...), an in-place write after a
    reshape or view (which may copy now where it aliased before), or an output whose recorded layout is unknown,
    symbolic, or neither contiguous nor channels-last. Input ranks come from what tracing recorded.
    """
    if not _prefers_channels_last():
        return gm
    convs = [(node, x) for node in gm.graph.nodes if (x := _conv_input(gm, node)) is not None]
    if not convs:
        return gm
    region = _downstream([node for node, _ in convs])
    relayout_seen = False
    for node in gm.graph.nodes:  # in order: a write matters only after a relayout
        if node not in region:
            continue
        call = node.op in ("call_method", "call_function")
        if (call and _name(node) in _STRIDE_READERS) or _unknown_code(gm, node):
            return gm
        if writes_in_place(node) and relayout_seen:
            return gm
        relayout_seen |= call and _name(node) in _RELAYOUTS
    output = next(n for n in gm.graph.nodes if n.op == "output")
    restore = _output_layouts(region, output)
    if restore is None:
        return gm

    for node, x in convs:
        with gm.graph.inserting_before(node):
            converted = gm.graph.call_method("contiguous", (x,), {"memory_format": torch.channels_last})
        if node.args and node.args[0] is x:
            node.update_arg(0, converted)
        else:
            node.update_kwarg("input", converted)
    for node in list(gm.graph.nodes):
        if node in region and node.op == "call_method" and node.target in _VIEWS:
            with gm.graph.inserting_before(node):
                node.update_arg(0, gm.graph.call_method("contiguous", (node.args[0],)))
    replaced: dict[torch.fx.Node, Any] = {}
    for node in restore:
        with gm.graph.inserting_before(output):
            replaced[node] = gm.graph.call_method("contiguous", (node,))
    output.args = torch.fx.node.map_arg(output.args, lambda n: replaced.get(n, n))
    note(f"gave {len(convs)} convolution{'s' if len(convs) != 1 else ''} channels-last inputs"
         + (f"; {len(restore)} output{'s' if len(restore) != 1 else ''} made contiguous again" if restore else ""))
    return gm
