"""libcst pieces the rules share: the value of a string literal, and argument lists rebuilt with keywords."""

from __future__ import annotations

import libcst as cst

__all__ = ["as_keywords", "string_value", "tidy"]


def string_value(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.SimpleString) and "b" not in node.prefix.lower():
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def as_keywords(args: list[cst.Arg], names: tuple[str, ...]) -> list[cst.Arg] | None:
    """Positional arguments turned into keyword ones named ``names``; None when a star argument is present."""
    out, position = [], 0
    for arg in args:
        if arg.star:
            return None
        if arg.keyword is None:
            if position >= len(names):
                return None
            arg = arg.with_changes(keyword=cst.Name(names[position]), equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
            position += 1
        out.append(arg)
    return out


def tidy(args: list[cst.Arg]) -> list[cst.Arg]:
    """Arguments with default commas, so a rebuilt argument list prints as ``a, b=c``."""
    return [arg.with_changes(comma=cst.MaybeSentinel.DEFAULT) for arg in args]
