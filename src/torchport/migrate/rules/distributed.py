"""Rules for distributed code: the process group's backend and DistributedDataParallel's device ids."""

from __future__ import annotations

import libcst as cst

from ..registry import register_rule
from ..transform import Context
from .syntax import string_value

__all__: list[str] = []


@register_rule("dist-backend", cst.Call)
def dist_backend(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """``dist.init_process_group("nccl")`` -> ``dist.init_process_group(dist.get_default_backend_for_device(DEVICE))``.

    nccl on CUDA, hccl on an Ascend NPU, gloo on the CPU. Also ``backend="nccl"``. A backend named by a variable or
    attribute (``backend=args.dist_backend``, whose default "nccl" comes from argparse) is chosen at the call:
    ``dist.get_default_backend_for_device(DEVICE) if args.dist_backend == "nccl" else args.dist_backend`` (also for
    a subscript, ``cfg["backend"]``). Any other expression is left as written and reported.
    """
    if not ctx.qualified(original.func) & {"torch.distributed.init_process_group",
                                           "torch.distributed.distributed_c10d.init_process_group"}:
        return None
    args = list(updated.args)
    for index, arg in enumerate(args):
        is_backend = (arg.keyword is None and index == 0) or (arg.keyword and arg.keyword.value == "backend")
        if not is_backend or arg.star:
            continue
        prefix = (cst.Module([]).code_for_node(updated.func.value) if isinstance(updated.func, cst.Attribute)
                  else "{torch}.distributed")
        value = arg.value
        if string_value(value) == "nccl":
            chosen: cst.BaseExpression = ctx.expr(prefix + ".get_default_backend_for_device({device})")
        elif isinstance(value, (cst.Name, cst.Attribute, cst.Subscript)) and not (
                isinstance(value, cst.Name) and value.value == "None"):
            test = cst.Comparison(value, [cst.ComparisonTarget(cst.Equal(), cst.SimpleString('"nccl"'))])
            default = ctx.expr(prefix + ".get_default_backend_for_device({device})")
            chosen = cst.IfExp(test=test, body=default, orelse=value)
        else:
            chosen_already = isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and (
                value.func.attr.value == "get_default_backend_for_device")
            if not (chosen_already or isinstance(value, (cst.SimpleString, cst.IfExp, cst.Name))):
                ctx.unconverted(original, "init_process_group(backend=<expression>)",
                                "if it can be 'nccl', pass dist.get_default_backend_for_device(DEVICE) instead")
            return None
        args[index] = arg.with_changes(value=chosen)
        return updated.with_changes(args=args)
    return None


@register_rule("ddp-device-ids", cst.Call)
def ddp_device_ids(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """``DistributedDataParallel(m, device_ids=[r])`` -> ``device_ids=None if DEVICE.type == "cpu" else [r]``.

    Likewise ``output_device``. DistributedDataParallel refuses device ids for a module on the CPU.
    """
    if not ctx.qualified(original.func) & {"torch.nn.parallel.DistributedDataParallel",
                                           "torch.nn.parallel.distributed.DistributedDataParallel",
                                           "torch.nn.parallel.data_parallel.DistributedDataParallel"}:
        return None
    args, changed = [], False
    for arg in updated.args:
        value = arg.value
        if arg.keyword and arg.keyword.value in ("device_ids", "output_device") and not isinstance(
                value, cst.IfExp) and not (isinstance(value, cst.Name) and value.value == "None"):
            test = ctx.expr('{device}.type == "cpu"')
            arg = arg.with_changes(value=cst.IfExp(test=test, body=cst.Name("None"), orelse=value))
            changed = True
        args.append(arg)
    return updated.with_changes(args=args) if changed else None
