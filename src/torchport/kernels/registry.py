"""Op name -> implementations; the implementation for a call is chosen by the device of its input tensors.

Every op has a ``reference`` implementation in plain PyTorch that runs on every device and is the fallback. Faster
ones declare the device types they serve and a priority; ``TORCHPORT_KERNELS`` (or
``torchport.settings.override(kernels=...)``) picks between them:

* ``auto`` (default): the highest-priority implementation serving the device. If it cannot run (its library is
  missing, the dtype or shape is unsupported, it fails to compile), torchport warns once for that cause and uses the
  reference, and stops trying an implementation that failed to load or compile on that device type.
* an implementation's name (``reference``, ``triton``, ``npu``, ``chunked``: :func:`kernel_modes`), globally or
  per op (``rms_norm=reference,rope=triton``): the named implementation or an error that says why it cannot run.
  Nothing falls back silently.

Each op also registers its :class:`~torchport.kernels.spec.OpSpec` (:func:`register_op`), which the tests, the
benchmarks, the dashboard and the custom ops of :mod:`torchport.kernels.library` read.

Example:
    >>> from torchport.kernels import registry
    >>> registry.select("rms_norm", torch.device("cpu")).name
    'reference'
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil
import sys
import threading
import warnings
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint

from .. import _settings
from .._registry import Registry
from ._implementation import (Implementation, InputError, KernelError, Unsupported, fused_op, fused_op_reason,
                              fused_op_unavailable, triton_reason)
from .checks import capturing
from .spec import OpSpec

__all__ = [
    "HOST_BOUND_ELEMENTS",
    "Implementation",
    "InputError",
    "KernelError",
    "Unsupported",
    "call",
    "call_backward",
    "custom_op",
    "forced",
    "fused_op",
    "fused_op_reason",
    "fused_op_unavailable",
    "host_bound",
    "implementation",
    "kernel_modes",
    "list_kernels",
    "list_specs",
    "refresh",
    "register_kernel",
    "register_op",
    "select",
]

logger = logging.getLogger("torchport")

# Modules of this package that are not ops: the custom ops for compiled graphs, imported by the compile passes only
# (registering them costs time that eager users should not pay).
_NOT_OPS = frozenset({"library"})


def _import_ops() -> None:
    # every public module of this package declares its ops (kernels/<op>.py): adding an op is adding a file
    for info in sorted(pkgutil.iter_modules(importlib.import_module(__package__).__path__), key=lambda m: m.name):
        if not (info.ispkg or info.name.startswith("_") or info.name in _NOT_OPS):
            importlib.import_module(f"{__package__}.{info.name}")


_specs: Registry[OpSpec] = Registry("kernel op", load=_import_ops, origin=lambda spec: spec.call.__module__)
_ops: dict[str, dict[str, Implementation]] = {}
_lock = threading.RLock()
_broken: dict[tuple[str, str, str], str] = {}  # (op, implementation, device type) -> why it failed to load/compile
_warned: set[tuple[str, str, str]] = set()
_availability: dict[tuple[str, str, str], str | None] = {}
# The implementation chosen per (op, device type, where TORCHPORT_KERNELS comes from): a kernel call costs a
# dictionary lookup, not a settings parse, a sort and availability probes (39 us of a 360 us RMSNorm step on the
# CPU, measured with benchmarks/kernel_host_overhead.py --device cpu). Cleared whenever an answer could change: an
# implementation registered, one found broken, refresh().
_choices: dict[tuple[str, str, Hashable], Implementation] = {}
_forced: dict[tuple[str, Hashable], bool] = {}


def register_kernel(
    op: str, name: str, *, devices: Iterable[str] | None = None, priority: int = 0,
    requires: Callable[[torch.device], str | None] | None = None, backward: Callable[..., Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as implementation ``name`` of ``op`` for the given device types (None: every device).

    A second registration of the same op and name is refused. Every op must have a ``reference``. An
    implementation named ``triton`` requires the triton package unless ``requires`` says otherwise. ``backward``
    is the implementation's own backward for compiled graphs (:attr:`Implementation.backward`, run by
    :func:`call_backward`); without one, a compiled graph differentiates the forward run again.

    Example:
        >>> @register_kernel("rms_norm", "mylib", devices=["cuda"], priority=20)
        ... def rms_norm_mylib(x, weight, eps, offset, in_place): ...
    """
    if name == "reference" and devices is not None:
        raise ValueError(f"the reference implementation of {op!r} must serve every device (devices=None)")
    if name == "triton" and requires is None:
        requires = triton_reason

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        with _lock:
            impls = _ops.setdefault(op, {})
            if name in impls:
                raise ValueError(
                    f"kernel {op!r} already has an implementation named {name!r} ({impls[name].fn.__module__}); "
                    f"registered: {', '.join(impls)}"
                )
            served = None if devices is None else frozenset(devices)
            impls[name] = Implementation(op, name, fn, served, priority, requires, backward)
            _forget_choices()
        return fn

    return decorate


def register_op(spec: OpSpec) -> OpSpec:
    """Register the :class:`~torchport.kernels.spec.OpSpec` of an op (once per name); returns it.

    Example:
        >>> SPEC = register_op(OpSpec("my_op", "MyOp", "computes ...", ("my_op",), ...))
    """
    registered = _specs.register(spec.name, spec)
    library = sys.modules.get(f"{__package__}.library")
    if library is not None:  # an op registered after the custom ops were: its own now, not inside a compiled call
        library.ensure(spec)
    return registered


def list_specs() -> dict[str, OpSpec]:
    """Every op's spec by name, in the order their modules were imported.

    Example:
        >>> list_specs()["rope"].title
        'RoPE'
    """
    return _specs.entries()


def kernel_modes() -> tuple[str, ...]:
    """What ``TORCHPORT_KERNELS`` accepts: ``auto`` and the name of every registered implementation.

    Example:
        >>> kernel_modes()
        ('auto', 'chunked', 'npu', 'reference', 'triton')
    """
    _ensure_loaded()
    with _lock:
        return ("auto", *sorted({name for impls in _ops.values() for name in impls}))


def _ensure_loaded() -> None:
    _specs.entries()  # imports the ops' modules once


def refresh() -> None:
    """Forget which implementations were found unavailable or broken, and which warnings were given (for example
    after installing Triton or a newer torch_npu in a running process)."""
    with _lock:
        _broken.clear()
        _warned.clear()
        _forget_choices()


def _forget_choices() -> None:
    _availability.clear()
    _choices.clear()
    _forced.clear()


def list_kernels() -> dict[str, list[str]]:
    """Every registered op with the names of its implementations, by descending priority.

    Example:
        >>> list_kernels()["rms_norm"]
        ['triton', 'npu', 'reference']
    """
    _ensure_loaded()
    return {op: [impl.name for impl in sorted(impls.values(), key=lambda i: -i.priority)] for op, impls in _ops.items()}


def implementation(op: str, name: str) -> Implementation:
    """The implementation ``name`` of ``op`` (tests call its ``fn`` directly, e.g. Triton under its interpreter)."""
    impls = _implementations(op)
    if name not in impls:
        raise ValueError(f"kernel {op!r} has no implementation {name!r}; it has: {', '.join(impls)}")
    return impls[name]


def _implementations(op: str) -> dict[str, Implementation]:
    _ensure_loaded()
    if op not in _ops:
        raise ValueError(f"unknown kernel {op!r}; registered: {', '.join(sorted(_ops))}")
    return _ops[op]


def _mode(op: str) -> tuple[str, bool]:
    """The mode for ``op`` and whether the user forced it (rather than leaving it to ``auto``)."""
    choice = _settings.value("kernels")
    if len(choice) > 1:
        unknown = sorted(set(choice) - {"*"} - set(_ops))
        if unknown:
            raise ValueError(
                f"TORCHPORT_KERNELS names unknown kernel(s) {', '.join(unknown)}; registered: {', '.join(sorted(_ops))}"
            )
    mode = choice.get(op, choice["*"])
    return mode, mode != "auto"


def _available(impl: Implementation, device: torch.device) -> str | None:
    key = (impl.op, impl.name, device.type)
    if key in _broken:
        return _broken[key]
    if key not in _availability:
        try:
            _availability[key] = impl.unavailable_reason(device)
        except Exception as exc:  # a probe that fails is a reason, not a crash
            _availability[key] = f"{type(exc).__name__}: {exc}"
    return _availability[key]


def select(op: str, device: torch.device, *, quiet: bool = False) -> Implementation:
    """The implementation that a call of ``op`` on ``device`` would use now (before argument checks).

    In auto mode an implementation whose library or vendor operator is missing is skipped (and the reason is
    logged once); in a forced mode such an implementation raises :class:`KernelError`. The answer is kept per op,
    device type and ``TORCHPORT_KERNELS`` source (:func:`torchport.settings.source`), until an implementation is
    registered or found broken, or :func:`refresh` is called.
    """
    key = (op, device.type, _settings.source("kernels"))
    impl = _choices.get(key)
    if impl is None:
        impl = _select(op, device, quiet)
        if not quiet:  # a quiet answer skipped the warnings that the first loud call must give
            _choices[key] = impl
    return impl


def _select(op: str, device: torch.device, quiet: bool) -> Implementation:
    impls = _implementations(op)
    mode, forced = _mode(op)
    if forced:
        impl = impls.get(mode)
        if impl is None:
            raise KernelError(
                f"TORCHPORT_KERNELS asks for {mode!r} for {op!r}, which has no such implementation; "
                f"it has: {_describe(impls.values())}"
            )
        if not impl.serves(device.type):
            raise KernelError(
                f"TORCHPORT_KERNELS asks for {mode!r} for {op!r}, which does not run on {device.type} tensors; "
                f"implementations: {_describe(impls.values())}"
            )
        reason = _available(impl, device)
        if reason is not None:
            raise KernelError(f"{op}: the forced implementation {mode!r} cannot run on {device.type}: {reason}")
        return impl
    for impl in sorted(impls.values(), key=lambda i: -i.priority):
        if not impl.serves(device.type):
            continue
        reason = _available(impl, device)
        if reason is None:
            return impl
        if not quiet:
            _warn_once(op, impl.name, device.type, reason)
    return impls["reference"]


def _describe(impls: Iterable[Implementation]) -> str:
    return ", ".join(
        f"{impl.name} ({'every device' if impl.devices is None else ', '.join(sorted(impl.devices))})" for impl in impls
    )


def _warn_once(op: str, name: str, device_type: str, reason: str, stacklevel: int = 4) -> None:
    key = (op, name, reason)
    if key in _warned:
        return
    _warned.add(key)
    message = f"torchport.kernels.{op}: {name} cannot run on {device_type} ({reason}); using the reference instead"
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _is_load_failure(exc: BaseException) -> bool:
    """Errors that will repeat on every call: a missing module or a kernel that does not compile."""
    if isinstance(exc, ImportError):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"CompilationError", "CompileTimeAssertionFailure", "OutOfResources"})


# Exceptions that carry control flow through a kernel call and must reach their catcher unchanged: non-reentrant
# activation checkpointing stops a recomputation early by raising from inside whatever op is running then.
_CONTROL_FLOW = tuple(cls for cls in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if cls)
#: What an implementation may raise that reaches the caller unchanged, never a reason to fall back: out of memory
#: (the reference needs more), an invalid setting, the caller's bad data (:class:`InputError`), control flow.
PASS_THROUGH = (torch.OutOfMemoryError, _settings.SettingError, InputError, *_CONTROL_FLOW)


def call(op: str, device: torch.device, *args: Any) -> Any:
    """Run ``op`` with the implementation chosen for ``device``; in auto mode, fall back to the reference.

    Arguments must already be validated by the op's public function: an implementation's failure is then the
    implementation's, never the caller's, except :class:`InputError`, bad data that only the device could check.
    Out-of-memory errors are raised, not retried with the reference (which needs more memory), and so are an
    invalid setting that an implementation reads (:class:`torchport._settings.SettingError`) and an
    :class:`InputError`.
    """
    impl = select(op, device)
    if impl.name == "reference":
        return impl.fn(*args)
    try:
        return impl.fn(*args)
    except PASS_THROUGH:
        raise
    except Exception as exc:
        _failed(op, impl, device, exc, "")
        return _ops[op]["reference"].fn(*args)


def _failed(op: str, impl: Implementation, device: torch.device, exc: Exception, part: str) -> None:
    """What a failure of ``impl``'s ``part`` ("" for the forward, "backward" for its own backward) leads to: a
    :class:`KernelError` when the user forced it; otherwise a warning (once), and, unless the implementation only
    declined these arguments (:class:`Unsupported`), the implementation marked broken on this device type."""
    reason = f"{type(exc).__name__}: {exc}".strip()
    what = f"the {part} of the forced implementation" if part else "the forced implementation"
    if _mode(op)[1]:
        raise KernelError(f"{op}: {what} {impl.name!r} failed on {device}: {reason}") from exc
    if not isinstance(exc, Unsupported):
        if not _is_load_failure(exc):
            # A kernel that loaded but raised is a bug in it: say so loudly, keep the answer right.
            logger.error("torchport.kernels.%s: %s%s raised %s", op, impl.name, f"'s {part}" if part else "", reason,
                         exc_info=exc)
        with _lock:
            _forget_choices()
            _broken[(op, impl.name, device.type)] = reason
    _warn_once(op, impl.name, device.type, reason, stacklevel=5)  # one frame deeper than the other callers


def call_backward(op: str, device: torch.device, grads: Sequence[Any], needs: Sequence[bool],
                  *args: Any) -> Sequence[Any] | None:
    """The gradients of ``op``'s custom op from the chosen implementation's own backward
    (:attr:`Implementation.backward`), or None when it has none or cannot take these arguments: the caller then
    differentiates the forward run again, which falls back as :func:`call` does. Failures are handled as
    :func:`call` handles them (forced mode raises :class:`KernelError`; in auto mode a broken implementation is
    logged and left for the reference)."""
    impl = select(op, device)
    if impl.backward is None:
        return None
    try:
        return impl.backward(grads, needs, *args)
    except PASS_THROUGH:
        raise
    except Unsupported:
        return None
    except Exception as exc:
        _failed(op, impl, device, exc, "backward")
        return None


#: The most elements of an input whose call :func:`host_bound` counts as host-bound (16 rows of 8192).
HOST_BOUND_ELEMENTS = 2**17


def host_bound(op: str, x: torch.Tensor) -> bool:
    """Whether ``op`` on ``x`` is a call whose pace the host sets, not the device: at most ``HOST_BOUND_ELEMENTS``
    elements on an accelerator (decode-sized rows: 16 x 8192), in auto mode (a forced implementation runs as
    forced), outside autocast, and not while the device's stream captures a graph (a replay costs the host nothing
    per kernel, so there only device time counts). An implementation with a cheaper launch for such calls takes it
    there: the Triton norms hand them to torch's fused operator, the gated activations to torch's two operators and
    the checked eager cross-entropy to ``F.cross_entropy``, whose C++ autograd nodes cost the host a fraction of
    the Triton path's Python forward and backward,
    for a few microseconds of device time either way (``benchmarks/RESULTS.md``, issue 23 item 2).

    Example:
        >>> host_bound("rms_norm", torch.empty(1, 4096, device="cuda"))   # True in auto mode
    """
    return x.numel() <= HOST_BOUND_ELEMENTS and x.device.type != "cpu" and not forced(op) \
        and not _autocasting(x.device.type) and not capturing(x.device)


def _autocasting(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``: PyTorch's operators then follow its casting policy (CUDA runs
    LayerNorm in float32), which a Triton kernel does not, so a call's output dtype would depend on its size."""
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, ValueError, TypeError):  # a device type autocast does not know (meta, a plugin's)
        return False


def forced(op: str) -> bool:
    """Whether the user forced ``op``'s implementation (read in the forward: the autograd engine runs backwards on
    its own threads, which do not see a ``settings.override`` block)."""
    key = (op, _settings.source("kernels"))
    answer = _forced.get(key)
    if answer is None:
        answer = _forced[key] = _mode(op)[1]
    return answer


def custom_op(op: str) -> Callable[..., Any]:
    """``torch.ops.torchport.<op>``, the custom op that a compiled graph calls for ``op`` (its fake implementation
    gives the tracer shapes, its real one calls the kernel chosen per device at run time). The public functions
    call it under ``torch.compile`` instead of :func:`call`, so a compiled model keeps torchport's kernels with no
    graph break; registering the custom ops on first use costs about 25 ms once.

    Example:
        >>> torch.compile(lambda x, w: custom_op("rms_norm")(x, w, 1e-6, 0.0), fullgraph=True)(x, w)
    """
    from . import library  # noqa: F401  (registers torch.ops.torchport.*)

    return getattr(torch.ops.torchport, op)


def backward_fallback(
    op: str, name: str, exc: Exception, was_forced: bool, reference: Callable[..., Any], inputs: Sequence[Any],
    grads: Sequence[Any],
) -> tuple[Any, ...]:
    """Gradients of ``reference(*inputs)`` for a fast backward that failed (auto mode); forced mode re-raises.

    Used by the autograd Functions of fast implementations: their forward ran, so the fallback recomputes the
    reference forward from the saved inputs and differentiates it. Returns one gradient per input (None where the
    input is not a floating tensor that needs one).
    """
    if was_forced or isinstance(exc, torch.OutOfMemoryError):
        raise exc
    _warn_once(op, name, "backward", f"{type(exc).__name__}: {exc}")
    tensors = [t.detach().requires_grad_(needs) if isinstance(t, torch.Tensor) else t
               for t, needs in zip(inputs, _needs_grad(inputs))]
    with torch.enable_grad():
        outputs = reference(*tensors)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        wanted = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    result = iter(found)
    return tuple(next(result) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in tensors)


def _needs_grad(inputs: Sequence[Any]) -> list[bool]:
    return [isinstance(t, torch.Tensor) and t.is_floating_point() for t in inputs]
