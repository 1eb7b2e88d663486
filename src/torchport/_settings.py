"""Every ``TORCHPORT_*`` environment variable, parsed and validated in one place.

Settings are read from the environment on each access (cheap: a few dict look-ups), so a variable set by a
launcher or a test is seen at once. Code overrides them for a block with :func:`override`::

    with torchport.settings.override(device="cpu"):
        ...

Each setting is one :class:`Row` of :data:`ROWS`: its variable, its field name, its default, its parser, what it
does and which values it takes. The :class:`Settings` dataclass, parsing, validation, this list and the table of
docs/settings.md (:func:`markdown_table`, written there by ``.venv/bin/python scripts/settings_table.py --write``)
come from there.

Variables:

"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import re
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["LOG_TOPICS", "MODES", "ROWS", "Row", "SettingError", "Settings", "VARIABLES", "cache_dir", "environment",
           "get", "kernel_modes", "logging_enabled", "markdown_table", "override", "parse_device_spec", "source",
           "value"]

class SettingError(ValueError):
    """An invalid value of a ``TORCHPORT_*`` variable (or of its :func:`override`): the message names the variable
    and the values it takes. Read inside a kernel, it is the caller's error, never a kernel failing (the kernel
    registry raises it instead of falling back)."""


_DEVICE_SPEC = re.compile(r"^(?P<type>[a-z][a-z0-9_]*)(?::(?P<index>\d+))?$")
_SIMULATABLE = ("npu",)
_BOOLEAN = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
LOG_TOPICS = ("compile", "kernels", "fallback")
#: The modes of :func:`torchport.enable`.
MODES = ("speed", "balanced", "memory")
_OP_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def kernel_modes() -> tuple[str, ...]:
    """The kernel modes ``TORCHPORT_KERNELS`` accepts: ``auto`` and every implementation the kernel registry has.
    The one place its row asks; it imports the kernels, so it is called only for a mode other than ``auto``.

    Example:
        >>> kernel_modes()[0]
        'auto'
    """
    from .kernels.registry import kernel_modes as registered

    return registered()


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


# Parsers: (value, source) -> the validated value; ``source`` (the variable, or the field name for an override)
# starts every error, which then says what the value is not and what is allowed.

def _device(value: Any, source: str) -> str:
    kind, index = parse_device_spec(str(value), source)
    return kind if index is None else f"{kind}:{index}"


def _simulate(value: Any, source: str) -> str:
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


def _device_count(value: Any, source: str) -> int:
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = -1
    if not 1 <= count <= 16:
        raise ValueError(f"{source}={value!r} is not a device count; valid values: integers 1 to 16")
    return count


def _boolean(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in _BOOLEAN:
        raise ValueError(f"{source}={value!r} is not a boolean; valid values: {', '.join(_BOOLEAN)}")
    return _BOOLEAN[text]


def _log(value: Any, source: str) -> frozenset[str]:
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


def _seconds(value: Any, source: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{source}={value!r} is not a timeout; valid values: a positive number of seconds")
    return seconds


def _mebibytes(value: Any, source: str) -> float:
    try:
        mib = float(value)
    except (TypeError, ValueError):
        mib = -1.0
    if not 0 <= mib < float("inf"):
        raise ValueError(f"{source}={value!r} is not a size; valid values: a number of MiB, 0 or more")
    return mib


def _mode(value: Any, source: str) -> str:
    text = str(value).strip().lower()
    if text not in MODES:
        raise ValueError(f"{source}={value!r} is not a mode; valid values: {', '.join(MODES)}")
    return text


def _path(value: Any, source: str) -> str:
    return os.path.abspath(os.path.expanduser(str(value)))


def _kernels(value: Any, source: str) -> dict[str, str]:
    if isinstance(value, str):
        return dict(_parse_kernels_text(value, source))  # read on every kernel call: parse each text once
    return _parse_kernels(value, source)


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
        if mode != "auto" and mode not in kernel_modes():
            raise ValueError(f"{source}={value!r}: {mode!r} is not a kernel mode; valid modes: "
                             f"{', '.join(kernel_modes())}")
        choice[op] = mode
    return choice


@dataclasses.dataclass(frozen=True)
class Row:
    """One setting: ``variable`` in the environment, ``field`` in :class:`Settings` and :func:`override`, its
    ``default`` (used when the variable is unset or empty), ``parse(value, source)`` that validates and normalises a
    value, the field's ``annotation``, ``values`` (which values it takes, for the docs: a text, or a function that
    writes it when the values come from elsewhere) and ``doc`` (what it does); both are Markdown."""

    variable: str
    field: str
    default: Any
    parse: Callable[[Any, str], Any]
    annotation: str
    values: str | Callable[[], str]
    doc: str

    def default_value(self) -> Any:
        return dict(self.default) if isinstance(self.default, Mapping) else self.default

    def allowed(self) -> str:
        """The values this setting takes, as the docs write them."""
        return self.values() if callable(self.values) else self.values


def _kernel_values() -> str:
    *first, last = (f"`{mode}`" for mode in kernel_modes())
    return (f"{', '.join(first)} or {last}, and/or per-op `op=mode` pairs (`rms_norm=reference,rope=triton`; a bare "
            "mode among them sets the default for the other ops)")


#: Every setting, in the order of the docs. A new setting is one row here.
ROWS: tuple[Row, ...] = (
    Row("TORCHPORT_DEVICE", "device", None, _device, "str | None",
        "a device type or `type:index` (`npu`, `cuda:1`, `cpu`)",
        "forces the device torchport picks (an absent one is an error)"),
    Row("TORCHPORT_SIMULATE", "simulate", None, _simulate, "str | None",
        "`npu` (an Ascend910B3), or `npu:<soc>` for another chip as torch_npu names it (`npu:Ascend310P3`, "
        "`npu:Ascend910A`; an unknown one is an error listing the known chips)",
        "activates the simulated Ascend NPU (tests and demos; see [testing.md](testing.md#the-simulated-npu))"),
    Row("TORCHPORT_SIMULATE_DEVICES", "simulate_devices", 1, _device_count, "int",
        "an integer, 1 to 16", "how many simulated NPUs there are (backward runs on `npu:0` only)"),
    Row("TORCHPORT_PROBE", "probe", True, _boolean, "bool",
        "`1` or `0` (also true/false, yes/no, on/off)",
        "`1` probes reduced-precision dtypes by running small kernels; `0` trusts the vendor's claims (faster start)"),
    Row("TORCHPORT_SHIM", "shim", None, _device, "str | None",
        "a device type or `type:index`",
        "the device CUDA calls go to in processes started by `torchport run` (set by it) and for "
        "`import torchport.auto`"),
    Row("TORCHPORT_REPORT", "report", False, _boolean, "bool",
        "`1` or `0`", "`1` prints at exit of `torchport run`, on stderr, what was redirected and what cannot run"),
    Row("TORCHPORT_KERNELS", "kernels", {"*": "auto"}, _kernels, "Mapping[str, str]", _kernel_values,
        "which kernel implementation runs: `auto` picks the best for the tensor's device and falls back to the "
        "reference with a warning; a forced one that cannot run raises"),
    Row("TORCHPORT_LOG", "log", frozenset(), _log, "frozenset[str]",
        "comma-separated topics: `compile`, `kernels`, `fallback`, or `all`",
        "topics logged to stderr at INFO: what each compile pass changed, each kernel choice and autotuning, ops "
        "run on the CPU by `torchport.compat.cpu_fallback`"),
    Row("TORCHPORT_STRICT", "strict", False, _boolean, "bool",
        "`1` or `0`",
        "`1`: recoverable problems raise instead of warning (a compile pass or the device's compiler that fails, "
        "the NPU attention operator that fails)"),
    Row("TORCHPORT_CACHE_DIR", "cache_dir", None, _path, "str | None",
        "a folder (default `$XDG_CACHE_HOME/torchport`, else `~/.cache/torchport`)",
        "where torchport keeps what it measured once and reuses across processes (Triton autotuning results)"),
    Row("TORCHPORT_DIST_TIMEOUT", "dist_timeout", 300.0, _seconds, "float",
        "a positive number of seconds",
        "how long a process-group start (rendezvous) or a collective may wait for the other processes before "
        "failing instead of hanging"),
    Row("TORCHPORT_LOSS_WORKSPACE_MIB", "loss_workspace_mib", None, _mebibytes, "float | None",
        "a number of MiB, 0 or more (unset: 256)",
        "the logits the fused linear cross-entropy may hold at once for its fastest strategy (chunks of whole "
        "rows); a batch that needs more than 8 such chunks, or `0`, takes the two passes, which hold 48 MiB and "
        "are slower (see [kernels.md](kernels.md#the-fused-linear-cross-entropy))"),
    Row("TORCHPORT_MODE", "mode", None, _mode, "str | None",
        "`speed`, `balanced` or `memory`",
        "the mode `torchport run` switches on before the program starts (and `torchport.enable()` without a mode)"),
)

_ROWS: dict[str, Row] = {row.field: row for row in ROWS}
#: field name -> environment variable
VARIABLES: dict[str, str] = {row.field: row.variable for row in ROWS}

Settings = dataclasses.make_dataclass(
    "Settings",
    [(row.field, row.annotation, dataclasses.field(default_factory=row.default_value)
      if isinstance(row.default, Mapping) else dataclasses.field(default=row.default)) for row in ROWS],
    frozen=True,
    namespace={"__doc__": "The validated value of every torchport setting (fields: the rows of ``ROWS``)."},
)
Settings.__module__ = __name__  # repr and pickling name torchport._settings.Settings
_overrides: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("torchport_overrides", default={})


def _validate(name: str, value: Any, source: str) -> Any:
    row = _ROWS[name]
    if value is None or value == "":
        return row.default_value()
    try:
        return row.parse(value, source)
    except ValueError as exc:  # the parsers' errors, which name the variable and its values
        raise SettingError(*exc.args) from None


def value(name: str) -> Any:
    """The current value of one setting, validating only that one.

    Example:
        >>> torchport.settings.value("simulate")   # None unless TORCHPORT_SIMULATE is set
    """
    if name not in _ROWS:
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
    for name, given in values.items():
        _validate(name, given, name)
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
    """The directory for torchport's persistent caches: ``TORCHPORT_CACHE_DIR`` or the user's cache directory
    (``$XDG_CACHE_HOME/torchport``, else ``~/.cache/torchport``).

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


def _shown_default(row: Row) -> str:
    default = row.default
    if isinstance(default, Mapping):  # {"*": mode, op: mode}: written as TORCHPORT_KERNELS takes it
        return "`" + ",".join(mode if op == "*" else f"{op}={mode}" for op, mode in default.items()) + "`"
    if default is None or default == frozenset():
        return "unset"
    if isinstance(default, bool):
        return f"`{int(default)}`"
    return f"`{default:g}`" if isinstance(default, float) else f"`{default}`"


def markdown_table(rows: Sequence[Row] = ROWS) -> str:
    """The settings as the Markdown table of docs/settings.md (one line per row, no trailing newline).

    Example:
        >>> print(markdown_table().splitlines()[0])
        | variable | values | default | what it does |
    """
    lines = ["| variable | values | default | what it does |", "|---|---|---|---|"]
    lines += [f"| `{row.variable}` | {row.allowed()} | {_shown_default(row)} | {row.doc} |" for row in rows]
    return "\n".join(lines)


if __doc__:  # None under python -OO
    __doc__ += "\n".join(
        f"``{row.variable}`` (``{row.field}``)\n    {row.doc}." for row in ROWS) + "\n"
