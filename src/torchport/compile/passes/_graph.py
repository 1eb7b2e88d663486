"""Small questions the passes ask of FX nodes (a private module: it registers no pass)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["calls", "same_shape", "value"]

Node = torch.fx.Node


def value(node: Any) -> torch.Tensor | None:
    """The example tensor dynamo recorded for ``node``, if any."""
    found = node.meta.get("val", node.meta.get("example_value")) if isinstance(node, Node) else None
    return found if isinstance(found, torch.Tensor) else None


def calls(node: Any, *targets: Any, method: str | None = None) -> bool:
    """``node`` calls one of ``targets`` (functions) or the tensor method ``method``."""
    if not isinstance(node, Node):
        return False
    return (node.op == "call_function" and node.target in targets) or (node.op == "call_method"
                                                                       and node.target == method)


def same_shape(a: Any, b: Any) -> bool:
    """Two shapes known to be equal; symbolic sizes (``dynamic=True``) only when provably so, adding no guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(x == y if isinstance(x, int) and isinstance(y, int) else
                                    statically_known_true(x == y) for x, y in zip(a, b))
