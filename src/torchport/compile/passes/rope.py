"""Plain-PyTorch rotary embeddings (Hugging Face's ``apply_rotary_pos_emb`` with ``rotate_half``) ->
``torchport::rope``."""

from __future__ import annotations

import dataclasses
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

__all__ = ["rope"]

Node = torch.fx.Node


@dataclasses.dataclass
class _Rotation:
    """``out = x * cos_u + rotate_half(x) * sin_u`` with ``cos_u = cos.unsqueeze(1)``, ``sin_u = sin.unsqueeze(1)``."""

    out: Node
    x: Node
    cos_u: Node
    sin_u: Node
    nodes: list[Node]  # what computes out from x, cos_u and sin_u (out last)

    @property
    def cos(self) -> Node:
        return self.cos_u.args[0]

    @property
    def sin(self) -> Node:
        return self.sin_u.args[0]

def _binary(node: Any, *targets: Any) -> bool:
    return _calls(node, *targets) and len(node.args) == 2 and not node.kwargs and all(
        isinstance(a, Node) for a in node.args)


def _unsqueezed_at_1(node: Any) -> bool:
    """``t.unsqueeze(1)`` / ``torch.unsqueeze(t, 1)`` (also ``dim=1``) of a 3-D ``t``."""
    if not _calls(node, torch.unsqueeze, method="unsqueeze") or not isinstance(node.args[0], Node):
        return False
    dim = node.args[1] if len(node.args) == 2 else node.kwargs.get("dim")
    source = _value(node.args[0])
    return dim == 1 and len(node.args) + len(node.kwargs) == 2 and source is not None and source.dim() == 3


def _half_slice(node: Any, x: Node, first: bool, half: int) -> bool:
    """``x[..., :half]`` (``first``) or ``x[..., half:]``."""
    if not (_calls(node, operator.getitem) and len(node.args) == 2 and node.args[0] is x):
        return False
    index = node.args[1]
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)):
        return False
    s = index[1]
    return s.step in (None, 1) and ((s.start in (None, 0) and s.stop == half) if first else
                                    (s.start == half and s.stop is None))


def _rotate_half_of(cat: Any) -> tuple[Node, list[Node]] | None:
    """(x, nodes) for ``torch.cat((-x[..., half:], x[..., :half]), dim=-1)`` with ``half = x.shape[-1] // 2``."""
    if not _calls(cat, torch.cat) or not cat.args:
        return None
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or len(cat.args) + len(cat.kwargs) != 2:
        return None
    neg, first = parts
    if not (_calls(neg, operator.neg, torch.neg, method="neg") and len(neg.args) == 1 and not neg.kwargs):
        return None
    second = neg.args[0]
    x = second.args[0] if _calls(second, operator.getitem) else None
    x_val = _value(x)
    if x_val is None or x_val.dim() != 4 or not isinstance(x_val.shape[-1], int) or x_val.shape[-1] % 2:
        return None
    half = x_val.shape[-1] // 2
    if dim not in (-1, 3) or not _half_slice(first, x, True, half) or not _half_slice(second, x, False, half):
        return None
    return x, [first, second, neg, cat]


def _match(add: Node) -> _Rotation | None:
    """The rotation whose result is ``add``: ``x * cos_u + rotate_half(x) * sin_u`` (any operand order)."""
    if not _binary(add, operator.add, torch.add):
        return None
    for direct, rotated in (add.args, reversed(add.args)):
        if not (_binary(direct, operator.mul, torch.mul) and _binary(rotated, operator.mul, torch.mul)):
            continue
        for cat, sin_u in (rotated.args, reversed(rotated.args)):
            found = _rotate_half_of(cat)
            if found is None or not _unsqueezed_at_1(sin_u):
                continue
            x, nodes = found
            if x not in direct.args or direct.args[0] is direct.args[1]:
                continue
            cos_u = direct.args[1] if direct.args[0] is x else direct.args[0]
            if _unsqueezed_at_1(cos_u):
                return _Rotation(add, x, cos_u, sin_u, [direct, *nodes, rotated, add])
    return None

def _fits(q: _Rotation, k: _Rotation) -> bool:
    """The kernel's contract: q and k ``[B, H, S, D]`` of one dtype (heads may differ), cos/sin ``[B or 1, S, D]``,
    results in the inputs' dtype, and the rotations' intermediate values used by nothing else."""
    qv, kv, cv, sv = (_value(n) for n in (q.x, k.x, q.cos, q.sin))
    outs = [_value(q.out), _value(k.out)]
    if any(v is None for v in (qv, kv, cv, sv, *outs)):
        return False
    if qv.dtype != kv.dtype or not qv.is_floating_point() or any(o.dtype != qv.dtype for o in outs):
        return False
    if not (cv.is_floating_point() and sv.is_floating_point()) or tuple(cv.shape) != tuple(sv.shape):
        return False
    batch, _, seq, dim = qv.shape
    if not (_same_shape((kv.shape[0], *kv.shape[2:]), (batch, seq, dim)) and _same_shape(cv.shape[1:], (seq, dim))):
        return False
    if not (_same_shape(cv.shape[:1], (1,)) or _same_shape(cv.shape[:1], (batch,))):
        return False
    if not (_same_shape(outs[0].shape, qv.shape) and _same_shape(outs[1].shape, kv.shape)):
        return False
    for r in (q, k):
        inside = set(r.nodes)
        if any(user not in inside for n in r.nodes[:-1] for user in n.users):
            return False
    return True


def _fused(graph: torch.fx.Graph, args: Any) -> list[Node]:
    fused = graph.call_function(torch.ops.torchport.rope.default, tuple(args))
    return [graph.call_function(operator.getitem, (fused, 0)), graph.call_function(operator.getitem, (fused, 1))]


@register_pass("rope", order=230, training=True, fusion=True)
def rope(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``apply_rotary_pos_emb`` on q and k -> one ``torchport::rope`` (q and k in one kernel on CUDA, the fused
    operator on Ascend).

    Rewrites what dynamo captures of Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim=1``)
    with ``rotate_half(x) = torch.cat((-x[..., half:], x[..., :half]), dim=-1)``::

        cos_u, sin_u = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = q * cos_u + torch.cat((-q[..., h:], q[..., :h]), dim=-1) * sin_u
        k_embed = k * cos_u + torch.cat((-k[..., h:], k[..., :h]), dim=-1) * sin_u
        ->  q_embed, k_embed = torch.ops.torchport.rope(q, k, cos, sin)

    The two rotations are paired by their shared ``cos_u`` and ``sin_u`` nodes (consecutive ones in graph order when
    more than two share them). Rewritten only for q and k ``[B, H, S, D]`` with an even ``D`` sliced exactly in
    halves, cos/sin ``[B or 1, S, D]`` unsqueezed at dim 1, results of q's dtype and shape, and intermediates used by
    nothing else. A lone rotation, an interleaved (GPT-J) rotation, ``unsqueeze_dim=2`` or a partial slice stays.
    """
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[tuple[Node, Node], list[_Rotation]] = {}
    for node in graph.nodes:
        found = _match(node)
        if found is not None:
            groups.setdefault((found.cos_u, found.sin_u), []).append(found)
    count, erased = 0, set()
    for rotations in groups.values():
        for q, k in zip(rotations[0::2], rotations[1::2]):
            inputs = (q.x, k.x, q.cos, q.sin)
            last = max(inputs, key=order.__getitem__)
            # Every input comes before both results (so neither input depends on the other result): the op goes
            # before the first result. (An input that an earlier rewrite replaced, rope applied twice, is left for
            # another run of the pass.)
            if order[last] > min(order[q.out], order[k.out]) or erased.intersection(inputs) or not _fits(q, k):
                continue
            new = replace(gm, [q.out, k.out], inputs, _fused, what="RoPE q/k pair", erased=erased)
            if new is None:
                continue
            fused = new[0].args[0]
            for key in ("val", "example_value"):
                if all(key in n.meta for n in new):
                    fused.meta[key] = tuple(n.meta[key] for n in new)
            count += 1
    if count:
        note(f"replaced {count} RoPE q/k pair{'s' * (count > 1)} with torchport::rope")
    return gm
