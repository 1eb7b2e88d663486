"""The rule registry: one :class:`Rule` per CUDA idiom, found by id.

A rule is a function ``rewrite(original, updated, ctx)`` that returns the replacement for one libcst node, or None
when the node is not its idiom. Its docstring says what it rewrites and into what; its golden before/after pairs
live in ``tests/migrate/test_rules.py``.

Example:
    >>> from torchport.migrate.registry import get_rule, list_rules
    >>> "tensor-cuda" in list_rules()
    True
    >>> get_rule("tensor-cuda").summary
    '``x.cuda()``, ``x.cuda(N)``, ``x.cuda(non_blocking=True)`` on tensors and modules -> ``x.to(...)``.'
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._registry import Registry

__all__ = ["LEGACY_TYPES", "SOURCE", "SOURCE_DEVICE", "Rule", "register_rule", "get_rule", "list_rules", "rules_for"]

#: the device type migrated away from, and its module (``torch.<type>``), whose calls the rules rewrite
SOURCE_DEVICE = "cuda"
SOURCE = f"torch.{SOURCE_DEVICE}"
#: that module's legacy tensor types (``FloatTensor``...) and the dtype (an attribute of torch) each stands for
LEGACY_TYPES = {
    "FloatTensor": "float32", "DoubleTensor": "float64", "HalfTensor": "float16", "BFloat16Tensor": "bfloat16",
    "LongTensor": "int64", "IntTensor": "int32", "ShortTensor": "int16", "CharTensor": "int8", "ByteTensor": "uint8",
    "BoolTensor": "bool",
}

Rewrite = Callable[[Any, Any, Any], Any]


@dataclass(frozen=True)
class Rule:
    """One idiom: its id, the libcst node type it looks at, and the function that rewrites it."""

    id: str
    node: type
    rewrite: Rewrite

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.rewrite) or ""

    @property
    def summary(self) -> str:
        return self.doc.split("\n", 1)[0]


def _load_builtin_rules() -> None:
    from . import rules  # noqa: F401  (registers the built-in rules on import)


_rules: Registry[Rule] = Registry("migrate rule", load=_load_builtin_rules)


def register_rule(rule_id: str, node: type) -> Callable[[Rewrite], Rewrite]:
    """Decorator that registers ``rewrite`` as the rule ``rule_id`` for libcst nodes of type ``node``.

    Rules of one node type are tried in registration order; the first that returns a node wins.

    Example:
        >>> import libcst as cst
        >>> @register_rule("my-rule", cst.Name)
        ... def my_rule(original, updated, ctx):
        ...     '''``foo`` -> ``bar``.'''
        ...     return updated.with_changes(value="bar") if updated.value == "foo" else None
    """

    def decorate(rewrite: Rewrite) -> Rewrite:
        rule = Rule(rule_id, node, rewrite)
        if rule_id not in _rules and not rule.doc:  # a taken id is the registry's error
            raise ValueError(f"migrate rule {rule_id!r} has no docstring; say what it rewrites and into what")
        _rules.register(rule_id, rule)
        return rewrite

    return decorate


def list_rules() -> list[str]:
    """Ids of every registered rule, in the order they are tried."""
    return _rules.names()


def get_rule(rule_id: str) -> Rule:
    """The rule registered as ``rule_id``; the error lists the registered ids."""
    return _rules.get(rule_id)


def rules_for(node_type: type) -> list[Rule]:
    """The rules that look at nodes of exactly ``node_type``, in registration order."""
    return [rule for rule in _rules.entries().values() if rule.node is node_type]
