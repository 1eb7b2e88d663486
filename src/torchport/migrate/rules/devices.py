"""Rules for devices named in code: device strings and f-strings, checks for an accelerator, ``x.is_cuda`` and
``x.cuda()``."""

from __future__ import annotations

import re

import libcst as cst

from ..registry import SOURCE, SOURCE_DEVICE, register_rule
from ..transform import Context
from .syntax import as_keywords, string_value, tidy

__all__: list[str] = []

_INDEXED = re.compile(rf"{SOURCE_DEVICE}:(\d+)")


# -- devices named by strings ------------------------------------------------------------------------------------
@register_rule("device-string", cst.SimpleString)
def device_string(original: cst.SimpleString, updated: cst.SimpleString, ctx: Context) -> cst.BaseExpression | None:
    """``"cuda"`` -> ``DEVICE.type`` and ``"cuda:N"`` -> ``f"{DEVICE.type}:N"`` where the string names a device.

    A string names a device as the first argument of ``torch.device``, ``torch.Generator``, ``torch.autocast``,
    ``torch.amp.autocast``, ``torch.amp.GradScaler``, ``torch.set_default_device``, ``.to()`` and ``.cuda()``; as the
    value of a ``device=``, ``device_type=``, ``map_location=`` or ``device_map=`` argument, of a variable, attribute,
    parameter default or dict key whose name contains "device", of ``add_argument("--device", default=...)``; and
    as either arm of a conditional or ``or`` expression that stands in such a place. Strings stay strings.
    """
    if not ctx.is_device_position(original):
        return None
    value = string_value(original)
    if value == SOURCE_DEVICE:
        return ctx.device_type().with_changes(lpar=updated.lpar, rpar=updated.rpar)
    match = _INDEXED.fullmatch(value or "")
    if match:
        parts = [cst.FormattedStringExpression(ctx.device_type()), cst.FormattedStringText(f":{match.group(1)}")]
        return cst.FormattedString(parts, start=f"f{updated.quote}", end=updated.quote, lpar=updated.lpar,
                                   rpar=updated.rpar)
    return None


@register_rule("device-fstring", cst.FormattedString)
def device_fstring(original: cst.FormattedString, updated: cst.FormattedString,
                   ctx: Context) -> cst.BaseExpression | None:
    """``f"cuda:{rank}"`` -> ``f"{DEVICE.type}:{rank}"`` where the f-string names a device (see device-string)."""
    if not ctx.is_device_position(original) or not updated.parts:
        return None
    first = updated.parts[0]
    if not (isinstance(first, cst.FormattedStringText) and first.value.startswith(SOURCE_DEVICE + ":")):
        return None
    rest = first.value[len(SOURCE_DEVICE):]
    parts = [cst.FormattedStringExpression(ctx.device_type()), cst.FormattedStringText(rest), *updated.parts[1:]]
    return updated.with_changes(parts=parts)


@register_rule("device-check", cst.Comparison)
def device_check(original: cst.Comparison, updated: cst.Comparison, ctx: Context) -> cst.BaseExpression | None:
    """``x == "cuda"`` -> ``x != "cpu"`` and ``"cuda" in x`` -> ``"cpu" not in x`` (also ``!=`` and ``not in``).

    The question such a check asks is "is this an accelerator?": the rewritten check answers it the same on CUDA,
    yes on an NPU, and no on a CPU-only machine, as the original did there.
    """
    if len(updated.comparisons) != 1:
        return None
    target = updated.comparisons[0]
    op, swap = target.operator, {cst.Equal: cst.NotEqual, cst.NotEqual: cst.Equal}
    spacing = {"whitespace_before": op.whitespace_before, "whitespace_after": op.whitespace_after}
    if type(op) in swap and string_value(target.comparator) == SOURCE_DEVICE:
        cpu = target.comparator.with_changes(value=f'{target.comparator.quote}cpu{target.comparator.quote}')
        return updated.with_changes(comparisons=[target.with_changes(operator=swap[type(op)](**spacing),
                                                                     comparator=cpu)])
    if string_value(updated.left) == SOURCE_DEVICE and type(op) in (*swap, cst.In, cst.NotIn):
        cpu = updated.left.with_changes(value=f"{updated.left.quote}cpu{updated.left.quote}")
        if isinstance(op, cst.In):
            new_op = cst.NotIn(**spacing)
        elif isinstance(op, cst.NotIn):
            new_op = cst.In(**spacing)
        else:
            new_op = swap[type(op)](**spacing)
        return updated.with_changes(left=cpu, comparisons=[target.with_changes(operator=new_op)])
    return None


@register_rule("is-cuda", cst.Attribute)
def is_cuda(original: cst.Attribute, updated: cst.Attribute, ctx: Context) -> cst.BaseExpression | None:
    """``x.is_cuda`` -> ``x.device.type != "cpu"`` (parenthesized next to an operator, attribute or call).

    A module that assigns an attribute of that name (``self.is_cuda = ...``) has its own flag, not the tensor
    property: its uses stay as written.
    """
    if updated.attr.value != f"is_{SOURCE_DEVICE}" or f"is_{SOURCE_DEVICE}" in _assigned_attributes(ctx):
        return None
    check = cst.Comparison(
        left=cst.Attribute(cst.Attribute(updated.value, cst.Name("device")), cst.Name("type")),
        comparisons=[cst.ComparisonTarget(cst.NotEqual(), cst.SimpleString('"cpu"'))],
    )
    parent = ctx.parent(original)
    if isinstance(parent, (cst.Comparison, cst.ComparisonTarget, cst.BinaryOperation, cst.UnaryOperation)) or (
            isinstance(parent, (cst.Attribute, cst.Call)) and original in (getattr(parent, "value", None),
                                                                          getattr(parent, "func", None))):
        check = check.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return check


def _assigned_attributes(ctx: Context) -> frozenset[str]:
    """Names of the attributes the module assigns (``x.name = ...``, ``x.name += ...``, ``x.name: T = ...``)."""
    found = ctx.cache.get("assigned_attributes")
    if found is None:
        names: set[str] = set()

        class Targets(cst.CSTVisitor):
            def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
                _collect(node.target)

            def visit_AugAssign(self, node: cst.AugAssign) -> None:
                _collect(node.target)

            def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
                _collect(node.target)

        def _collect(target: cst.BaseExpression) -> None:
            if isinstance(target, cst.Attribute):
                names.add(target.attr.value)
            elif isinstance(target, (cst.Tuple, cst.List)):
                for element in target.elements:
                    _collect(element.value)

        ctx.module.visit(Targets())
        found = ctx.cache["assigned_attributes"] = frozenset(names)
    return found  # type: ignore[return-value]


# -- tensors and modules -----------------------------------------------------------------------------------------
@register_rule("tensor-cuda", cst.Call)
def tensor_cuda(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """``x.cuda()``, ``x.cuda(N)``, ``x.cuda(non_blocking=True)`` on tensors and modules -> ``x.to(...)``.

    ``x.cuda()`` -> ``x.to(DEVICE)``; ``x.cuda(N)`` -> ``x.to(torch.device(DEVICE.type, N))``, which keeps the
    index; ``x.cuda("cuda:1")`` -> ``x.to(f"{DEVICE.type}:1")``; other arguments (``non_blocking``,
    ``memory_format``) are passed on to ``.to()`` as keywords.
    """
    func = updated.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == SOURCE_DEVICE) or SOURCE in ctx.qualified(
            original.func):
        return None
    args = as_keywords(list(updated.args), ("device", "non_blocking"))
    if args is None:
        return None
    device = next((arg.value for arg in args if arg.keyword.value == "device"), None)
    rest = [arg for arg in args if arg.keyword.value != "device"]
    if device is None or (isinstance(device, cst.Name) and device.value == "None"):
        target = ctx.expr("{device}")
    elif isinstance(device, (cst.SimpleString, cst.FormattedString)):
        target = device
    else:
        target = cst.Call(ctx.expr("{torch}.device"), [cst.Arg(ctx.device_type()), cst.Arg(device)])
    return updated.with_changes(func=func.with_changes(attr=cst.Name("to")), args=tidy([cst.Arg(target), *rest]))
