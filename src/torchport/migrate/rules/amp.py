"""Rules for automatic mixed precision: the CUDA module's ``amp.autocast`` and ``amp.GradScaler``, and their
import."""

from __future__ import annotations

import libcst as cst

from ..registry import SOURCE, register_rule
from ..transform import Context
from .syntax import as_keywords, tidy

__all__: list[str] = []

_AMP = ("autocast", "GradScaler")


def _amp_call(original: cst.Call, updated: cst.Call, ctx: Context, name: str) -> cst.Call | None:
    if ctx.source_attribute(original.func) != f"amp.{name}":
        return None
    if isinstance(updated.func, cst.Name):
        if name in ctx.blocked_names:
            return None
        func = updated.func  # its import is rewritten to torch.amp by amp-import
    else:
        func = ctx.expr("{torch}.amp." + name)
    args = list(updated.args)
    if name == "autocast":  # torch.amp.autocast takes device_type first, then dtype, enabled: name them all
        args = as_keywords(args, ("enabled", "dtype", "cache_enabled"))
        if args is None:
            return None
    return updated.with_changes(func=func, args=tidy([cst.Arg(ctx.device_type()), *args]))


@register_rule("amp-autocast", cst.Call)
def amp_autocast(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's ``amp.autocast(...)`` -> ``torch.amp.autocast(DEVICE.type, ...)``.

    Positional ``enabled, dtype, cache_enabled`` become keywords. On a CPU-only machine this autocasts on the CPU
    (bfloat16 unless ``dtype`` says otherwise) where the original warned and did nothing.
    ``torch.autocast("cuda")`` and ``torch.amp.autocast(device_type="cuda")`` are handled by device-string.
    """
    return _amp_call(original, updated, ctx, "autocast")


@register_rule("amp-gradscaler", cst.Call)
def amp_gradscaler(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's ``amp.GradScaler(...)`` -> ``torch.amp.GradScaler(DEVICE.type, ...)``.

    The other arguments keep their positions (``torch.amp.GradScaler`` takes the device first, then the same ones).
    On a CPU-only machine the scaler is enabled, where the original warned and disabled itself; scaling by a power
    of two and unscaling before the step leaves float32 gradients unchanged.
    """
    return _amp_call(original, updated, ctx, "GradScaler")


@register_rule("amp-import", cst.ImportFrom)
def amp_import(original: cst.ImportFrom, updated: cst.ImportFrom, ctx: Context) -> cst.BaseStatement | None:
    """``from <the CUDA module>.amp import autocast, GradScaler`` -> ``from torch.amp import autocast, GradScaler``.

    The calls get their device type from amp-autocast and amp-gradscaler. An import of any other name from there
    is left as written and reported.
    """
    if original.relative or original.module is None or isinstance(original.names, cst.ImportStar):
        return None
    if cst.Module([]).code_for_node(original.module) != f"{SOURCE}.amp":
        return None
    names = [alias.name.value for alias in original.names]
    if not all(name in _AMP for name in names):
        ctx.blocked_names.update(names)
        return None
    return updated.with_changes(module=cst.parse_expression("torch.amp"))
