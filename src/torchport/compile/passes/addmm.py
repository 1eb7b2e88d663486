"""A matrix product followed by a bias addition becomes one ``torch.addmm`` (one GEMM with the bias in it)."""

from __future__ import annotations

import operator

import torch
import torch.fx

from . import note, register_pass
from .constant_fold import known_value

__all__ = ["addmm"]

_MATMUL_FUNCTIONS = frozenset({operator.matmul, torch.matmul, torch.mm})
_MATMUL_METHODS = frozenset({"matmul", "mm", "__matmul__"})
_ADD_FUNCTIONS = frozenset({operator.add, torch.add})


def _matmul_operands(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    is_matmul = (node.op == "call_function" and node.target in _MATMUL_FUNCTIONS) or (
        node.op == "call_method" and node.target in _MATMUL_METHODS)
    if not is_matmul or node.kwargs or len(node.args) != 2:
        return None
    x, w = node.args
    return (x, w) if isinstance(x, torch.fx.Node) and isinstance(w, torch.fx.Node) else None


def _add_operands(node: torch.fx.Node) -> tuple[object, object] | None:
    if node.kwargs or len(node.args) != 2:  # torch.add(a, b, alpha=2) or out=: not a plain sum
        return None
    if (node.op == "call_function" and node.target in _ADD_FUNCTIONS) or (
            node.op == "call_method" and node.target in ("add", "__add__", "__radd__")):
        return node.args[0], node.args[1]
    return None


def _static(shape: torch.Size) -> bool:
    return all(isinstance(size, int) for size in shape)


def _same(a: object, b: object) -> bool:
    """Whether two sizes are equal, comparing symbolic sizes by expression (comparing their values would add a
    guard to dynamo's shape environment)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and str(a) == str(b)


def _fits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``x @ w + bias`` is an addmm: w is a matrix, x has at least two dimensions (more only with known
    sizes, to flatten), the bias broadcasts to the product without enlarging it, and all agree in dtype and
    device."""
    if w.dim() != 2 or x.dim() < 2 or bias.dim() > 2:
        return False
    if x.dim() > 2 and not (_static(x.shape) and _static(w.shape) and bias.dim() < 2):
        return False  # flattening needs known sizes; a 2-D bias would need flattening too
    if len({x.dtype, w.dtype, bias.dtype, out.dtype}) != 1 or len({x.device, w.device, bias.device}) != 1:
        return False
    product = (*x.shape[:-1], w.shape[1])
    if out.dim() != len(product) or not all(_same(a, b) for a, b in zip(out.shape, product)):
        return False
    if bias.dim() >= 1 and not (_same(bias.shape[-1], 1) or _same(bias.shape[-1], w.shape[1])):
        return False
    return bias.dim() < 2 or _same(bias.shape[0], 1) or _same(bias.shape[0], x.shape[0])


@register_pass("addmm", order=400)
def addmm(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Turn a matrix product plus a broadcast bias into one ``torch.addmm``.

    GEMM libraries compute it in one call: the bias enters the accumulator, or an epilogue, instead of a second
    pass over the product.

    Pattern::

        y = x @ w + b             # also torch.matmul / torch.mm / x.matmul(w), and b + x @ w
    ->
        y = torch.addmm(b, x, w)                                        # x: (m, k), w: (k, n), b: (n,) or (m, n)
        y = torch.addmm(b, x.reshape(-1, k), w).reshape(*lead, n)       # x: (*lead, k) with known sizes

    Shapes, dtypes and devices come from what tracing recorded (``example_value``, ``val`` or ``tensor_meta``);
    without them nothing is rewritten. Refused: a product with another user, batched products (``w`` not a
    matrix), a bias that would enlarge the result or differs in dtype (type promotion) or device, additions with
    ``alpha`` or ``out``, and x of more than two dimensions with symbolic sizes. ``F.linear`` is already one GEMM
    with its bias and is left as it is.
    """
    rewritten = 0
    for node in list(gm.graph.nodes):
        operands = _add_operands(node)
        if operands is None:
            continue
        for product, bias in (operands, operands[::-1]):
            if not isinstance(product, torch.fx.Node) or not isinstance(bias, torch.fx.Node) or bias is product:
                continue
            matmul = _matmul_operands(product)
            if matmul is None or len(product.users) != 1:
                continue
            x, w = matmul
            values = [known_value(n) for n in (x, w, bias, node)]
            if any(v is None for v in values) or not _fits(*values):
                continue
            x_value, w_value = values[0], values[1]
            with gm.graph.inserting_before(node):
                if x_value.dim() == 2:
                    fused = gm.graph.call_function(torch.addmm, (bias, x, w))
                else:
                    flat = gm.graph.call_method("reshape", (x, (-1, x_value.shape[-1])))
                    flat_sum = gm.graph.call_function(torch.addmm, (bias, flat, w))
                    fused = gm.graph.call_method("reshape", (flat_sum, (*x_value.shape[:-1], w_value.shape[1])))
            fused.meta = dict(node.meta)
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            gm.graph.erase_node(product)
            rewritten += 1
            break
    if rewritten:
        note(f"fused {rewritten} matrix product{'s' if rewritten != 1 else ''} and bias addition"
             f"{'s' if rewritten != 1 else ''} into torch.addmm")
    return gm
