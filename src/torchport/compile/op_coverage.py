"""Which operators a model runs, forward and backward, and how a target device runs each: :func:`coverage`.

The model runs once, forward then backward (the loss is the sum of its floating-point outputs), where it is: on the
CPU, or on the target device itself when it is there. A ``TorchDispatchMode`` records each operator overload that
reaches the dispatcher's backends, with its calls and phase. Each is then marked for the target device:

* **torchport kernel**: an operator of the ``torchport`` namespace (``torch.ops.torchport.rms_norm``...). What runs
  inside it (the vendor's fused operator on Ascend, Triton on a GPU, the reference elsewhere) is the kernel's own
  per-device choice, vouched for by the kernel registry, and is not listed.
* **cpu fallback**: :func:`torchport.compat.cpu_fallback` runs it on the CPU, or the device's library does so by
  itself (torch_npu runs every operator it has no kernel for on the CPU, warning once).
* **native**: the device has a kernel of its own, or PyTorch's composite kernel serves it (its parts are recorded
  and marked one by one), or it is a structured operator's functional or in-place variant whose out= variant the
  device has.
* **missing**: none of these; running it there fails.

Where the device's library is loaded, the dispatcher answers (:func:`torchport.compile.op_support.device_op_support`).
Where it is not, the backend's shipped operator list does (for Ascend: ``data/torch_npu_ops-<release>.txt``, torch_npu's
operator registration list of a named release; its header says what it covers and what not).

On an Ascend NPU the chip matters too (``soc=``, or the chip of the NPU present): the report then carries
:func:`torchport.compile.chip_coverage.chip_coverage`'s answer (each torchport kernel's torch_npu operator on that
chip, its dtypes and limits), each ``torchport::`` row says what runs for it there, and an operator that computes in a
dtype the chip lacks (bfloat16 on the 910A and 310P) is **missing**: it fails there.

Recording on another device than the target: where PyTorch builds an operator from others, the recording device's
choice is what gets recorded. Two cases are corrected, since they are where devices differ: an operator the target
registers itself (torch_npu has ``scaled_dot_product_attention``) is recorded whole, in place of its parts and their
backward; and a part PyTorch picks only for the CPU (``_scaled_dot_product_flash_attention_for_cpu``) is recorded
as the operator that picked it, which the target decomposes with its own choice. Other data-dependent choices of the
model (which branch its Python takes on the CPU) are recorded as the CPU takes them.

Example:
    >>> report = torchport.compile.coverage(model, inputs, "npu", soc="Ascend310P3")
    >>> report.missing                # operators the NPU cannot run
    >>> report.print()                # a table; report.to_json() for machines
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.resources
import json
import re
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..backends import Backend, get_backend
from ..compat.cpu_fallback import call_on_cpu, explain_missing_op, numbers_as_tensors, registered
from .op_support import op_support
from ..verify.structure import call_model, leaves

__all__ = ["Coverage", "OpRow", "STATUSES", "coverage"]

#: Every status, the most urgent first (the table's order).
STATUSES = ("missing", "cpu fallback", "torchport kernel", "native")
_NOT_IMPLEMENTED = re.compile(r"Could not run '(?P<op>[^']+)' with arguments from the '(?P<key>[^']+)' backend")
_ALLOCATOR_OP = "aten::empty.memory_format"
# Questions about a tensor's metadata (sizes, strides), answered from the tensor itself on every device.
_METADATA = frozenset({
    "aten::dim", "aten::size", "aten::stride", "aten::numel", "aten::storage_offset", "aten::sym_size",
    "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset", "aten::is_contiguous",
    "aten::is_strides_like_format", "aten::is_non_overlapping_and_dense", "prim::device", "prim::layout",
})
# Operators that move or reinterpret data without computing in its dtype: a chip without bfloat16 kernels still
# allocates, fills, copies and converts bfloat16 tensors (views never reach a kernel)
_MOVES = frozenset({
    "aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::clone", "aten::fill_",
    "aten::zero_", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
    "aten::new_empty_strided", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::set_", "aten::resize_",
    "aten::detach", "aten::_local_scalar_dense", "aten::new_zeros", "aten::zeros_like", "aten::ones_like",
    "aten::full_like", "aten::new_ones", "aten::new_full",
})
_HOST_VARIANT = "_for_cpu"  # PyTorch's naming of the parts it picks for the CPU inside a composite operator
_PARTS = "PyTorch's composite kernel: its parts are listed too"


@functools.lru_cache(maxsize=None)
def _returns_view(func: Any) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _dispatcher_has(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except RuntimeError:  # an operator the dispatcher knows by another name
        return False


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One operator overload in one phase: how often the model ran it and how the target device runs it."""

    op: str  # "aten::add.Tensor"; the default overload has no suffix
    phase: str  # "forward" or "backward"
    calls: int
    status: str  # one of STATUSES
    note: str = ""


@dataclasses.dataclass
class Coverage:
    """The operators a model ran and how ``device`` runs each; see :func:`coverage`."""

    device: str
    source: str  # what answered: "dispatcher (...)" or "snapshot <file> (<version>)"
    recorded_on: str
    backward: bool
    rows: list[OpRow]
    dtypes: list[str] = dataclasses.field(default_factory=list)  # the floating dtypes operators computed in
    chip: Any = None  # the chip_coverage.ChipCoverage of the target's chip, or None

    def ops(self, status: str) -> list[str]:
        """The operators (any phase) with ``status``, sorted.

        Example:
            >>> report.ops("cpu fallback")
            ['aten::erfinv']
        """
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {', '.join(STATUSES)}")
        return sorted({row.op for row in self.rows if row.status == status})

    @property
    def missing(self) -> list[str]:
        """The operators the device cannot run, sorted."""
        return self.ops("missing")

    def summary(self) -> dict[str, int]:
        """Distinct operators per status."""
        return {status: len(self.ops(status)) for status in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "source": self.source, "recorded_on": self.recorded_on,
                "backward": self.backward, "summary": self.summary(), "dtypes": list(self.dtypes),
                "chip": None if self.chip is None else self.chip.to_dict(),
                "rows": [dataclasses.asdict(row) for row in self.rows]}

    def to_json(self) -> str:
        """The report as JSON: device, source, recorded_on, backward, summary, dtypes, chip (None unless the target
        is a known Ascend chip) and one object per row."""
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> Any:
        """The rows as a ``rich`` table."""
        from rich.table import Table

        colours = {"missing": "red", "cpu fallback": "yellow", "torchport kernel": "cyan", "native": "green"}
        summary = ", ".join(f"{n} {status}" for status, n in self.summary().items())
        table = Table(title=f"operators on {self.device} ({self.source}; recorded on {self.recorded_on})",
                      caption=f"{len({row.op for row in self.rows})} operators: {summary}")
        for column in ("operator", "phase", "calls", "status", "note"):
            table.add_column(column, overflow="fold")
        for row in self.rows:
            table.add_row(row.op, row.phase, str(row.calls), f"[{colours[row.status]}]{row.status}[/]", row.note)
        return table

    def print(self, file: Any = None) -> None:
        """Print :meth:`table`, then the chip's tables where there is a chip (stdout by default)."""
        from rich.console import Console

        console = Console(file=file or sys.stdout, width=140)
        console.print(self.table())
        for table in self.chip.tables() if self.chip is not None else ():
            console.print(table)


def coverage(model: torch.nn.Module, inputs: Any, device: str | torch.device, *, backward: bool = True,
             soc: str | None = None) -> Coverage:
    """Run ``model`` on ``inputs`` forward and backward, record the operators it runs, and mark each for ``device``.

    Args:
        model: the model, wherever it is (the CPU, or ``device`` itself when that is present); it is not moved.
        inputs: a tensor (the one argument), a tuple or list (positional arguments) or a dict (keyword arguments).
        device: the target device type (``"npu"``, ``"cuda:1"``...); it need not be present.
        backward: also run the backward of the sum of the floating-point outputs (their gradients are discarded:
            the parameters' ``.grad`` are restored afterwards).
        soc: for ``"npu"``, the Ascend chip to report on (``"Ascend310P3"``; any known chip, on any machine); None:
            the chip of the NPU present (real or simulated), else no chip.

    Returns:
        A :class:`Coverage`: ``rows`` ordered missing first, ``missing``, ``to_json()``, ``print()``.

    Raises:
        ValueError: ``device`` is not a device type, or neither its library nor a shipped list can say which
            operators it has; ``soc`` is not a known chip, or is given for a device type other than ``"npu"``.
        NotImplementedError: running on the device, an operator that neither the device nor the CPU has; the
            message says which and what to do.

    Example:
        >>> report = coverage(model, torch.randint(0, 96, (2, 12)), "npu")
        >>> report.missing
        []
    """
    if isinstance(device, torch.device):
        kind = device.type
    else:
        from .._settings import parse_device_spec

        kind = parse_device_spec(device, "device")[0]
    from .chip_coverage import chip_coverage, resolve_chip

    target = _Target(get_backend(kind, source="device"))
    chip = resolve_chip(kind, soc)
    if chip is not None:
        target.chip = chip_coverage(chip)
    recorded_on = _where(model, inputs)
    recorder = _Recorder(target, recorded_on)
    saved = {p: p.grad for p in model.parameters()}
    saved.update({t: t.grad for _, t in leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad})
    try:
        with torch.enable_grad() if backward else torch.no_grad():
            with _Composites(recorder) if recorded_on != kind else contextlib.nullcontext(), recorder:
                out = call_model(model, inputs)
            floating = [t for _, t in leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
                        and t.requires_grad]
            ran_backward = backward and bool(floating)
            if ran_backward:
                loss = sum(t.float().sum() for t in floating)
                recorder.phase = "backward"
                with recorder:
                    loss.backward()
    finally:
        for tensor, grad in saved.items():
            tensor.grad = grad
    dtypes = sorted({str(d).removeprefix("torch.") for found in recorder.dtypes.values() for d in found})
    return Coverage(kind, target.source, recorded_on, ran_backward, recorder.rows(), dtypes, target.chip)


def _where(model: torch.nn.Module, inputs: Any) -> str:
    for tensor in [*model.parameters(), *model.buffers(), *(t for _, t in leaves(inputs))]:
        if isinstance(tensor, torch.Tensor):
            return tensor.device.type
    return "cpu"


class _Target:
    """How the target device runs an operator: by this process's dispatcher, or by its backend's operator list."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.host_fallback = backend.host_fallback
        self.chip: Any = None  # the chip_coverage.ChipCoverage of the target's chip
        if backend.has_kernel(_ALLOCATOR_OP) is not None:
            self.has_kernel: Callable[[str], bool | None] = backend.has_kernel
            versions = ", ".join(f"{k} {v}" for k, v in backend.versions().items() if v)
            self.source = f"dispatcher{f' ({versions})' if versions else ''}"
        elif backend.op_snapshot is not None:
            ops, version = _snapshot(backend.op_snapshot)
            self.has_kernel = ops.__contains__
            self.source = f"snapshot {backend.op_snapshot} ({version})"
        else:
            raise ValueError(f"cannot tell which operators {backend.name} runs: its library is not loaded in this "
                             f"process ({backend.unavailable_reason()}) and torchport ships no operator list for it; "
                             f"run torchport coverage where {backend.name} is installed")

    def status(self, op: str) -> tuple[str, str]:
        """(status, note) of ``op`` on the target."""
        if op.startswith("torchport::"):
            return "torchport kernel", self._kernel_note(op)
        if op in registered(self.backend.name):
            return "cpu fallback", "torchport.compat.cpu_fallback"
        support = op_support(op, self.has_kernel, self.host_fallback)
        if support == "native":
            return "native", ""
        if support == "host":
            return "cpu fallback", f"{self.backend.name}'s library runs it on the CPU itself"
        return "missing", ""

    def _kernel_note(self, op: str) -> str:
        """What runs for torchport kernel ``op`` on the target's chip ("" without a chip)."""
        if self.chip is None:
            return ""
        name = op.partition("::")[2]
        kernel = name.removesuffix("_backward")
        row = next((row for row in self.chip.kernels if row.kernel == kernel), None)
        if row is None:
            return ""
        chip = self.chip.chip
        if row.fused:
            runs = f"torch_npu.{row.operator}"
        elif row.operator:
            runs = f"{row.implementation} (no {row.operator} on {chip.family})"
        else:
            runs = f"{row.implementation} (PyTorch operators)"
        return f"{'backward through ' if name != kernel else ''}{runs} on {chip.soc_version}"

    def lacks(self, dtypes: set[torch.dtype]) -> list[torch.dtype]:
        """The dtypes of ``dtypes`` the target's chip does not compute in."""
        return [] if self.chip is None else [d for d in self.chip.lacks_dtypes if d in dtypes]


def target_source(backend: Backend) -> tuple[str, int | None]:
    """What says which aten operators ``backend``'s device runs: ``"dispatcher (...)"`` where its library is loaded,
    else ``"snapshot <file> (<version>)"``; with the number of operator overloads the snapshot lists (None for the
    dispatcher).

    Raises:
        ValueError: neither can (the library is not loaded and torchport ships no list for it).
    """
    target = _Target(backend)
    listed = _snapshot(backend.op_snapshot)[0] if target.source.startswith("snapshot") else None
    return target.source, None if listed is None else len(listed)


@functools.lru_cache(maxsize=None)
def _snapshot(name: str) -> tuple[frozenset[str], str]:
    """The operators of a shipped list and its version line."""
    text = importlib.resources.files("torchport.compile").joinpath("data", name).read_text(encoding="utf-8")
    version = next((line.partition(":")[2].strip() for line in text.splitlines() if line.startswith("# version:")),
                   "version unknown")
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")), version


class _Recorder(TorchDispatchMode):
    """Counts operator calls per phase; on the target device itself, runs missing operators on the CPU to go on."""

    def __init__(self, target: _Target, recorded_on: str) -> None:
        super().__init__()
        self.target = target
        self.on_device = recorded_on == target.backend.name
        try:
            key = get_backend(recorded_on).dispatch_key
        except ValueError:  # a model on the meta device: its composite operators are not opened up
            key = None
        self.recording_key = key
        self.keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key)) if key else None
        self.descends: dict[str, bool] = {}
        self.descending: list[str] = []
        self.phase = "forward"
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.notes: dict[tuple[str, str], str] = {}
        self.failed: set[tuple[str, str]] = set()  # found missing by running them
        # the composite operator being run (set by _Composites), whether the target keeps it whole, and whether a
        # part picked for the CPU ran inside it
        self.inside: str | None = None
        self.whole = False
        self.saw_variant = False
        self.nodes: dict[Any, tuple[str, bool]] = {}  # autograd nodes made inside a composite -> (op, whole)
        self.counted: set[Any] = set()
        self.dtypes: dict[tuple[str, str], set[torch.dtype]] = collections.defaultdict(set)  # what each computed in

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = func.name()
        if name in self.descending:  # the composite kernel being run calls its own operator again: run it as it is
            return func(*args, **kwargs)
        if name not in _METADATA:
            self._record(name)
            if name.partition(".")[0] not in _MOVES and not _returns_view(func):
                self.note_dtypes(name, self.phase, (args, kwargs))
        args = numbers_as_tensors(func, args)  # PyTorch hands a mode x * 3 as mul.Tensor(x, 3)
        try:
            if self._descend(func, name):  # run PyTorch's composite kernel with this mode on: its parts get recorded
                self.descending.append(name)
                try:
                    with self:
                        return func.redispatch(self.keyset, *args, **kwargs)
                finally:
                    self.descending.pop()
            return func(*args, **kwargs)
        except NotImplementedError as exc:
            match = _NOT_IMPLEMENTED.search(str(exc))
            if not self.on_device or match is None or match.group("key") == "CPU":
                hint = explain_missing_op(exc)
                if hint is None:
                    raise
                raise NotImplementedError(f"torchport coverage could not run the model: {hint}\n\n{exc}") from exc
            missing = match.group("op")
            self.failed.add((missing, self.phase))
            if missing != name:
                self.counts[(missing, self.phase)] += 1
                self.notes[(missing, self.phase)] = f"inside {name}"
            return call_on_cpu(func, self.target.backend.name, args, kwargs)  # so the run goes on

    def note_dtypes(self, op: str, phase: str, arguments: Any) -> None:
        """Remember the floating dtypes of the tensors ``op`` computes on."""
        found = {x.dtype for x in tree_flatten(arguments)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()}
        if found:
            self.dtypes[(op, phase)] |= found

    def _descend(self, func: Any, name: str) -> bool:
        """Whether ``name`` runs as PyTorch's composite kernel on the recording device, another than the target, and
        the target has no kernel of its own for it either: then its parts are what the target runs. Views are left
        alone (every device has them), and so are torchport's kernels (what they run is their own choice per
        device)."""
        known = self.descends.get(name)
        if known is None:
            known = self.descends[name] = (
                not self.on_device and self.keyset is not None and not name.startswith("torchport::")
                and _dispatcher_has(name, "CompositeExplicitAutograd") and not _dispatcher_has(name, self.recording_key)
                and self.target.has_kernel(name) is False
                and not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns))
            if known:
                self.notes.setdefault((name, "forward"), _PARTS)
                self.notes.setdefault((name, "backward"), _PARTS)
        return known

    def _record(self, name: str) -> None:
        if self.phase == "forward":
            if self.inside is not None and (self.whole or _HOST_VARIANT in name):
                if not self.whole:  # a part picked for the CPU: record the operator that picked it
                    self.saw_variant = True
                    self._attribute(self.inside, name)
                return
            self.counts[(name, "forward")] += 1
            return
        node = torch._C._current_autograd_node()
        owner = self.nodes.get(node) if node is not None else None
        if owner is not None and (owner[1] or _HOST_VARIANT in name):
            if node not in self.counted:
                self.counted.add(node)
                if owner[1]:
                    self.counts[(owner[0], "backward")] += 1
                    self.notes[(owner[0], "backward")] = f"{self.target.backend.name} runs it whole; its parts "\
                                                          "recorded here are left out"
                else:
                    self._attribute(owner[0], name)
            return
        self.counts[(name, "backward")] += 1

    def _attribute(self, composite: str, part: str) -> None:
        self.counts[(composite, self.phase)] += 1
        self.notes[(composite, self.phase)] = (f"PyTorch runs {part} for it on the CPU; on "
                                               f"{self.target.backend.name} it picks its own")

    def tag(self, out: Any, args: Any, op: str, whole: bool) -> None:
        """Remember the autograd nodes the composite operator ``op`` made (from its outputs back to its inputs)."""
        stop = {t.grad_fn for _, t in leaves(args) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        stack = [t.grad_fn for _, t in leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in stop or node in self.nodes or type(node).__name__ == "AccumulateGrad":
                continue
            self.nodes[node] = (op, whole)
            stack.extend(next_node for next_node, _ in node.next_functions)

    def rows(self) -> list[OpRow]:
        order = {status: i for i, status in enumerate(STATUSES)}
        rows = []
        for (op, phase), calls in self.counts.items():
            status, note = self.target.status(op)
            if (op, phase) in self.failed:
                status, note = "missing", "failed when run on the device"
            lacking = self.target.lacks(self.dtypes.get((op, phase), set()))
            if lacking and status != "cpu fallback":
                names = ", ".join(str(d).removeprefix("torch.") for d in lacking)
                status, note = "missing", f"computes in {names}, which {self.target.chip.chip.soc_version} lacks"
            note = "; ".join(filter(None, [self.notes.get((op, phase)), note]))
            rows.append(OpRow(op, phase, calls, status, note))
        return sorted(rows, key=lambda row: (order[row.status], row.phase != "forward", row.op))


class _Composites(TorchFunctionMode):
    """Tells the recorder when the model calls an operator PyTorch builds from others, so that what the target does
    with it (keep it whole, or pick its own parts) is recorded rather than what the recording device does."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.packets: dict[str, list[str]] = collections.defaultdict(list)
        for name in torch._C._dispatch_get_all_op_names():
            if name.startswith("aten::"):
                self.packets[name.partition(".")[0]].append(name)
        self.known: dict[Any, str | None] = {}

    def composite(self, func: Any) -> str | None:
        """The aten operator a torch function stands for when PyTorch composes it from others and it has one
        overload that is not out= (``F.scaled_dot_product_attention``), else None."""
        try:
            return self.known[func]
        except KeyError:
            pass
        except TypeError:  # unhashable: not a function of torch's
            return None
        name = getattr(func, "__name__", "")
        found = None
        if name and not name.startswith("__"):
            candidates = []
            for overload in self.packets.get(f"aten::{name}", ()):
                if not torch._C._dispatch_has_kernel_for_dispatch_key(overload, "CompositeImplicitAutograd"):
                    continue
                base, _, suffix = overload.partition(".")
                schema = getattr(getattr(torch.ops.aten, base[6:]), suffix or "default")._schema
                if not any(a.is_out for a in schema.arguments):
                    candidates.append(overload)
            found = candidates[0] if len(candidates) == 1 else None
        self.known[func] = found
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        rec = self.recorder
        op = self.composite(func) if rec.inside is None and rec.phase == "forward" else None
        if op is None:
            return func(*args, **kwargs)
        whole = rec.target.has_kernel(op) is True  # the target registers it itself: it never decomposes there
        rec.inside, rec.whole, rec.saw_variant = op, whole, False
        if whole:
            rec.counts[(op, "forward")] += 1
            rec.note_dtypes(op, "forward", (args, kwargs))
            rec.notes[(op, "forward")] = f"{rec.target.backend.name} runs it whole; its parts recorded here are left out"
        try:
            out = func(*args, **kwargs)
        finally:
            rec.inside = None
        if whole or rec.saw_variant:
            rec.tag(out, (args, kwargs), op, whole)
        return out
