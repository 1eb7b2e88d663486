"""The modes that record which operators a model runs, for :func:`torchport.compile.coverage`.

:class:`Recorder` (a ``TorchDispatchMode``) counts each operator overload that reaches the dispatcher's backends, per
phase, and the floating dtypes it computes in; :class:`Composites` (a ``TorchFunctionMode``) tells it when the model
calls an operator PyTorch builds from others, so that what the target does with it is recorded rather than what the
recording device does.
"""

from __future__ import annotations

import collections
import functools
import re
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..backends import get_backend
from ..compat.cpu_fallback import call_on_cpu, explain_missing_op, numbers_as_tensors
from ..verify.structure import leaves
from .coverage_report import STATUSES, OpRow
from .coverage_target import Target

__all__ = ["Composites", "Recorder"]

_NOT_IMPLEMENTED = re.compile(r"Could not run '(?P<op>[^']+)' with arguments from the '(?P<key>[^']+)' backend")
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



class Recorder(TorchDispatchMode):
    """Counts operator calls per phase; on the target device itself, runs missing operators on the CPU to go on."""

    def __init__(self, target: Target, recorded_on: str) -> None:
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
        # the composite operator being run (set by Composites), whether the target keeps it whole, and whether a
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


class Composites(TorchFunctionMode):
    """Tells the recorder when the model calls an operator PyTorch builds from others, so that what the target does
    with it (keep it whole, or pick its own parts) is recorded rather than what the recording device does."""

    def __init__(self, recorder: Recorder) -> None:
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
            rec.notes[(op, "forward")] = (f"{rec.target.backend.name} runs it whole; its parts recorded here are "
                                          "left out")
        try:
            out = func(*args, **kwargs)
        finally:
            rec.inside = None
        if whole or rec.saw_variant:
            rec.tag(out, (args, kwargs), op, whole)
        return out
