"""Operators the device lacks run on the CPU: :func:`cpu_fallback`.

For each operator it takes, ``cpu_fallback`` registers a kernel on the device's dispatch key
(``torch.library.Library(namespace, "IMPL").impl(op, kernel, "PrivateUse1")`` for an NPU, ``"CUDA"`` for a GPU,
from :attr:`torchport.backends.Backend.dispatch_key`). The dispatcher then calls it wherever the operator reaches the
device, below autograd (the operator's own derivative applies, and its backward operators fall back in turn when
they are missing too). The kernel copies the tensor arguments to the CPU, runs the operator there, copies the results
back to the device of its inputs (or to the ``device=`` a factory was asked for), and copies back every argument the
operator writes (in-place and out= variants, tensor lists included), so callers see their own tensors changed. It
warns once per operator, counts every call (``torchport run --report`` prints the counts; ``TORCHPORT_LOG=fallback``
logs calls 1, 2, 4, 8... of each operator), and random operators draw from the CPU's generator.

Which operators ``ops=None`` takes: every operator of this process's dispatcher for which the device's backend says
it has no kernel (:func:`~torchport.compile.op_support.device_op_support` is ``"missing"``, or ``"host"`` where the device's
library would run it on the CPU itself, as torch_npu does, uncounted) and which the CPU can run. Left out: operators
that allocate, copy between devices or return views (a device without those cannot hold tensors, and a copy cannot
alias device memory), and torchport's own kernels, which choose their implementation per device. It is decided
when ``cpu_fallback`` is called, from the dispatcher's registrations at that moment: operators that an extension
imported later registers are not covered until ``cpu_fallback`` is called again.

Example:
    >>> torchport.compat.cpu_fallback()                        # every operator the active device lacks
    >>> torchport.compat.cpu_fallback(ops=["aten::erfinv"])    # just these (every overload)
    >>> torchport.compat.cpu_fallback(False)                   # remove them all
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .. import _logging
from ..backends import Backend, get_backend
from ..compile.op_support import device_op_support, operator_overloads
from ..device import DeviceLike

__all__ = ["call_on_cpu", "calls", "count_host_fallbacks", "cpu_fallback", "explain_missing_op", "numbers_as_tensors",
           "registered"]

# Operators that allocate, copy between devices or change storage: the fallback itself needs them on the device.
_REFUSED = frozenset({
    "aten::empty", "aten::empty_strided", "aten::_to_copy", "aten::copy_", "aten::_copy_from",
    "aten::_copy_from_and_resize", "aten::resize_", "aten::set_", "aten::lift_fresh", "aten::record_stream",
    "aten::is_pinned", "aten::_pin_memory",
})
_NOT_IMPLEMENTED = re.compile(r"Could not run '(?P<op>[^']+)' with arguments from the '(?P<key>[^']+)' backend")

_lock = threading.RLock()
_libraries: dict[str, dict[str, torch.library.Library]] = {}  # device type -> operator -> its registration
_registered: dict[str, frozenset[str]] = {}  # device type -> operators, read on every simulated npu operator
_calls: dict[tuple[str, str], int] = {}  # (device type, operator) -> calls
_sites: dict[tuple[str, str], str] = {}  # (device type, operator) -> first call site
_warned: set[tuple[str, str]] = set()


def cpu_fallback(enable: bool = True, ops: Iterable[Any] | None = None, device: DeviceLike = None) -> list[str]:
    """Run operators that ``device`` lacks on the CPU, copying their tensors there and back.

    Args:
        enable: True registers the fallback kernels; False removes them (the call counts stay for the report; an
            operator enabled again warns again).
        ops: operators to take, as ``"aten::erfinv"`` (every overload), ``"aten::add.Tensor"`` (one overload) or
            ``torch.ops`` objects; None: every operator the device has no kernel for (see the module's text).
            An operator the device has a kernel for may be named too: its kernel is then bypassed.
        device: the device type to act for (default: the shim's target when it is active, else the active device).
            On the CPU nothing needs to fall back and nothing is registered.

    Returns:
        Every operator that now falls back on that device type, sorted.

    Raises:
        ValueError: an operator that does not exist, cannot run on the CPU, or must stay on the device (those that
            allocate, copy between devices or return views); or ``ops=None`` for a device whose library cannot say
            which operators it has.

    Example:
        >>> torchport.compat.cpu_fallback(ops=["aten::erfinv"])
        ['aten::erfinv', 'aten::erfinv.out']
    """
    backend = _backend(device)
    if backend.dispatch_key is None or backend.dispatch_key == "CPU":
        return []
    with _lock:
        owned = _libraries.setdefault(backend.name, {})
        if not enable:
            removed = sorted(set(owned) if ops is None else set(owned) & set(_expand(ops, backend, check=False)))
            for name in removed:
                owned.pop(name)._destroy()
                _warned.discard((backend.name, name))  # enabled again, it warns again; its count goes on
            _logging.log("fallback", "%s: CPU fallback removed for %s", backend.name, ", ".join(removed) or "none")
        else:
            wanted = _missing(backend) if ops is None else _expand(ops, backend, check=True)
            for name in sorted(set(wanted) - set(owned)):
                owned[name] = _register(name, backend)
            _logging.log("fallback", "%s: %d operator(s) fall back to the CPU: %s", backend.name, len(owned),
                         ", ".join(sorted(owned)) or "none")
        _registered[backend.name] = frozenset(owned)
        return sorted(owned)


def count_host_fallbacks(device: DeviceLike = None) -> list[str]:
    """Count the operators the device's own library runs on the CPU (torch_npu's CPU fallback), each with its first
    call site, for ``torchport run --report``.

    A library's fallback runs silently after one warning, so a program slowed by host round trips looks like an
    idle device. Each operator the library would send to the CPU
    (:func:`~torchport.compile.op_support.device_op_support` ``"host"``) gets :func:`cpu_fallback`'s kernel instead, which does the same work (copy to the CPU, run, copy
    back) and counts every call. Nothing is registered for a device without such a fallback, or whose library is
    not loaded; operators that must stay on the device are left to the library.

    Returns:
        The operators now counted, sorted.

    Example:
        >>> count_host_fallbacks("npu")
        ['aten::erfinv', 'aten::erfinv.out']
    """
    backend = _backend(device)
    if backend.dispatch_key in (None, "CPU") or not backend.host_fallback:
        return []
    if backend.has_kernel("aten::empty.memory_format") is None:
        return []
    host = [name for name in torch._C._dispatch_get_all_op_names()
            if device_op_support(backend, name) == "host" and _refusal(name) is None]
    if not host:
        return []
    cpu_fallback(ops=host, device=backend.name)
    return sorted(host)


def registered(device_type: str) -> frozenset[str]:
    """The operators that fall back to the CPU on ``device_type`` now.

    Example:
        >>> registered("npu")
        frozenset({'aten::erfinv', 'aten::erfinv.out'})
    """
    return _registered.get(device_type, frozenset())


def calls() -> list[dict[str, Any]]:
    """Every operator that ran through the fallback: device type, operator, call count and first call site, most
    called first.

    Example:
        >>> calls()
        [{'device': 'npu', 'op': 'aten::erfinv', 'calls': 3, 'first_site': 'train.py:41'}]
    """
    with _lock:
        rows = [{"device": device, "op": op, "calls": n, "first_site": _sites.get((device, op), "?")}
                for (device, op), n in _calls.items()]
    return sorted(rows, key=lambda row: (-row["calls"], row["op"]))


def explain_missing_op(exc: BaseException) -> str | None:
    """What to do about a ``NotImplementedError`` from PyTorch's dispatcher for an operator a device lacks; None
    for any other error.

    Example:
        >>> explain_missing_op(NotImplementedError("Could not run 'aten::erfinv' with arguments from the "
        ...                                        "'PrivateUse1' backend. ..."))
        "aten::erfinv has no kernel for npu. Run it on the CPU: call torchport.compat.cpu_fallback(...)..."
    """
    match = _NOT_IMPLEMENTED.search(str(exc)) if isinstance(exc, NotImplementedError) else None
    if match is None:
        return None
    op, key = match.group("op"), match.group("key")
    if key == "CPU":
        return (f"{op} has no CPU kernel either (a device library's own CPU fallback, such as torch_npu's, sent it "
                "there), so no CPU fallback can run it: replace it in the model. `torchport coverage TARGET "
                "--device D` lists every operator the model runs and whether D has it.")
    device = _device_type_of(key)
    return (f"{op} has no kernel for {device}. Run it on the CPU: call torchport.compat.cpu_fallback(ops="
            f"[{op!r}]) before the model runs (or torchport.compat.cpu_fallback() for every operator {device} "
            f"lacks); `torchport coverage TARGET --device {device}` lists every operator the model needs that "
            f"{device} lacks.")


def call_on_cpu(op: torch._ops.OpOverload, device_type: str, args: tuple, kwargs: dict) -> Any:
    """Run ``op`` on the CPU on copies of its ``device_type`` tensors; return its results on the device, and copy
    back the arguments it writes. The fallback kernels' body, also used by :func:`torchport.compile.coverage`.

    Example:
        >>> call_on_cpu(torch.ops.aten.erfinv.default, "npu", (x,), {})
    """
    target: torch.device | None = None

    def to_cpu(value: Any) -> Any:
        nonlocal target
        if isinstance(value, torch.Tensor) and value.device.type == device_type:
            target = target or value.device
            return value.to("cpu")
        return value

    cpu_args, cpu_kwargs = tree_map(to_cpu, (numbers_as_tensors(op, args), dict(kwargs)))
    requested = kwargs.get("device")
    if requested is not None and torch.device(requested).type == device_type:  # a factory: make it on the CPU
        target = target or torch.device(requested)
        cpu_kwargs["device"] = torch.device("cpu")
    if kwargs.get("pin_memory"):
        cpu_kwargs["pin_memory"] = False
    generator = kwargs.get("generator")
    if generator is not None and generator.device.type != "cpu":
        cpu_kwargs["generator"] = None  # a device generator cannot draw CPU numbers: the CPU's default one does
    out = op(*cpu_args, **cpu_kwargs)
    if target is None:
        target = get_backend(device_type).device(get_backend(device_type).current_index())

    schema = op._schema
    written: dict[str, Any] = {}  # alias set name -> the caller's argument the operator wrote
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        original, copy = _argument(args, kwargs, i, argument), _argument(cpu_args, cpu_kwargs, i, argument)
        _write_back(original, copy)
        written.update(dict.fromkeys(argument.alias_info.before_set, original))

    def to_target(value: Any) -> Any:
        return value.to(target) if isinstance(value, torch.Tensor) and value.device.type == "cpu" else value

    results = []
    for ret, value in zip(schema.returns, out if len(schema.returns) > 1 else (out,)):
        aliases = ret.alias_info.before_set if ret.alias_info is not None else set()
        mine = next((written[name] for name in aliases if name in written), None)
        results.append(mine if mine is not None else tree_map(to_target, value))
    if not schema.returns:
        return None
    return tuple(results) if len(schema.returns) > 1 else results[0]


def numbers_as_tensors(op: torch._ops.OpOverload, args: tuple) -> tuple:
    """``args`` with 0-dim host tensors for the Python numbers in Tensor places, so ``op`` accepts them: the
    dispatcher hands a Python kernel ``x * 3`` as ``mul.Tensor(x, 3)``. Each gets its number's default dtype, which promotes as the
    number would (an int tensor times 2.5 is float32, a float16 tensor times 2.5 stays float16)."""
    if not any(isinstance(a, (bool, int, float, complex)) for a in args):
        return tuple(args)
    out = list(args)
    for i, argument in enumerate(op._schema.arguments[:len(out)]):
        value = out[i]
        if isinstance(value, (bool, int, float, complex)) and isinstance(argument.type, torch._C.TensorType):
            out[i] = torch.scalar_tensor(value, dtype=_NUMBER_DTYPES[type(value)]())
    return tuple(out)


_NUMBER_DTYPES = {bool: lambda: torch.bool, int: lambda: torch.int64, float: torch.get_default_dtype,
                  complex: lambda: torch.complex128 if torch.get_default_dtype() == torch.float64 else torch.complex64}


def _argument(args: tuple | list, kwargs: dict, index: int, argument: Any) -> Any:
    if not argument.kwarg_only and index < len(args):
        return args[index]
    return kwargs.get(argument.name)


def _write_back(original: Any, copy: Any) -> None:
    if isinstance(original, torch.Tensor):
        if original.shape != copy.shape:  # an out= tensor the operator resized
            original.resize_(copy.shape)
        original.copy_(copy)
    elif isinstance(original, (list, tuple)):
        for item, item_copy in zip(original, copy):
            _write_back(item, item_copy)


def _backend(device: DeviceLike) -> Backend:
    if device is None:
        from . import target

        device = target()
    from ..device import resolve

    return resolve(device, source="device")[0]


def _device_type_of(key: str) -> str:
    if key == "PrivateUse1":
        return torch._C._get_privateuse1_backend_name()
    from ..backends import list_backends

    for name in list_backends():
        if get_backend(name).dispatch_key == key:
            return name
    return key


def _overload(name: str) -> torch._ops.OpOverload:
    namespace, _, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), base), overload or "default")


def _refusal(name: str) -> str | None:
    """Why ``name`` cannot fall back to the CPU, or None."""
    if name.startswith("torchport::"):
        return "it is a torchport kernel, which chooses its implementation per device itself"
    if name.partition(".")[0] in _REFUSED:
        return "it allocates or copies between devices, which the fallback itself does on the device"
    try:
        schema = _overload(name)._schema
    except (AttributeError, RuntimeError):
        return "it has no Python binding in torch.ops"
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return "it returns a view of its input, and a copy on the CPU cannot alias device memory"
    if device_op_support("cpu", name) != "native":
        return "the CPU has no kernel for it either"
    return None


def _expand(ops: Iterable[Any], backend: Backend, check: bool) -> list[str]:
    names: list[str] = []
    for entry in ([ops] if isinstance(ops, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else ops):
        try:
            overloads = operator_overloads(entry)
        except ValueError as exc:
            raise ValueError(f"cpu_fallback: {exc}") from None
        if check:
            refused = {name: _refusal(name) for name in overloads}
            kept = [name for name, why in refused.items() if why is None]
            if not kept:  # one reason serves: for every overload of one operator it is the same
                raise ValueError(f"cpu_fallback: {entry if isinstance(entry, str) else overloads[0]} cannot run on "
                                 f"the CPU for {backend.name}: {next(iter(refused.values()))}")
            overloads = kept  # a named operator's view or primitive overloads stay on the device
        names.extend(overloads)
    return names


def _missing(backend: Backend) -> list[str]:
    if backend.has_kernel("aten::empty.memory_format") is None:
        raise ValueError(f"cpu_fallback: cannot tell which operators {backend.name} lacks: its library is not "
                         f"loaded in this process ({backend.unavailable_reason()}); name them with ops=[...]")
    names = []
    for name in torch._C._dispatch_get_all_op_names():
        if device_op_support(backend, name) in ("missing", "host") and _refusal(name) is None:
            names.append(name)
    return names


def _register(name: str, backend: Backend) -> torch.library.Library:
    op = _overload(name)
    device_type = backend.name

    def kernel(*args: Any, **kwargs: Any) -> Any:
        _count(device_type, name)
        return call_on_cpu(op, device_type, args, kwargs)

    library = torch.library.Library(name.partition("::")[0], "IMPL")
    with warnings.catch_warnings():  # replacing the device's own kernel, when one was named, is what was asked
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        library.impl(name.partition("::")[2], kernel, backend.dispatch_key)
    return library


def _count(device_type: str, name: str) -> None:
    key = (device_type, name)
    with _lock:
        count = _calls[key] = _calls.get(key, 0) + 1
        first = key not in _warned
        _warned.add(key)
    if first:
        from .report import call_site

        site = _sites[key] = call_site(program=False)
        warnings.warn(f"torchport: {name} runs on the CPU instead of {device_type} (first from {site}): torchport."
                      "compat.cpu_fallback copies its tensors there and back, which takes time", stacklevel=3)
    if count & (count - 1) == 0:  # 1, 2, 4, 8...: the counts grow in the log without a line per call
        _logging.log("fallback", "%s ran on the CPU instead of %s: call %d (first from %s)", name, device_type,
                     count, _sites.get(key, "?"))
