"""Guards that stop a script when no GPU is found: rewritten like any other site, and reported to review.

``if args.cuda and not torch.cuda.is_available(): raise Exception("No GPU found, please run without --cuda")``
becomes a check of ``torch.accelerator``, which finds no accelerator on a CPU-only machine: there the migrated script
stops as the original did, unless it is called so that the guard's other condition is false. Each such guard
(``if`` with a ``raise`` or ``sys.exit``, or ``assert``, on ``is_available()`` or ``device_count()``) is listed with
its line and how to call the script on a CPU, found from the script's own ``add_argument`` calls where it can be.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from .registry import SOURCE

if TYPE_CHECKING:
    from .transform import Context

__all__ = ["command_line_options", "check_assert", "check_if"]

_EXITS = frozenset({"sys.exit", "exit", "quit", "os._exit", "builtins.exit", "builtins.quit"})
# device_count() compared with a number: which operators make the comparison true when the count is 0
_FEW = (cst.LessThan, cst.LessThanEqual, cst.Equal)
_MANY = (cst.GreaterThan, cst.GreaterThanEqual, cst.NotEqual)


def command_line_options(module: cst.Module) -> dict[str, tuple[str, bool | None]]:
    """The module's ``add_argument`` options: destination -> (option string, the value its presence sets, when it is
    a store_true / store_false flag)."""

    class Collect(cst.CSTVisitor):
        def __init__(self) -> None:
            self.found: dict[str, tuple[str, bool | None]] = {}

        def visit_Call(self, node: cst.Call) -> None:
            if not (isinstance(node.func, cst.Attribute) and node.func.attr.value == "add_argument"):
                return
            flags = [value for arg in node.args if arg.keyword is None and (value := _text(arg.value))
                     and value.startswith("-")]
            keywords = {arg.keyword.value: _text(arg.value) for arg in node.args if arg.keyword is not None}
            if not flags:
                return
            option = next((flag for flag in flags if flag.startswith("--")), flags[0])
            dest = keywords.get("dest") or option.lstrip("-").replace("-", "_")
            given = {"store_true": True, "store_false": False}.get(keywords.get("action") or "")
            self.found.setdefault(dest, (option, given))

    collector = Collect()
    module.visit(collector)
    return collector.found


def _text(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.SimpleString) and "b" not in node.prefix.lower():
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _asks(ctx: Context, node: cst.CSTNode, name: str) -> bool:
    return isinstance(node, cst.Call) and f"{SOURCE}.{name}" in ctx.qualified(node.func)


def _no_accelerator(ctx: Context, test: cst.BaseExpression, true_when_none: bool) -> bool:
    """Whether ``test`` holds an availability check that is ``true_when_none`` when no GPU is found."""
    if isinstance(test, cst.BooleanOperation):
        return _no_accelerator(ctx, test.left, true_when_none) or _no_accelerator(ctx, test.right, true_when_none)
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return _no_accelerator(ctx, test.expression, not true_when_none)
    if _asks(ctx, test, "is_available"):
        return not true_when_none
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and _asks(ctx, test.left, "device_count"):
        return isinstance(test.comparisons[0].operator, _FEW if true_when_none else _MANY)
    return False


def _stops(body: cst.BaseSuite) -> str | None:
    """"raises" or "exits" when the block does either at its top level, else None."""
    for statement in body.body:
        for node in statement.body if isinstance(statement, cst.SimpleStatementLine) else [statement]:
            if isinstance(node, cst.Raise):
                return "raises"
            if isinstance(node, cst.Expr) and isinstance(node.value, cst.Call):
                if cst.Module([]).code_for_node(node.value.func) in _EXITS:
                    return "exits"
    return None


def _operands(test: cst.BaseExpression, operator: type) -> list[cst.BaseExpression]:
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, operator):
        return _operands(test.left, operator) + _operands(test.right, operator)
    return [test]


def _how_to_call(ctx: Context, others: list[cst.BaseExpression], must_be: bool,
                 options: dict[str, tuple[str, bool | None]]) -> str:
    """How to call the script so that each of ``others`` is ``must_be``, from its command-line options."""
    if not others:
        return "the script refuses to run without one: delete the check and the migrated code runs on the CPU"
    ways = []
    for condition in others:
        negated = isinstance(condition, cst.UnaryOperation) and isinstance(condition.operator, cst.Not)
        inner = condition.expression if negated else condition
        wanted = must_be != negated  # the value the option must take
        if isinstance(inner, cst.Attribute) and inner.attr.value in options:
            option, given = options[inner.attr.value]
            if given is not None:
                ways.append(f"{'with' if given == wanted else 'without'} {option}")
                continue
        ways.append(f"so that `{cst.Module([]).code_for_node(condition)}` is {must_be}")
    return f"run the script there {' and '.join(ways)}"


def _report(ctx: Context, node: cst.CSTNode, what: str, how: str) -> None:
    ctx.review(node, f"{what} when no GPU is found",
               f"it now checks torch.accelerator, which finds none on a CPU-only machine; {how}")


def check_if(ctx: Context, node: cst.If, options: dict[str, tuple[str, bool | None]]) -> None:
    """Report ``if <no GPU>: raise ...`` (or ``sys.exit(...)``)."""
    verb = _stops(node.body)
    if verb and _no_accelerator(ctx, node.test, True):
        others = [c for c in _operands(node.test, cst.And) if not _no_accelerator(ctx, c, True)]
        _report(ctx, node, verb, _how_to_call(ctx, others, False, options))


def check_assert(ctx: Context, node: cst.Assert, options: dict[str, tuple[str, bool | None]]) -> None:
    """Report ``assert torch.cuda.is_available()`` (or a device count)."""
    if _no_accelerator(ctx, node.test, False):
        others = [c for c in _operands(node.test, cst.Or) if not _no_accelerator(ctx, c, False)]
        _report(ctx, node, "fails its assert", _how_to_call(ctx, others, True, options))
