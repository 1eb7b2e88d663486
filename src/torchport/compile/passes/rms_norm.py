"""Plain-PyTorch RMSNorm (Hugging Face's Llama and Gemma forms) -> ``torchport::rms_norm``."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from ...kernels import library  # noqa: F401 - registers torch.ops.torchport
from . import note, register_pass
from ._graph import calls as _calls
from ._graph import same_shape as _same_shape
from ._graph import value as _value
from ._replace import replace

__all__ = ["rms_norm"]

Node = torch.fx.Node

def _binary(node: Any, op: Any) -> bool:
    """``a * b`` / ``a + b`` (operator or torch function, no keyword arguments)."""
    torch_op = {operator.mul: torch.mul, operator.add: torch.add}[op]
    return _calls(node, op, torch_op) and len(node.args) == 2 and not node.kwargs


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_eps(value: Any) -> bool:
    """A number, or a node giving a Python float (dynamo turns ``self.eps`` into ``tensor.item()`` under
    ``dynamic=True``)."""
    if isinstance(value, Node):
        return isinstance(value.meta.get("val", value.meta.get("example_value")), (float, torch.SymFloat))
    return _number(value)


def _other(node: Node, one: Any) -> Any:
    a, b = node.args[:2]
    return b if a is one else a

def _single_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _cast_dtype(node: Any) -> torch.dtype | None:
    """The dtype ``node`` converts its first argument to, when that is all it does (``float``, ``to(dtype)``,
    ``type_as(t)``)."""
    if _calls(node, method="float") and len(node.args) == 1 and not node.kwargs:
        return torch.float32
    if _calls(node, method="to"):
        given = [*node.args[1:], *node.kwargs.values()]
        if len(given) == 1 and isinstance(given[0], torch.dtype) and set(node.kwargs) <= {"dtype"}:
            return given[0]
    if _calls(node, method="type_as") and len(node.args) == 2 and not node.kwargs:
        other = _value(node.args[1])
        return None if other is None else other.dtype
    return None


def _upcast_source(node: Any) -> Any:
    """``x`` for ``x.float()`` / ``x.to(torch.float32)``, else ``node`` itself."""
    return node.args[0] if _cast_dtype(node) == torch.float32 else node


def _square_base(node: Any) -> Any:
    """``b`` for ``b.pow(2)``, ``torch.pow(b, 2)``, ``b ** 2`` or ``b * b``; else None."""
    if _calls(node, torch.pow, operator.pow, method="pow") and len(node.args) == 2 and not node.kwargs:
        return node.args[0] if _number(node.args[1]) and node.args[1] == 2 else None
    if _binary(node, operator.mul) and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _is_last_dim_mean(node: Any, ndim: int) -> bool:
    """``t.mean(-1, keepdim=True)`` (or ``dim=[-1]``, ``dim=ndim - 1``, ``torch.mean``), nothing else."""
    if not _calls(node, torch.mean, method="mean"):
        return False
    args, kwargs = list(node.args[1:]), dict(node.kwargs)
    dim = args.pop(0) if args else kwargs.pop("dim", None)
    keepdim = args.pop(0) if args else kwargs.pop("keepdim", False)
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    return (not args and not kwargs and keepdim is True and len(dims) == 1 and _number(dims[0])
            and dims[0] in (-1, ndim - 1))


def _then_cast(node: Node) -> Node:
    """``node``'s only user when that user only casts it, else ``node``."""
    user = _single_user(node)
    return user if user is not None and _cast_dtype(user) is not None and user.args[0] is node else node


def _weight(factor: Any) -> tuple[Any, float, list[Node]]:
    """(weight, offset, nodes computing the factor) for ``w``, ``w.float()``, ``1 + w`` or ``w.float() + 1``."""
    offset, nodes = 0.0, []
    if _binary(factor, operator.add):
        const = next((a for a in factor.args if _number(a)), None)
        if const is None:
            return None, 0.0, []
        offset, nodes, factor = float(const), [factor], _other(factor, const)
    if not isinstance(factor, Node):
        return None, 0.0, []
    weight = _upcast_source(factor)
    return weight, offset, nodes + ([factor] if factor is not weight else [])


def _match(rsqrt: Node) -> tuple[Node, tuple[Any, ...]] | None:
    """(the node computing the norm's result, the op's arguments) around ``rsqrt``."""
    eps_add = rsqrt.args[0] if len(rsqrt.args) == 1 and not rsqrt.kwargs else None
    if not _binary(eps_add, operator.add):
        return None
    eps = next((a for a in eps_add.args if _is_eps(a)), None)
    mean = _other(eps_add, eps) if eps is not None else None
    square = mean.args[0] if isinstance(mean, Node) and mean.args else None
    base = _square_base(square)
    normed = _single_user(rsqrt)
    if base is None or not _binary(normed, operator.mul):
        return None
    scaled = _other(normed, rsqrt)
    x = _upcast_source(scaled)
    x_val, base_val = _value(x), _value(base)
    if x is not _upcast_source(base) or x_val is None or base_val is None or x_val.dim() == 0:
        return None
    # the mean square must be taken over the last dim in float32 (or float64), as the kernel computes it
    if not x_val.is_floating_point() or base_val.dtype not in (torch.float32, torch.float64) \
            or not _is_last_dim_mean(mean, x_val.dim()):
        return None
    cast = _then_cast(normed)
    mul = _single_user(cast)
    if not _binary(mul, operator.mul):
        return None
    weight, offset, factor_nodes = _weight(_other(mul, cast))
    out = _then_cast(mul)
    out_val, w_val = _value(out), _value(weight)
    if out_val is None or w_val is None or out_val.dtype != x_val.dtype or not _same_shape(out_val.shape, x_val.shape):
        return None
    if not _same_shape(w_val.shape, x_val.shape[-1:]) or not w_val.is_floating_point():
        return None
    chain = [square, mean, eps_add, rsqrt, normed, cast, mul, *factor_nodes, out]
    # every intermediate value feeds only the pattern (the casts of x and w may have other users: they stay)
    inside = set(chain) | {scaled, base}
    if any(user not in inside for node in chain if node is not out for user in node.users):
        return None
    return out, (x, weight, eps if isinstance(eps, Node) else float(eps), offset)


def _fused(graph: torch.fx.Graph, args: Any) -> list[Node]:
    return [graph.call_function(torch.ops.torchport.rms_norm.default, tuple(args))]


@register_pass("rms_norm", order=210, training=True, fusion=True)
def rms_norm(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Plain-PyTorch RMSNorm -> one ``torchport::rms_norm`` (the fused kernel on CUDA and Ascend).

    Rewrites the norms as dynamo captures Hugging Face's code (``xf`` is ``x.to(torch.float32)`` or ``x.float()``)::

        Llama:  w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        Gemma:  (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)
        ->      torch.ops.torchport.rms_norm(x, w, eps, offset)        # offset 0 (Llama), 1.0 (Gemma)

    Operands of ``*`` and ``+`` may come in either order, the square may be ``pow(2)``, ``** 2`` or ``t * t``, the
    casts before and after the weight product are optional (``(w * xn).to(dtype)`` is OLMo 2's form). Rewritten
    only when the mean is over the last dim with ``keepdim=True`` and taken in float32 or float64, ``eps`` is a
    number (or the float dynamo reads from the module under ``dynamic=True``), the weight is a vector of the hidden
    size, the result has ``x``'s dtype and shape (what the kernel returns), and no intermediate value has another
    user. A norm without a weight or without ``eps``, or whose result is wider than ``x`` (a float32 weight times a
    bfloat16 ``x``), stays.
    """
    count, erased = 0, set()
    for node in list(gm.graph.nodes):
        if node in erased or not _calls(node, torch.rsqrt, method="rsqrt"):
            continue
        found = _match(node)
        if found is None:
            continue
        out, args = found
        if replace(gm, [out], args, _fused, what="RMSNorm subgraph", erased=erased) is not None:
            count += 1
    if count:
        note(f"replaced {count} RMSNorm subgraph{'s' * (count > 1)} with torchport::rms_norm")
    return gm
