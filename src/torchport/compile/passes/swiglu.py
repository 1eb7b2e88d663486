"""Plain-PyTorch SwiGLU (``silu(gate) * up``, Llama's MLP) -> ``torchport::swiglu``.

Also home of :func:`fuse_gated`, the rewrite shared with the GeGLU pass: find ``act(gate) * up`` for an activation
recognised by a matcher, and replace the product with one op.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from ...kernels import library  # noqa: F401 - registers torch.ops.torchport
from . import note, register_pass
from ._graph import same_shape as _same_shape
from ._graph import value as _value
from ._replace import replace

__all__ = ["ActivationMatch", "fuse_gated", "swiglu"]

Node = torch.fx.Node

# (gate, the nodes computing act(gate)) for an activation's output node, or None
ActivationMatch = Callable[[torch.fx.GraphModule, Node], "tuple[Node, list[Node]] | None"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

def _module(gm: torch.fx.GraphModule, node: Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    try:
        return gm.get_submodule(node.target)
    except AttributeError:
        return None


def _silu(gm: torch.fx.GraphModule, node: Node) -> tuple[Node, list[Node]] | None:
    """``F.silu(gate)`` (not in place) or an ``nn.SiLU`` module call."""
    if node.op == "call_function" and node.target is F.silu:
        inplace = node.args[1] if len(node.args) > 1 else node.kwargs.get("inplace", False)
        if inplace is False and set(node.kwargs) <= {"inplace"} and isinstance(node.args[0], Node):
            return node.args[0], [node]
    module = _module(gm, node)
    if isinstance(module, nn.SiLU) and not module.inplace and len(node.args) == 1 and not node.kwargs:
        return node.args[0], [node]
    return None


def fuse_gated(gm: torch.fx.GraphModule, activation: ActivationMatch, op: Any, what: str) -> int:
    """Replace every ``act(gate) * up`` (either order) whose activation ``activation`` recognises by
    ``op(gate, up)``; return how many were replaced (``what`` names the pattern in notes).

    Only where gate, up and the product have one shape (no broadcasting) and one floating dtype, and the activation's
    intermediate values feed nothing else.
    """
    graph = gm.graph
    count, erased = 0, set()
    for node in list(graph.nodes):
        if node in erased or node.op not in ("call_function", "call_module") or len(node.users) != 1:
            continue
        found = activation(gm, node)
        if found is None:
            continue
        gate, act_nodes = found
        mul = next(iter(node.users))
        if not (mul.op == "call_function" and mul.target in (operator.mul, torch.mul) and len(mul.args) == 2
                and not mul.kwargs and node in mul.args):
            continue
        up = mul.args[1] if mul.args[0] is node else mul.args[0]
        if up is node or not isinstance(up, Node):
            continue
        values = [_value(n) for n in (gate, up, mul)]
        if any(v is None for v in values):
            continue
        dtypes = {v.dtype for v in values}
        if len(dtypes) != 1 or dtypes.pop() not in _DTYPES or not all(_same_shape(v.shape, values[0].shape)
                                                                      for v in values[1:]):
            continue
        inside = set(act_nodes) | {mul}
        if any(user not in inside for n in act_nodes for user in n.users):
            continue
        if replace(gm, [mul], (gate, up), lambda g, args: [g.call_function(op, tuple(args))], what=what,
                   erased=erased) is not None:
            count += 1
    return count


@register_pass("swiglu", order=220, training=True, fusion=True)
def swiglu(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``silu(gate) * up`` -> one ``torchport::swiglu`` (the fused kernel on CUDA and Ascend).

    Rewrites what dynamo captures of Hugging Face's Llama-style MLP,
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with ``act_fn`` SiLU::

        silu = torch.nn.functional.silu(gate)          # or an nn.SiLU call_module
        h = silu * up                                  # or up * silu
        ->  h = torch.ops.torchport.swiglu(gate, up)

    Rewritten only when gate, up and the product have one shape and one floating dtype (a broadcasting product
    stays), the SiLU is not in place, and its output feeds only the product. Other activations (ReLU, GELU...) stay.
    """
    count = fuse_gated(gm, _silu, torch.ops.torchport.swiglu.default, "SwiGLU subgraph")
    if count:
        note(f"replaced {count} SwiGLU subgraph{'s' * (count > 1)} with torchport::swiglu")
    return gm
