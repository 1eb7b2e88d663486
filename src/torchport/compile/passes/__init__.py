"""The registry of FX passes run by the ``torchport`` compile backend, and the runner that applies them.

A pass is a function ``GraphModule -> GraphModule`` in its own module of this package, registered with
:func:`register_pass`. Its docstring shows the pattern it rewrites. While it runs, :func:`context` says for which
device, in which mode (training or inference) and with which example inputs the graph is being compiled, and
:func:`note` records, in words, what the pass changed (``torchport.compile.explain`` and ``TORCHPORT_LOG=compile``
show these notes).

The runner applies the enabled passes in ``order``. A pass that raises on an unexpected graph is skipped with a
warning and the graph is restored as it was before the pass; under ``TORCHPORT_STRICT=1`` the error is raised.

The fusion passes replace a subgraph only through ``_replace.replace``, which first runs the subgraph and the fused
op on sample inputs, forward and backward, and leaves the subgraph unfused (with a note and one warning) when they
differ: a library release that keeps a pattern's structure but changes its meaning degrades to "not fused", never to
wrong values or gradients.

Example:
    >>> from torchport.compile import passes
    >>> [p.name for p in passes.list_passes()]   # doctest: +SKIP
    ['dead_code', 'constant_fold', ...]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import pkgutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from ... import _logging, _settings
from ..._registry import Registry

__all__ = [
    "FOREIGN_OPS_REFUSED",
    "FUSING_COMPILERS",
    "Pass",
    "PassContext",
    "PassError",
    "PassRecord",
    "context",
    "get_pass",
    "list_passes",
    "note",
    "register_pass",
    "run_passes",
]

GraphPass = Callable[[torch.fx.GraphModule], torch.fx.GraphModule]

#: Compilers that generate fused kernels for elementwise and reduction subgraphs themselves: the kernel-fusion
#: passes are left out before them unless the options ask for them.
FUSING_COMPILERS = frozenset({"inductor", "torchair"})
#: Compilers that cannot take a ``torchport::`` op at all, with the reason. TorchAir's default mode (GE graph mode,
#: ``max-autotune``) turns every op of the graph into Ascend IR through a converter registered for that op; it has
#: converters for torch_npu's own fused operators (``npu_rms_norm``, ``npu_rotary_mul``, ``npu_swiglu``,
#: ``npu_fusion_attention``: Ascend/torchair ``python/torchair/_ge_concrete_graph/ge_converter/custom/``) and none
#: for a foreign custom op (``docs/zh/custom_op_graph/overview.md``: GE mode needs an Ascend converter per op).
FOREIGN_OPS_REFUSED = {
    "torchair": "TorchAir's GE graph mode converts only ops that have an Ascend converter, and torchport's fused ops "
                "have none; the graph engine fuses these patterns itself",
}


class PassError(RuntimeError):
    """A pass failed under ``TORCHPORT_STRICT=1``; the message names the pass and the cause."""


@dataclasses.dataclass(frozen=True)
class Pass:
    """One registered pass.

    Attributes:
        name: its name, also the option that switches it off (``options={"passes": {"rms_norm": False}}``).
        fn: the function ``GraphModule -> GraphModule``.
        order: passes run by increasing order.
        training: whether it may run on a graph that will be differentiated (conv + batch-norm folding may not).
        default: whether it runs when the options do not name it.
        summary: the first line of its docstring.
        fusion: it swaps a subgraph for a torchport kernel. Such passes are left out by default when the compiler
            generates fused kernels itself (:data:`FUSING_COMPILERS`): on the H100, Inductor's own fusions of
            these subgraphs ran the Llama train step 5% faster than torchport's kernels in their place, which
            split its fusion groups (``benchmarks/RESULTS.md``). Naming the pass in the options runs it anyway.
    """

    name: str
    fn: GraphPass
    order: int
    training: bool
    default: bool
    summary: str
    fusion: bool = False


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass may ask about the compilation it runs in (see :func:`context`).

    Attributes:
        device: the device the graph runs on (that of its first tensor input, else torchport's device).
        training: True when a backward will be built: grad mode is on as it compiles and some input or parameter
            requires grad (in ``eval()`` mode too).
        example_inputs: the example inputs dynamo passed to the backend.
        options: the backend's options.
        compiler: the compiler the graph goes to after the passes (``"eager"``, ``"inductor"``, ``"torchair"``...).
    """

    device: torch.device
    training: bool
    example_inputs: Sequence[Any] = ()
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    compiler: str = "eager"


@dataclasses.dataclass
class PassRecord:
    """What one pass did to one graph: its notes, the node count before and after, and an error if it failed."""

    name: str
    notes: list[str] = dataclasses.field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    error: str | None = None

    @property
    def changed(self) -> bool:
        return bool(self.notes) or self.nodes_before != self.nodes_after

    def describe(self) -> str:
        if self.error:
            return f"{self.name}: skipped ({self.error})"
        if not self.changed:
            return f"{self.name}: no change"
        delta = f"{self.nodes_before} -> {self.nodes_after} nodes"
        return f"{self.name}: {'; '.join(self.notes) or 'rewrote the graph'} ({delta})"


def _import_passes() -> None:
    # every module of this package is one pass: adding a pass is adding a file
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):  # private helpers (_graph) register nothing
            importlib.import_module(f"{__name__}.{info.name}")


_PASSES: Registry[Pass] = Registry("compile pass", load=_import_passes, origin=lambda p: p.fn.__module__)
_context: contextvars.ContextVar[PassContext | None] = contextvars.ContextVar("torchport_pass_context", default=None)
_notes: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("torchport_pass_notes", default=None)


def register_pass(name: str, *, order: int, training: bool = True, default: bool = True,
                  fusion: bool = False) -> Callable[[GraphPass], GraphPass]:
    """Register a pass under ``name`` (a duplicate name is an error).

    Example:
        >>> @register_pass("my_pass", order=500)
        ... def my_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        ...     '''Rewrites ``a`` into ``b``.'''
        ...     return gm
    """

    def decorate(fn: GraphPass) -> GraphPass:
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        _PASSES.register(name, Pass(name, fn, order, training, default, summary, fusion))
        return fn

    return decorate


def list_passes() -> list[Pass]:
    """Every registered pass, in the order they run."""
    return sorted(_PASSES.entries().values(), key=lambda p: (p.order, p.name))


def get_pass(name: str) -> Pass:
    """The pass named ``name``; an unknown name is an error listing the registered ones."""
    return _PASSES.get(name)


def context() -> PassContext:
    """The compilation the running pass belongs to; outside the runner, a CPU inference context."""
    current = _context.get()
    return current if current is not None else PassContext(torch.device("cpu"), training=False)


def note(message: str) -> None:
    """Record what the running pass changed, in words (shown by ``explain`` and ``TORCHPORT_LOG=compile``)."""
    notes = _notes.get()
    if notes is not None:
        notes.append(message)


@contextlib.contextmanager
def running(ctx: PassContext) -> Iterator[None]:
    """Make ``ctx`` the :func:`context` of passes run inside the block (for running one pass by hand)."""
    token = _context.set(ctx)
    try:
        yield
    finally:
        _context.reset(token)


def _count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.nodes if node.op not in ("placeholder", "output"))


def _snapshot(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, enabled: dict[str, bool] | None = None) -> tuple[torch.fx.GraphModule, list[PassRecord]]:
    """Apply the passes to ``gm`` in order; return the rewritten module and what each pass did.

    Args:
        gm: the graph to rewrite (changed in place where the passes do so).
        ctx: the compilation's device, mode, inputs and options.
        enabled: pass name -> run it or not, overriding each pass's default (unknown names are an error).
    """
    enabled = dict(enabled or {})
    unknown = sorted(set(enabled) - {p.name for p in list_passes()})
    if unknown:
        raise ValueError(f"unknown compile pass(es) {', '.join(unknown)}; registered: {', '.join(p.name for p in list_passes())}")
    refused = FOREIGN_OPS_REFUSED.get(ctx.compiler)
    asked = sorted(p.name for p in list_passes() if p.fusion and enabled.get(p.name))
    if refused and asked:
        raise ValueError(f"compile pass(es) {', '.join(asked)} would put torchport ops into a graph for "
                         f"{ctx.compiler}: {refused}. Leave them off with compiler={ctx.compiler!r}, or choose "
                         f"compiler='eager' to run torchport's fused kernels")
    strict = _settings.value("strict")
    records: list[PassRecord] = []
    with running(ctx):
        for p in list_passes():
            default = p.default and not (p.fusion and ctx.compiler in FUSING_COMPILERS)
            if not enabled.get(p.name, default) or (ctx.training and not p.training):
                continue
            record = PassRecord(p.name, nodes_before=_count(gm))
            saved = _snapshot(gm.graph)
            notes: list[str] = []
            token = _notes.set(notes)
            try:
                result = p.fn(gm)
                if not isinstance(result, torch.fx.GraphModule):
                    raise TypeError(f"returned {type(result).__name__}, not a GraphModule")
                result.graph.lint()
                result.recompile()
                gm = result
            except Exception as exc:  # noqa: BLE001 - a pass must never break compilation unless asked to
                if strict:
                    raise PassError(f"compile pass {p.name!r} failed: {type(exc).__name__}: {exc}") from exc
                gm.graph = saved
                gm.recompile()
                notes.clear()
                record.error = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"torchport compile pass {p.name!r} failed on this graph and was skipped "
                    f"({record.error}); set TORCHPORT_STRICT=1 to raise instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
            finally:
                _notes.reset(token)
            record.notes = notes
            record.nodes_after = _count(gm)
            records.append(record)
            if record.changed or record.error:
                _logging.log("compile", "%s", record.describe())
    return gm, records
