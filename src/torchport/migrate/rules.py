"""The built-in rules of ``torchport migrate``: one function per CUDA idiom, registered by id.

Every rule returns plain PyTorch that does on CUDA what the original did, and also runs on any other accelerator
(through ``torch.accelerator`` and ``torch.get_device_module``) and on a CPU-only machine. ``DEVICE`` below is the
one definition the transformer puts after the imports of a module that needs it:
``DEVICE = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")``. "The CUDA module" is ``torch.`` +
``cuda``; golden before/after pairs for every rule are in ``tests/migrate/test_rules.py``.
"""

from __future__ import annotations

import re

import libcst as cst

from .registry import LEGACY_TYPES, SOURCE, SOURCE_DEVICE, register_rule
from .transform import Context

__all__: list[str] = []

_INDEXED = re.compile(rf"{SOURCE_DEVICE}:(\d+)")


def _string_value(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.SimpleString) and "b" not in node.prefix.lower():
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _keywords(args: list[cst.Arg], names: tuple[str, ...]) -> list[cst.Arg] | None:
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


def _tidy(args: list[cst.Arg]) -> list[cst.Arg]:
    """Arguments with default commas, so a rebuilt argument list prints as ``a, b=c``."""
    return [arg.with_changes(comma=cst.MaybeSentinel.DEFAULT) for arg in args]


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
    value = _string_value(original)
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
    if type(op) in swap and _string_value(target.comparator) == SOURCE_DEVICE:
        cpu = target.comparator.with_changes(value=f'{target.comparator.quote}cpu{target.comparator.quote}')
        return updated.with_changes(comparisons=[target.with_changes(operator=swap[type(op)](**spacing),
                                                                     comparator=cpu)])
    if _string_value(updated.left) == SOURCE_DEVICE and type(op) in (*swap, cst.In, cst.NotIn):
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
    args = _keywords(list(updated.args), ("device", "non_blocking"))
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
    return updated.with_changes(func=func.with_changes(attr=cst.Name("to")), args=_tidy([cst.Arg(target), *rest]))


# -- the CUDA module's functions ---------------------------------------------------------------------------------
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
    args = _tidy([arg.with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT) for arg in updated.args])
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
    args = _keywords(list(updated.args), ("enable_timing", "blocking", "interprocess"))
    if args is None:
        ctx.unconverted(original, "Event(*args)", "name the arguments: torch.Event(enable_timing=...)")
        return None
    event = updated.with_changes(func=ctx.expr("{torch}.Event"), args=_tidy(args))
    host = cst.Call(cst.Name(ctx.helper("HostEvent", HOST_EVENT)), _tidy(args))
    return cst.IfExp(test=ctx.expr("{torch}.accelerator.is_available()"), body=event, orelse=host,
                     lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


@register_rule("cuda-stream", cst.Call)
def cuda_stream(original: cst.Call, updated: cst.Call, ctx: Context) -> cst.BaseExpression | None:
    """The CUDA module's ``Stream()`` / ``Stream(priority=p)`` -> ``torch.Stream(...)`` on the current device.

    A stream for a named device is left as written and reported: its device may be an index, a string or a
    ``torch.device``, and ``torch.Stream`` accepts only the last two.
    """
    if ctx.source_attribute(original.func) != "Stream":
        return None
    if any(arg.keyword is None or arg.keyword.value == "device" for arg in updated.args):
        ctx.unconverted(original, "Stream(device)", "write torch.Stream(torch.device(DEVICE.type, index))")
        return None
    return updated.with_changes(func=ctx.expr("{torch}.Stream"))


# -- automatic mixed precision -----------------------------------------------------------------------------------
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
        args = _keywords(args, ("enabled", "dtype", "cache_enabled"))
        if args is None:
            return None
    return updated.with_changes(func=func, args=_tidy([cst.Arg(ctx.device_type()), *args]))


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


# -- distributed -------------------------------------------------------------------------------------------------
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
        if _string_value(value) == "nccl":
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


# -- legacy typed tensors ----------------------------------------------------------------------------------------
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
        return cst.Call(ctx.expr("{torch}." + function), _tidy([*map(cst.Arg, positional), *options]))

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
    value = _string_value(node)
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
    named = _keywords(list(original.args), ("dtype", "non_blocking"))
    args = _keywords(list(updated.args), ("dtype", "non_blocking"))
    if not named or not args or [arg.keyword.value for arg in args] not in (["dtype"], ["dtype", "non_blocking"]):
        return None
    name = legacy_type_named(named[0].value, ctx)
    if name is None:
        return None
    target = [cst.Arg(ctx.expr("{device}")), cst.Arg(ctx.expr("{torch}." + LEGACY_TYPES[name]))]
    return updated.with_changes(func=func.with_changes(attr=cst.Name("to")), args=_tidy([*target, *args[1:]]))


from . import device_index  # noqa: E402,F401  (registers the rules for integer devices)
