"""Rules for devices written as integers: ``.to(0)``, ``.to(local_rank)``, ``torch.device(0)``, ``device=rank``,
and the ``rank % torch.cuda.device_count()`` that computes such an index.

An integer device means a CUDA device to PyTorch (``torch.device(0)`` is the current accelerator's device 0, and an
error on a machine without one), so each becomes ``torch.device(DEVICE.type, i)``: the same index of the device in
use, the CPU on a CPU-only machine. A name counts as a device index where it stands for a device (see
device-string) and is either a conventional index name (``rank``, ``local_rank``, ``gpu``, ``device_id``...) or
bound in the module only to index expressions (an int, ``int(...)``, ``x % device_count()``, ``get_rank()``,
``current_device()``); a name also bound to anything else is left alone.
"""

from __future__ import annotations

import libcst as cst

from .registry import SOURCE, SOURCE_DEVICE, register_rule
from .transform import Context

__all__: list[str] = []

#: names that hold a device index by convention (DDP tutorials and the PyTorch examples)
INDEX_NAMES = frozenset({"rank", "local_rank", "gpu", "gpu_id", "gpu_idx", "gpu_index", "device_id", "device_idx",
                         "device_index", "local_gpu"})
_INDEX_CALLS = frozenset({f"{SOURCE}.current_device", f"{SOURCE}.device_count", "torch.distributed.get_rank",
                          "torch.distributed.get_node_local_rank", "torch.accelerator.current_device_index"})
_DEVICE = frozenset({"torch.device"})


def _index_names(ctx: Context) -> frozenset[str]:
    """Names bound only to index expressions in the module, plus the conventional ones not bound to anything else."""
    cached = ctx.cache.get("index_names")
    if cached is not None:
        return cached
    good: set[str] = set()
    bad: set[str] = set()

    class Assignments(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            for target in node.targets:
                if isinstance(target.target, cst.Name):
                    (good if _is_index(node.value, ctx) else bad).add(target.target.value)

    ctx.module.visit(Assignments())
    names = frozenset((INDEX_NAMES | good) - bad)
    ctx.cache["index_names"] = names
    return names


def _is_index(node: cst.BaseExpression, ctx: Context) -> bool:
    if isinstance(node, cst.Integer):
        return True
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Modulo):
        return True
    if isinstance(node, cst.Call):
        if isinstance(node.func, cst.Name) and node.func.value == "int":
            return True
        return bool(ctx.qualified(node.func) & _INDEX_CALLS)
    return False


def _names_index(node: cst.BaseExpression, ctx: Context) -> bool:
    """Whether ``node`` (an original node) is an int literal or a name or attribute that holds a device index."""
    if isinstance(node, cst.Integer):
        return True
    if isinstance(node, cst.Name):
        return node.value in _index_names(ctx)
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name):  # args.gpu, args.local_rank
        return node.attr.value in INDEX_NAMES
    return False


def _single_argument_of_device(node: cst.CSTNode, ctx: Context) -> bool:
    arg = ctx.parent(node)
    call = ctx.parent(arg) if isinstance(arg, cst.Arg) else None
    return isinstance(call, cst.Call) and len(call.args) == 1 and bool(ctx.qualified(call.func) & _DEVICE)


def _indexed_device(index: cst.BaseExpression, ctx: Context) -> cst.Call:
    return cst.Call(ctx.expr("{torch}.device"), [cst.Arg(ctx.device_type()), cst.Arg(index)])


def _device_index(original: cst.BaseExpression, updated: cst.BaseExpression,
                  ctx: Context) -> cst.BaseExpression | None:
    if not ctx.is_device_position(original) or not _names_index(original, ctx):
        return None
    parent = ctx.parent(original)
    if not isinstance(parent, cst.Arg) and not (isinstance(parent, cst.DictElement) and ctx.is_device_position(
            ctx.parent(parent))):
        return None  # device_id = 0 stays an int: the script may use it as an index (device_ids=[device_id])
    if _single_argument_of_device(original, ctx):
        return None  # device-int rewrites the whole torch.device(i)
    call = ctx.parent(parent) if isinstance(parent, cst.Arg) else None
    if isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value == SOURCE_DEVICE:
        return None  # x.cuda(i): tensor-cuda keeps the index
    if isinstance(call, cst.Call) and any(name.startswith(SOURCE + ".") for name in ctx.qualified(call.func)):
        return None  # the CUDA module's own functions take indices; their rules say what becomes of them
    return _indexed_device(updated.with_changes(lpar=[], rpar=[]), ctx)


@register_rule("device-index", cst.Integer)
def device_index(original: cst.Integer, updated: cst.Integer, ctx: Context) -> cst.BaseExpression | None:
    """``x.to(0)``, ``device=0``, ``map_location={"cuda:0": 1}`` -> ``torch.device(DEVICE.type, 0)``.

    Also a name or ``args.<name>`` holding a device index in those places: ``x.to(local_rank)`` ->
    ``x.to(torch.device(DEVICE.type, local_rank))`` (see the module's text for which names).
    """
    return _device_index(original, updated, ctx)


@register_rule("device-index-name", cst.Name)
def device_index_name(original: cst.Name, updated: cst.Name, ctx: Context) -> cst.BaseExpression | None:
    """``x.to(local_rank)``, ``device=rank`` -> ``torch.device(DEVICE.type, local_rank)`` for a device index name."""
    return _device_index(original, updated, ctx)


@register_rule("device-index-attribute", cst.Attribute)
def device_index_attribute(original: cst.Attribute, updated: cst.Attribute,
                           ctx: Context) -> cst.BaseExpression | None:
    """``x.to(args.gpu)`` -> ``x.to(torch.device(DEVICE.type, args.gpu))`` for ``args.<conventional index name>``."""
    return _device_index(original, updated, ctx)


@register_rule("device-int", cst.Call)
def device_int(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """``torch.device(0)`` and ``torch.device(local_rank)`` -> ``torch.device(DEVICE.type, 0)``.

    ``torch.device(i)`` is device i of the current accelerator, and an error without one.
    """
    if len(original.args) != 1 or original.args[0].keyword is not None or original.args[0].star:
        return None
    if not ctx.qualified(original.func) & _DEVICE or not _names_index(original.args[0].value, ctx):
        return None
    return _indexed_device(updated.args[0].value, ctx)


@register_rule("device-count-modulo", cst.BinaryOperation)
def device_count_modulo(original: cst.BinaryOperation, updated: cst.BinaryOperation,
                        ctx: Context) -> cst.BaseExpression | None:
    """``rank % torch.cuda.device_count()`` -> ``rank % max(torch.accelerator.device_count(), 1)``.

    The device index of a rank: with no accelerator the count is 0, and every rank shares the one CPU (index 0).
    """
    right = original.right
    if not isinstance(original.operator, cst.Modulo) or not isinstance(right, cst.Call) or right.args:
        return None
    if ctx.source_attribute(right.func) != "device_count":
        return None
    count = updated.right.with_changes(lpar=[], rpar=[])
    return updated.with_changes(right=cst.Call(cst.Name("max"), [cst.Arg(count), cst.Arg(cst.Integer("1"))]))
