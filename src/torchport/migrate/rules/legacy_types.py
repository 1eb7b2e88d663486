"""Rules for the CUDA module's legacy typed tensors (``FloatTensor``, ``LongTensor``...): their constructors and
``t.type(...)``."""

from __future__ import annotations

import libcst as cst

from ..registry import LEGACY_TYPES, SOURCE, register_rule
from ..transform import Context
from .syntax import as_keywords, string_value, tidy

__all__: list[str] = []

_SIZE_METHODS = ("size", "numel", "dim", "__len__")
# methods that give data: of tensors, and NumPy's array makers and random draws (np.random.default_rng().normal)
_DATA_METHODS = frozenset({
    "tolist", "numpy", "cpu", "detach", "clone", "array", "asarray", "stack", "concatenate", "arange", "linspace",
    "zeros", "ones", "full", "normal", "uniform", "integers", "randint", "rand", "randn", "random", "choice",
    "permutation", "standard_normal",
})


def _integer(node: cst.BaseExpression, ctx: Context) -> bool:
    """Whether ``node`` is certainly an int: a literal, ``len(x)``, ``int(x)``, ``x.size(i)``, ``x.shape[i]``,
    ``x.numel()``, or arithmetic on such."""
    if isinstance(node, cst.Integer):
        return True
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
        return _integer(node.expression, ctx)
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Add, cst.Subtract, cst.Multiply,
                                                                            cst.FloorDivide, cst.Modulo)):
        return _integer(node.left, ctx) and _integer(node.right, ctx)
    if isinstance(node, cst.Call):
        if isinstance(node.func, cst.Name) and node.func.value in ("len", "int"):
            return True
        return (isinstance(node.func, cst.Attribute) and node.func.attr.value in _SIZE_METHODS
                and (node.func.attr.value != "size" or len(node.args) == 1))
    if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Attribute):
        return node.value.attr.value == "shape"
    return False


def _shape(node: cst.BaseExpression) -> bool:
    """Whether ``node`` is certainly a torch.Size: ``x.size()`` or ``x.shape``."""
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        return node.func.attr.value == "size" and not node.args
    return isinstance(node, cst.Attribute) and node.attr.value == "shape"


def _data(node: cst.BaseExpression, ctx: Context) -> bool:
    """Whether ``node`` is certainly data: a list or tuple display, a comprehension, a slice, a NumPy call, a call
    of a method that makes arrays or draws random ones (``rng.normal(...)``), ``x.tolist()``."""
    if isinstance(node, (cst.List, cst.Tuple, cst.ListComp, cst.Float)):
        return True
    if isinstance(node, cst.Subscript):
        return any(isinstance(element.slice, cst.Slice) for element in node.slice)
    if isinstance(node, cst.Call):
        if any(name.startswith("numpy.") for name in ctx.qualified(node.func)):
            return True
        return isinstance(node.func, cst.Attribute) and node.func.attr.value in _DATA_METHODS
    return False


@register_rule("legacy-tensor-type", cst.Call)
def legacy_tensor_type(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's ``FloatTensor(...)``, ``LongTensor(...)`` (and the other legacy types) -> factories.

    Sizes (ints, ``x.size()``, ``x.shape``, or several arguments) -> ``torch.empty(2, 3, dtype=torch.float32,
    device=DEVICE)``; data (a list or tuple display, a slice, a NumPy call, ``rng.normal(...)``, ``x.tolist()``) ->
    ``torch.tensor(data, dtype=torch.float32, device=DEVICE)``; no argument -> ``torch.empty(0, ...)``. A single
    name, attribute or index (``x[i]``), which may be either, is told apart at run time as the constructor does (a
    ``torch.Size`` or a number: sizes; anything with a length: data); any other single argument is left as written
    and reported.
    """
    name = ctx.source_attribute(original.func)
    if name not in LEGACY_TYPES:
        return None
    if any(arg.star or arg.keyword is not None for arg in updated.args):
        ctx.unconverted(original, f"{name}(...) with keywords or *args",
                        f"write torch.tensor(data, dtype=torch.{LEGACY_TYPES[name]}, device=DEVICE) or "
                        f"torch.empty(sizes, dtype=torch.{LEGACY_TYPES[name]}, device=DEVICE)")
        return None
    values, seen = [arg.value for arg in updated.args], [arg.value for arg in original.args]
    options = [cst.Arg(ctx.expr("{torch}." + LEGACY_TYPES[name]), keyword=cst.Name("dtype")),
               cst.Arg(ctx.expr("{device}"), keyword=cst.Name("device"))]
    options = [arg.with_changes(equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                      whitespace_after=cst.SimpleWhitespace(""))) for arg in options]

    def factory(function: str, positional: list[cst.BaseExpression]) -> cst.Call:
        return cst.Call(ctx.expr("{torch}." + function), tidy([*map(cst.Arg, positional), *options]))

    if not values:
        return factory("empty", [cst.Integer("0")])
    if len(values) > 1 or _integer(seen[0], ctx) or _shape(seen[0]):
        return factory("empty", values)
    if _data(seen[0], ctx):
        return factory("tensor", values)
    if isinstance(values[0], (cst.Name, cst.Attribute, cst.Subscript)):
        value = cst.Module([]).code_for_node(values[0])
        # the constructor's own choice: a torch.Size, or a number (Python's or NumPy's, which have no length)
        test = ctx.expr(f'isinstance({value}, {{torch}}.Size) or not hasattr({value}, "__len__")')
        return cst.IfExp(test=test, body=factory("empty", values), orelse=factory("tensor", values),
                         lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    ctx.unconverted(original, f"{name}(<expression>)",
                    f"sizes or data? write torch.empty(sizes, dtype=torch.{LEGACY_TYPES[name]}, device=DEVICE) or "
                    f"torch.tensor(data, dtype=torch.{LEGACY_TYPES[name]}, device=DEVICE)")
    return None


def legacy_type_named(node: cst.BaseExpression, ctx: Context) -> str | None:
    """The legacy type an argument of ``.type(...)`` names: the CUDA module's ``FloatTensor``, or its name as a
    string (``"torch.cuda.FloatTensor"``); None for anything else."""
    value = string_value(node)
    if value is not None:
        prefix = f"{SOURCE}."
        return value[len(prefix):] if value.startswith(prefix) and value[len(prefix):] in LEGACY_TYPES else None
    name = ctx.source_attribute(node)
    return name if name in LEGACY_TYPES else None


@register_rule("tensor-type", cst.Call)
def tensor_type(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """``t.type(torch.cuda.FloatTensor)`` (or ``"torch.cuda.FloatTensor"``) -> ``t.to(DEVICE, torch.float32)``.

    Also on modules, and for every legacy type; ``non_blocking=`` is passed on.
    """
    func = updated.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == "type"):
        return None
    named = as_keywords(list(original.args), ("dtype", "non_blocking"))
    args = as_keywords(list(updated.args), ("dtype", "non_blocking"))
    if not named or not args or [arg.keyword.value for arg in args] not in (["dtype"], ["dtype", "non_blocking"]):
        return None
    name = legacy_type_named(named[0].value, ctx)
    if name is None:
        return None
    target = [cst.Arg(ctx.expr("{device}")), cst.Arg(ctx.expr("{torch}." + LEGACY_TYPES[name]))]
    return updated.with_changes(func=func.with_changes(attr=cst.Name("to")), args=tidy([*target, *args[1:]]))
