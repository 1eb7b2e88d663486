"""Every ``TORCHPORT_*`` environment variable, parsed and validated in one place.

Settings are read from the environment on each access (cheap: a few dict look-ups), so a variable set by a
launcher or a test is seen at once. Code overrides them for a block with :func:`override`::

    with torchport.settings.override(device="cpu"):
        ...

Variables:

``TORCHPORT_DEVICE``
    Force the device torchport picks: a device type (``npu``, ``cuda``, ``cpu``...) or ``type:index``.
``TORCHPORT_SIMULATE``
    ``npu`` activates the simulated Ascend NPU of :mod:`torchport.testing` (tests and demos only), an Ascend910B3;
    ``npu:<soc>`` simulates another chip, named as torch_npu names it (``npu:Ascend310P3``, ``npu:Ascend910A``; the
    list is :func:`torchport.backends.npu.npu_chip_profiles`).
``TORCHPORT_SIMULATE_DEVICES``
    Number of simulated devices (1 to 16, default 1).
``TORCHPORT_SHIM``
    The device that CUDA calls are redirected to, set by ``torchport run`` for its child processes (and read by
    ``import torchport.auto``): a device type or ``type:index``.
``TORCHPORT_REPORT``
    ``1`` prints, at exit of a program run with the shim, what was redirected and what cannot run on the device.
``TORCHPORT_PROBE``
    ``1`` (default) lets torchport probe reduced-precision dtypes by running small kernels; ``0`` trusts the
    vendor's claims instead (faster start, no kernel launched).
``TORCHPORT_KERNELS``
    Which implementation the kernels of :mod:`torchport.kernels` use: ``auto`` (default: the best one for the
    tensor's device, falling back to the reference with a warning when it fails), or a forced one, ``reference``,
    ``triton``, ``npu`` or another registered implementation such as ``chunked`` (a forced implementation that
    cannot run raises). Per-op choices follow, comma-separated:
    ``rms_norm=reference,rope=triton``; a bare mode among them sets the default for the other ops
    (``triton,rope=reference``).
``TORCHPORT_LOG``
    Comma-separated topics to log at INFO level through the ``torchport`` logger: ``compile`` (what each pass of
    the torchport compile backend changed), ``kernels`` (which implementation each op picked, and autotuning),
    ``fallback`` (ops run on the CPU by :func:`torchport.compat.cpu_fallback`), or ``all``.
``TORCHPORT_STRICT``
    ``1`` turns recoverable problems into errors: a compile pass that fails on an unexpected graph raises instead
    of being skipped with a warning.
``TORCHPORT_DIST_TIMEOUT``
    Seconds a process-group start (rendezvous) or a collective may wait for the other processes before failing
    with an error instead of hanging (default 300).
``TORCHPORT_MODE``
    A mode that ``torchport run`` enables before the program starts (and ``torchport.enable()`` enables when
    called without one): ``speed``, ``balanced`` or ``memory`` (see :mod:`torchport.modes`).
``TORCHPORT_CACHE_DIR``
    Where torchport keeps what it measured once and reuses across processes (Triton autotuning results).
    Default: ``$XDG_CACHE_HOME/torchport``, else ``~/.cache/torchport``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import re
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

__all__ = ["LOG_TOPICS", "MODES", "Settings", "cache_dir", "logging_enabled", "VARIABLES", "environment", "get", "override", "parse_device_spec", "source", "value"]

_DEVICE_SPEC = re.compile(r"^(?P<type>[a-z][a-z0-9_]*)(?::(?P<index>\d+))?$")
_SIMULATABLE = ("npu",)
_BOOLEAN = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The validated value of every torchport setting."""

    device: str | None = None
    simulate: str | None = None
    simulate_devices: int = 1
    probe: bool = True
    shim: str | None = None
    report: bool = False
    kernels: Mapping[str, str] = dataclasses.field(default_factory=lambda: {"*": "auto"})
    log: frozenset[str] = frozenset()
    strict: bool = False
    cache_dir: str | None = None
    dist_timeout: float = 300.0
    mode: str | None = None


# field name -> environment variable
VARIABLES: dict[str, str] = {
    "device": "TORCHPORT_DEVICE",
    "simulate": "TORCHPORT_SIMULATE",
    "simulate_devices": "TORCHPORT_SIMULATE_DEVICES",
    "probe": "TORCHPORT_PROBE",
    "shim": "TORCHPORT_SHIM",
    "report": "TORCHPORT_REPORT",
    "kernels": "TORCHPORT_KERNELS",
    "log": "TORCHPORT_LOG",
    "strict": "TORCHPORT_STRICT",
    "cache_dir": "TORCHPORT_CACHE_DIR",
    "dist_timeout": "TORCHPORT_DIST_TIMEOUT",
    "mode": "TORCHPORT_MODE",
}

LOG_TOPICS = ("compile", "kernels", "fallback")
#: The modes of :func:`torchport.enable`.
MODES = ("speed", "balanced", "memory")
_OP_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")

_DEFAULTS = {field.name: field.default for field in dataclasses.fields(Settings) if field.name != "kernels"}
_DEFAULTS["kernels"] = {"*": "auto"}
_overrides: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("torchport_overrides", default={})


def parse_device_spec(spec: str, source: str = "device") -> tuple[str, int | None]:
    """Split ``"npu:1"`` into ``("npu", 1)``; ``"cuda"`` gives ``("cuda", None)``.

    Only the syntax is checked here; whether the type has a backend is the registry's question.

    Example:
        >>> parse_device_spec("npu:1")
        ('npu', 1)
    """
    match = _DEVICE_SPEC.match(spec.strip().lower()) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(
            f"{source}={spec!r} is not a device; write a device type or type:index, "
            "for example 'npu', 'cuda:1' or 'cpu'"
        )
    index = match.group("index")
    return match.group("type"), None if index is None else int(index)


def _validate(name: str, value: Any, source: str) -> Any:
    if value is None or value == "":
        return dict(_DEFAULTS[name]) if name == "kernels" else _DEFAULTS[name]
    if name in ("device", "shim"):
        kind, index = parse_device_spec(str(value), source)
        return kind if index is None else f"{kind}:{index}"
    if name == "simulate":
        kind, _, soc = str(value).strip().partition(":")
        if kind.strip().lower() not in _SIMULATABLE:
            raise ValueError(f"{source}={value!r} cannot be simulated; valid values: {', '.join(_SIMULATABLE)}, "
                             "or npu:<soc> for a chip (npu:Ascend310P3)")
        if not soc.strip():
            return kind.strip().lower()
        from .backends.npu import chip_profile  # the chips torchport knows (reading them imports torch, not torch_npu)

        try:
            return f"npu:{chip_profile(soc).soc_version}"
        except ValueError as exc:
            raise ValueError(f"{source}={value!r}: {exc}") from None
    if name == "simulate_devices":
        try:
            count = int(value)
        except (TypeError, ValueError):
            count = -1
        if not 1 <= count <= 16:
            raise ValueError(f"{source}={value!r} is not a device count; valid values: integers 1 to 16")
        return count
    if name == "log":
        topics = value if isinstance(value, (set, frozenset, list, tuple)) else str(value).split(",")
        chosen = {str(topic).strip().lower() for topic in topics} - {""}
        if "all" in chosen:
            return frozenset(LOG_TOPICS)
        unknown = sorted(chosen - set(LOG_TOPICS))
        if unknown:
            raise ValueError(
                f"{source}={value!r}: unknown log topic(s) {', '.join(unknown)}; valid: {', '.join(LOG_TOPICS)}, all"
            )
        return frozenset(chosen)
    if name == "dist_timeout":
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = -1.0
        if not 0 < seconds < float("inf"):
            raise ValueError(f"{source}={value!r} is not a timeout; valid values: a positive number of seconds")
        return seconds
    if name == "mode":
        text = str(value).strip().lower()
        if text not in MODES:
            raise ValueError(f"{source}={value!r} is not a mode; valid values: {', '.join(MODES)}")
        return text
    if name == "cache_dir":
        return os.path.abspath(os.path.expanduser(str(value)))
    if name in ("probe", "report", "strict"):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text not in _BOOLEAN:
            raise ValueError(f"{source}={value!r} is not a boolean; valid values: {', '.join(_BOOLEAN)}")
        return _BOOLEAN[text]
    if name == "kernels":
        if isinstance(value, str):
            return dict(_parse_kernels_text(value, source))  # read on every kernel call: parse each text once
        return _parse_kernels(value, source)
    raise AssertionError(name)


@functools.lru_cache(maxsize=64)
def _parse_kernels_text(value: str, source: str) -> tuple[tuple[str, str], ...]:
    return tuple(_parse_kernels(value, source).items())


def _parse_kernels(value: Any, source: str) -> dict[str, str]:
    """``"triton,rope=reference"`` -> ``{"*": "triton", "rope": "reference"}`` (``"*"``: every other op)."""
    if isinstance(value, Mapping):
        items = [f"{op}={mode}" if op != "*" else str(mode) for op, mode in value.items()]
    else:
        items = [item.strip() for item in str(value).split(",")]
    choice = {"*": "auto"}
    default_seen = False
    for item in items:
        if not item:
            continue
        op, sep, mode = (part.strip().lower() for part in item.partition("="))
        if not sep:
            op, mode = "*", op
            if default_seen:
                raise ValueError(f"{source}={value!r} names more than one default mode; write one, then op=mode pairs")
            default_seen = True
        elif not _OP_NAME.match(op):
            raise ValueError(f"{source}={value!r}: {op!r} is not an op name; write op=mode, e.g. rms_norm=reference")
        elif op in choice:
            raise ValueError(f"{source}={value!r} sets {op!r} twice")
        if mode != "auto" and mode not in _kernel_modes():
            raise ValueError(f"{source}={value!r}: {mode!r} is not a kernel mode; valid modes: "
                             f"{', '.join(_kernel_modes())}")
        choice[op] = mode
    return choice


def _kernel_modes() -> tuple[str, ...]:
    # "auto" and every registered implementation's name; asked only for a forced mode, so that importing torchport
    # does not import the kernels
    from .kernels.registry import kernel_modes

    return kernel_modes()


def value(name: str) -> Any:
    """The current value of one setting, validating only that one.

    Example:
        >>> torchport.settings.value("simulate")   # None unless TORCHPORT_SIMULATE is set
    """
    if name not in VARIABLES:
        raise ValueError(f"unknown torchport setting {name!r}; valid: {', '.join(VARIABLES)}")
    forced = _overrides.get()
    if name in forced:
        return _validate(name, forced[name], name)
    return _validate(name, os.environ.get(VARIABLES[name]), VARIABLES[name])


def source(name: str) -> Hashable:
    """What the value of setting ``name`` comes from now, unvalidated and hashable: its environment variable's text
    (None when unset), or ``("override", value)`` inside :func:`override`. Equal sources give equal values, so
    callers key caches of decisions on it (a kernel call looks its implementation up by it instead of parsing and
    validating ``TORCHPORT_KERNELS``).

    Example:
        >>> torchport.settings.source("kernels")   # None unless TORCHPORT_KERNELS is set
    """
    forced = _overrides.get()
    if not forced or name not in forced:  # the common case first: read on every kernel call
        return os.environ.get(VARIABLES[name])
    raw = forced[name]
    if isinstance(raw, Mapping):
        raw = tuple(sorted((str(k), repr(v)) for k, v in raw.items()))
    try:
        hash(raw)
    except TypeError:
        raw = repr(raw)
    return ("override", raw)


def get() -> Settings:
    """Return the current settings: code overrides first, then the environment, then defaults.

    Example:
        >>> torchport.settings.get().device   # None unless TORCHPORT_DEVICE is set
    """
    return Settings(**{name: value(name) for name in VARIABLES})


@contextlib.contextmanager
def override(**values: Any) -> Iterator[Settings]:
    """Override settings for the duration of a ``with`` block (thread- and task-local).

    Example:
        >>> with torchport.settings.override(device="cpu"):
        ...     torchport.device()
        device(type='cpu')
    """
    unknown = sorted(set(values) - set(VARIABLES))
    if unknown:
        raise ValueError(f"unknown torchport setting(s) {', '.join(unknown)}; valid: {', '.join(VARIABLES)}")
    for name, value in values.items():
        _validate(name, value, name)
    token = _overrides.set({**_overrides.get(), **values})
    try:
        yield get()
    finally:
        _overrides.reset(token)


def logging_enabled(topic: str) -> bool:
    """Whether ``TORCHPORT_LOG`` asks for this topic (one of :data:`LOG_TOPICS`)."""
    if topic not in LOG_TOPICS:
        raise ValueError(f"unknown log topic {topic!r}; valid: {', '.join(LOG_TOPICS)}")
    return topic in value("log")


def cache_dir() -> str:
    """The directory for torchport's persistent caches: ``TORCHPORT_DIST_TIMEOUT``
    Seconds a process-group start (rendezvous) or a collective may wait for the other processes before failing
    with an error instead of hanging (default 300).
``TORCHPORT_CACHE_DIR`` or the user's cache directory.

    Example:
        >>> torchport.settings.cache_dir()   # doctest: +SKIP
        '/home/me/.cache/torchport'
    """
    chosen = value("cache_dir")
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchport")


def environment() -> dict[str, str]:
    """The environment variables that matter to torchport and the devices it drives, as set now."""
    wanted = re.compile(r"^(TORCHPORT_.*|.*_VISIBLE_DEVICES|TORCH_DEVICE_BACKEND_AUTOLOAD|PYTORCH_.*ALLOC_CONF|ASCEND_.*)$")
    return {key: value for key, value in sorted(os.environ.items()) if wanted.match(key)}
