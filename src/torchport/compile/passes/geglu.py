"""Plain-PyTorch GeGLU (``gelu_tanh(gate) * up``, Gemma's MLP) -> ``torchport::geglu``."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from ...kernels import library  # noqa: F401 - registers torch.ops.torchport
from . import note, register_pass
from .swiglu import fuse_gated

__all__ = ["geglu"]

Node = torch.fx.Node

# The constants of the tanh approximation: 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def _number(value: Any, expected: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isclose(value, expected,
                                                                                          rel_tol=1e-6)


def _binary(node: Any, *ops: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in ops and len(node.args) == 2 \
        and not node.kwargs


def _with_constant(node: Any, op: Any, constant: float) -> Any:
    """``t`` for ``constant op t`` or ``t op constant`` (``op`` being ``*`` or ``+``), else None."""
    torch_op = {operator.mul: torch.mul, operator.add: torch.add}[op]
    if not _binary(node, op, torch_op):
        return None
    a, b = node.args
    return b if _number(a, constant) else a if _number(b, constant) else None


def _gelu_tanh(gm: torch.fx.GraphModule, node: Node) -> tuple[Node, list[Node]] | None:
    """``F.gelu(gate, approximate="tanh")``, an ``nn.GELU("tanh")`` call, or the explicit tanh formula."""
    if node.op == "call_function" and node.target is F.gelu and len(node.args) <= 2 \
            and set(node.kwargs) <= {"approximate"}:
        approximate = node.args[1] if len(node.args) == 2 else node.kwargs.get("approximate", "none")
        return (node.args[0], [node]) if approximate == "tanh" and isinstance(node.args[0], Node) else None
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        try:
            module = gm.get_submodule(node.target)
        except AttributeError:
            return None
        if isinstance(module, nn.GELU) and module.approximate == "tanh" and isinstance(node.args[0], Node):
            return node.args[0], [node]
        return None
    return _gelu_formula(node)


def _gelu_formula(node: Node) -> tuple[Node, list[Node]] | None:
    """``0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * torch.pow(g, 3.0))))``, as
    transformers' ``gelu_new`` (NewGELUActivation) writes it."""
    if not _binary(node, operator.mul, torch.mul):
        return None
    for half, one_plus in (node.args, reversed(node.args)):
        gate = _with_constant(half, operator.mul, 0.5)
        tanh = _with_constant(one_plus, operator.add, 1.0)
        if not (isinstance(gate, Node) and isinstance(tanh, Node)):
            continue
        if not ((tanh.op == "call_function" and tanh.target is torch.tanh)
                or (tanh.op == "call_method" and tanh.target == "tanh")) or len(tanh.args) != 1 or tanh.kwargs:
            continue
        inner = _with_constant(tanh.args[0], operator.mul, _SQRT_2_OVER_PI)
        if not _binary(inner, operator.add, torch.add) or gate not in inner.args:
            continue
        cubic_term = inner.args[1] if inner.args[0] is gate else inner.args[0]
        cube = _with_constant(cubic_term, operator.mul, _CUBIC)
        is_pow = isinstance(cube, Node) and ((cube.op == "call_function" and cube.target in (torch.pow, operator.pow))
                                             or (cube.op == "call_method" and cube.target == "pow"))
        if not is_pow or len(cube.args) != 2 or cube.kwargs or cube.args[0] is not gate \
                or not _number(cube.args[1], 3.0):
            continue
        return gate, [cube, cubic_term, inner, tanh.args[0], tanh, one_plus, half, node]
    return None


@register_pass("geglu", order=221, training=True, fusion=True)
def geglu(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gelu_tanh(gate) * up`` -> one ``torchport::geglu`` (the fused kernel on CUDA).

    Rewrites what dynamo captures of Hugging Face's Gemma MLP, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
    with ``gelu_pytorch_tanh`` (or ``gelu_new``, the same function written out)::

        g = torch.nn.functional.gelu(gate, approximate="tanh")    # or nn.GELU("tanh"), or
        g = 0.5 * gate * (1.0 + torch.tanh(0.7978845608 * (gate + 0.044715 * torch.pow(gate, 3.0))))
        h = g * up                                                 # or up * g
        ->  h = torch.ops.torchport.geglu(gate, up)

    Rewritten only when gate, up and the product have one shape and one floating dtype and the activation's values
    feed only the product. The exact (erf) GELU, ``approximate="none"``, is a different function and stays.
    """
    count = fuse_gated(gm, _gelu_tanh, torch.ops.torchport.geglu.default, "GeGLU subgraph")
    if count:
        note(f"replaced {count} GeGLU subgraph{'s' * (count > 1)} with torchport::geglu")
    return gm
