"""Rules for the CUDA module's functions: queries and device selection, memory counters, seeding, events and
streams."""

from __future__ import annotations

import libcst as cst

from ..registry import register_rule
from ..transform import Context
from .syntax import as_keywords, tidy

__all__: list[str] = []

_ACCELERATOR = {"is_available": "is_available", "device_count": "device_count",
                "current_device": "current_device_index", "set_device": "set_device_index"}
_DEVICE_MODULE = ("synchronize", "current_stream", "stream", "get_device_name")


@register_rule("cuda-query", cst.Attribute)
def cuda_query(original: cst.Attribute, updated: cst.Attribute, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's ``is_available``, ``device_count``, ``current_device``, ``set_device`` -> ``torch.accelerator``.

    ``current_device`` becomes ``current_device_index`` and ``set_device`` becomes ``set_device_index``; the others
    keep their names. Like the original, ``current_device_index`` fails on a machine with no accelerator; a call of
    ``set_device`` is guarded by cuda-set-device.
    """
    name = ctx.source_attribute(original)
    if name not in _ACCELERATOR:
        return None
    return ctx.expr("{torch}.accelerator." + _ACCELERATOR[name])


@register_rule("cuda-device-module", cst.Attribute)
def cuda_device_module(original: cst.Attribute, updated: cst.Attribute, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's ``synchronize``, ``current_stream``, ``stream``, ``get_device_name`` -> the device's module.

    ``torch.get_device_module(DEVICE).synchronize`` and so on: the module of the accelerator in use, or
    ``torch.cpu`` (which has ``synchronize``, ``current_stream`` and ``stream``) on a CPU-only machine. A call of
    ``synchronize()`` is cuda-memory's.
    """
    name = ctx.source_attribute(original)
    if name not in _DEVICE_MODULE:
        return None
    parent = ctx.parent(original)
    if name in _MEMORY_ACTIONS and isinstance(parent, cst.Call) and parent.func is original:
        return None  # a call: cuda-memory writes torch.accelerator's, guarded
    return ctx.expr("{torch}.get_device_module({device})." + name)


@register_rule("cuda-set-device", cst.Call)
def cuda_set_device(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's ``set_device(i)`` -> ``torch.accelerator.set_device_index(i)`` when an accelerator is there.

    ``if torch.accelerator.is_available(): torch.accelerator.set_device_index(i)``. Distributed scripts call it unconditionally with their LOCAL_RANK; with no accelerator there is no device to
    select (every rank shares the CPU), and ``set_device_index`` would raise. Not a whole statement, it becomes
    ``(... if torch.accelerator.is_available() else None)``.
    """
    if ctx.source_attribute(original.func) != "set_device":
        return None
    return ctx.guarded(updated, "None")


# what each returns with no accelerator, as the CUDA originals do on a CPU-only machine
_MEMORY_VALUES = {"memory_allocated": "0", "max_memory_allocated": "0", "memory_reserved": "0",
                  "max_memory_reserved": "0", "memory_stats": "{}"}
_MEMORY_ACTIONS = ("reset_peak_memory_stats", "reset_accumulated_memory_stats", "empty_cache", "synchronize")
# the CUDA module's deprecated names, and torch.accelerator's function that does the same
_MEMORY_RENAMED = {"reset_max_memory_allocated": "reset_peak_memory_stats",
                   "reset_max_memory_cached": "reset_peak_memory_stats"}


@register_rule("cuda-memory", cst.Call)
def cuda_memory(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's memory counters, ``empty_cache`` and ``synchronize()`` -> ``torch.accelerator``'s, guarded.

    ``memory_allocated(d)`` -> ``(torch.accelerator.memory_allocated(d) if torch.accelerator.is_available()
    else 0)``, and likewise ``max_memory_allocated``, ``memory_reserved``, ``max_memory_reserved`` (0 with no
    accelerator, as the originals return on a CPU-only machine) and ``memory_stats`` (``{}``).
    ``reset_peak_memory_stats()`` (also under its old names ``reset_max_memory_allocated`` and
    ``reset_max_memory_cached``), ``reset_accumulated_memory_stats()``, ``empty_cache()`` and ``synchronize()``
    become ``if torch.accelerator.is_available(): torch.accelerator.synchronize()`` (a conditional expression when
    not a whole statement): on a CPU-only machine work is done when its call returns,
    and ``torch.accelerator``'s functions raise there. Each exists in ``torch.accelerator`` since PyTorch 2.8. A
    ``device=`` keyword becomes positional (``torch.accelerator`` takes it positionally).
    """
    name = ctx.source_attribute(original.func)
    name = _MEMORY_RENAMED.get(name, name)
    if name not in _MEMORY_VALUES and name not in _MEMORY_ACTIONS:
        return None
    if any(arg.star for arg in updated.args):
        return None
    args = tidy([arg.with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT) for arg in updated.args])
    call = cst.Call(ctx.expr("{torch}.accelerator." + name), args)
    return ctx.guarded(call, _MEMORY_VALUES.get(name, "None"))


@register_rule("cuda-seed", cst.Call)
def cuda_seed(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's ``manual_seed(n)`` / ``manual_seed_all(n)`` -> the device module's, when there is one.

    ``if torch.accelerator.is_available(): torch.get_device_module(DEVICE).manual_seed(n)``: seeds the accelerator
    only, as the original did (``torch.manual_seed`` would reseed the CPU generator too), and does nothing on a
    CPU-only machine, as the original did there.
    """
    name = ctx.source_attribute(original.func)
    if name not in ("manual_seed", "manual_seed_all"):
        return None
    call = updated.with_changes(func=ctx.expr("{torch}.get_device_module({device})." + name))
    return ctx.guarded(call, "None")


HOST_EVENT = """class {name}:
    \"\"\"torch.Event on a machine without an accelerator, where PyTorch has none: the host runs work in order, so
    its clock times it.\"\"\"

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.time = None

    def record(self, stream=None):
        import time as host_time  # here, so that a module's own name "time" cannot shadow it

        self.time = host_time.perf_counter()

    def query(self):
        return True

    def synchronize(self):
        return None  # the host's work is done when its call returns

    def wait(self, stream=None):
        return None

    def elapsed_time(self, end_event):
        return (end_event.time - self.time) * 1000.0
"""


@register_rule("cuda-event", cst.Call)
def cuda_event(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's ``Event(...)`` -> ``torch.Event(...)``, or a host-clock event without an accelerator.

    ``(torch.Event(enable_timing=True) if torch.accelerator.is_available() else HostEvent(enable_timing=True))``:
    PyTorch has no CPU events (``torch.Event`` raises there), so the module gets a small ``HostEvent`` class in
    plain Python whose ``record`` reads the host clock and whose ``elapsed_time`` gives milliseconds, as CUDA's
    does. ``torch.Event`` takes the device first, so ``enable_timing``, ``blocking`` and ``interprocess`` are named.
    """
    if ctx.source_attribute(original.func) != "Event":
        return None
    args = as_keywords(list(updated.args), ("enable_timing", "blocking", "interprocess"))
    if args is None:
        ctx.unconverted(original, "Event(*args)", "name the arguments: torch.Event(enable_timing=...)")
        return None
    event = updated.with_changes(func=ctx.expr("{torch}.Event"), args=tidy(args))
    host = cst.Call(cst.Name(ctx.helper("HostEvent", HOST_EVENT)), tidy(args))
    return cst.IfExp(test=ctx.expr("{torch}.accelerator.is_available()"), body=event, orelse=host,
                     lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


@register_rule("cuda-stream", cst.Call)
def cuda_stream(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's ``Stream()`` / ``Stream(priority=p)`` -> ``torch.Stream(DEVICE, ...)``.

    The device is named: a bare ``torch.Stream()`` takes the accelerator torch was built for, so on a machine without
    that device (a CUDA build of torch on a CPU machine, the default on Linux) it fails where ``DEVICE`` is the CPU
    and a CPU stream works. A stream for a named device is left as written and reported: its device may be an
    index, a string or a ``torch.device``, and ``torch.Stream`` accepts only the last two.
    """
    if ctx.source_attribute(original.func) != "Stream":
        return None
    if any(arg.keyword is None or arg.keyword.value == "device" for arg in updated.args):
        ctx.unconverted(original, "Stream(device)", "write torch.Stream(torch.device(DEVICE.type, index))")
        return None
    return updated.with_changes(func=ctx.expr("{torch}.Stream"),
                                args=tidy([cst.Arg(ctx.expr("{device}")), *updated.args]))
