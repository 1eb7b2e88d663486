"""The ``torchport`` dynamo backend: torchport's FX passes, then the best compiler for the device.

``torch.compile(model, backend="torchport")`` works once torchport is installed: the backend is registered
through the ``torch_dynamo_backends`` entry-point group, so PyTorch finds it by name without an import. For each
graph dynamo captures, the backend

1. finds the graph's device (that of its tensor inputs) and whether it will be differentiated: grad mode is on
   as it compiles and some input requires grad (parameters, which dynamo lifts into inputs, included), whatever
   the modules' train/eval mode;
2. runs the passes of :mod:`torchport.compile.passes` in order (fused torchport kernels for plain-PyTorch RMSNorm,
   SwiGLU, GeGLU, RoPE and cross-entropy; conv + batch-norm folding in eval mode; addmm; dead code; constant
   folding; channels-last where the device prefers it). The kernel-fusion passes are left out before Inductor,
   which fuses those subgraphs itself and measured faster so; ``options={"passes": {"rms_norm": True}}`` runs
   one anyway;
3. hands the rewritten graph to the device's compiler: Inductor on CUDA, XPU and CPU, TorchAir (or torch_npu's
   own backend) on Ascend, or runs it as it is elsewhere. Training graphs go through the same path: Inductor
   and TorchAir differentiate them with AOTAutograd; the eager path uses PyTorch's autograd.

Options, through ``torch.compile(model, backend="torchport", options={...})``:

``compiler``
    ``"auto"`` (default, the device's compiler as above), ``"inductor"``, ``"eager"``, or the name of any
    registered dynamo backend (``"aot_eager"``, ``"cudagraphs"``...).
``passes``
    ``{pass name: bool}`` switching passes on or off, e.g. ``{"rms_norm": False}``.
    ``torchport.compile.passes.list_passes()`` lists them.
``inductor``
    a dict of Inductor settings (``torch._inductor.config`` names), used when the compiler is Inductor.
``fallback``
    ``True`` (default): when the compiler fails on a graph, warn and run the rewritten graph eagerly;
    ``False`` (or ``TORCHPORT_STRICT=1``): raise.

``mode`` (``"max-autotune"``, ``"reduce-overhead"``...) is passed on to Inductor.

Example:
    >>> compiled = torch.compile(model, backend="torchport", options={"passes": {"rope": False}})
    >>> print(torchport.compile.explain(model, input_ids))
"""

from __future__ import annotations

import dataclasses
import json
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from .. import _logging, _settings
from ..backends import get_backend
from ..device import device as default_device
from .passes import PassContext, PassRecord, list_passes, run_passes

__all__ = ["OPTIONS", "Explanation", "GraphReport", "explain", "torchport_backend"]

#: The options the backend accepts, with what each one means.
OPTIONS: dict[str, str] = {
    "compiler": "auto (the device's best), inductor, eager, or a registered dynamo backend's name",
    "passes": "{pass name: bool} switching passes on or off",
    "inductor": "dict of Inductor settings, used when the compiler is Inductor",
    "fallback": "bool: run the rewritten graph eagerly (with a warning) when the compiler fails (default True)",
}


@dataclasses.dataclass
class GraphReport:
    """What the backend did to one captured graph."""

    index: int
    device: str
    training: bool
    compiler: str
    nodes_before: int
    nodes_after: int
    passes: list[PassRecord]
    compile_error: str | None = None
    why: str = ""  # why the graph is a training (differentiated) or an inference graph

    @property
    def mode(self) -> str:
        """``"training"`` when the graph will be differentiated, else ``"inference"``."""
        return "training" if self.training else "inference"

    def changes(self) -> list[str]:
        """One line per pass that changed this graph or failed on it."""
        return [record.describe() for record in self.passes if record.changed or record.error]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "device": self.device,
            "training": self.training,
            "why": self.why,
            "compiler": self.compiler,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "compile_error": self.compile_error,
            "passes": [
                {"name": r.name, "notes": r.notes, "nodes_before": r.nodes_before, "nodes_after": r.nodes_after,
                 "error": r.error}
                for r in self.passes
            ],
        }


@dataclasses.dataclass
class Explanation:
    """What :func:`explain` found: one :class:`GraphReport` per graph dynamo captured (more than one graph means
    the model has graph breaks, each of which splits it)."""

    graphs: list[GraphReport]
    model_mode: str | None = None  # "eval", "training" or "mixed" (some modules in each) for a module; else None

    def changes(self) -> list[str]:
        """Every change, prefixed with its graph's index."""
        return [f"graph {g.index}: {line}" for g in self.graphs for line in g.changes()]

    def to_json(self) -> str:
        return json.dumps({"model_mode": self.model_mode, "graphs": [g.to_dict() for g in self.graphs]}, indent=2)

    def _mode_line(self, graph: GraphReport) -> str:
        line = f"{graph.mode}: {graph.why}"
        if self.model_mode is None:
            return line
        modules = {"eval": "the model is in eval mode", "training": "the model is in training mode",
                   "mixed": "the model has modules in training mode and in eval mode"}[self.model_mode]
        if graph.training and self.model_mode != "training":
            # An eval-mode model called with grad on is differentiated all the same (fine-tuning with frozen batch
            # norm does it); the passes must then keep every parameter's gradient.
            return f"{line}; {modules}: explain it under torch.no_grad() to see the graph it compiles for inference"
        return f"{line}; {modules}"

    def __str__(self) -> str:
        if not self.graphs:
            return "dynamo captured no graph (the model ran no tensor code, or dynamo skipped it)"
        lines = []
        for g in self.graphs:
            lines.append(
                f"graph {g.index} ({g.device}, {g.mode}, compiler {g.compiler}): "
                f"{g.nodes_before} -> {g.nodes_after} nodes"
            )
            lines.append(f"  {self._mode_line(g)}")
            lines.extend(f"  {line}" for line in g.changes() or ["no pass changed this graph"])
            if g.compile_error:
                lines.append(f"  compiler failed, ran eagerly: {g.compile_error}")
        return "\n".join(lines)


_explain_lock = threading.Lock()


def _options(options: dict[str, Any] | None) -> dict[str, Any]:
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        valid = "; ".join(f"{name}: {meaning}" for name, meaning in OPTIONS.items())
        raise ValueError(f"unknown torchport compile option(s) {', '.join(unknown)}; valid options: {valid}")
    compiler = options.get("compiler", "auto")
    if not isinstance(compiler, str) or not compiler:
        raise ValueError(f"compiler={compiler!r} is not a compiler name; use {OPTIONS['compiler']}")
    passes = options.get("passes", {})
    if not isinstance(passes, dict) or not all(isinstance(v, bool) for v in passes.values()):
        raise ValueError(f"passes={passes!r} must be a dict of pass name -> True/False")
    names = {p.name for p in list_passes()}
    unknown_passes = sorted(set(passes) - names)
    if unknown_passes:
        raise ValueError(f"unknown compile pass(es) {', '.join(unknown_passes)}; registered: {', '.join(sorted(names))}")
    inductor = options.get("inductor", {})
    if not isinstance(inductor, dict):
        raise ValueError(f"inductor={inductor!r} must be a dict of Inductor settings")
    fallback = options.get("fallback", True)
    if not isinstance(fallback, bool):
        raise ValueError(f"fallback={fallback!r} must be True or False")
    return {"compiler": compiler, "passes": passes, "inductor": inductor, "fallback": fallback}


def _graph_device(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> torch.device:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            return value.device
    return default_device()


def _require_grad(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'} require{'s' if count == 1 else ''} grad"


def _differentiated(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[bool, str]:
    """Whether the graph will be differentiated, and why, in words.

    AOTAutograd builds a backward when grad mode is on as the graph compiles (dynamo guards on grad mode: a call
    under another one compiles again) and some input requires grad. Dynamo lifts parameters into inputs, where they
    require grad in eval mode too, so a module's train/eval mode does not decide it: an eval-mode model called with
    grad on is differentiated, and a training-mode one under ``torch.no_grad()`` is not. Parameters the graph
    module holds itself (a graph traced without dynamo) count as lifted ones.
    """
    if not torch.is_grad_enabled():
        return False, "grad mode is off (torch.no_grad() or torch.inference_mode()), so no backward is built"
    parameters = {id(p): p for p in gm.parameters() if p.requires_grad}
    parameters.update((id(v), v) for v in example_inputs if isinstance(v, nn.Parameter) and v.requires_grad)
    inputs = sum(1 for v in example_inputs if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
                 and v.requires_grad)
    if not parameters and not inputs:
        return False, "grad mode is on but no input or parameter requires grad, so no backward is built"
    found = [_require_grad(count, noun) for count, noun in ((len(parameters), "parameter"), (inputs, "input")) if count]
    return True, f"grad mode is on and {' and '.join(found)}, so a backward is built"


def _model_mode(model: Any) -> str | None:
    if not isinstance(model, nn.Module):
        return None
    modes = {module.training for module in model.modules()}
    return "mixed" if len(modes) > 1 else "training" if model.training else "eval"


def _compiler(device: torch.device, choice: str) -> tuple[str, Callable[..., Any] | None]:
    if choice == "auto":
        return get_backend(device.type).dynamo_compiler()
    if choice == "eager":
        return "eager", None
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    if choice == "torchport":
        raise ValueError("compiler='torchport' would hand the graph back to this backend; choose another compiler")
    try:
        return choice, lookup_backend(choice)
    except Exception as exc:  # torch raises InvalidBackend, whose type moved between releases
        raise ValueError(
            f"compiler={choice!r} is not a dynamo backend; registered: auto, {', '.join(list_backends(exclude_tags=()))}"
        ) from exc


def _compile(name: str, compiler: Callable[..., Any], gm: torch.fx.GraphModule, example_inputs: list[Any],
             mode: str | None, inductor: dict[str, Any]) -> Callable[..., Any]:
    if name == "inductor":
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches = {**(list_mode_options(mode) if mode else {}), **inductor}
        return compile_fx(gm, example_inputs, config_patches=patches or None)
    return compiler(gm, example_inputs)


def _prepare(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: dict[str, Any],
             index: int) -> tuple[torch.fx.GraphModule, GraphReport]:
    device = _graph_device(gm, example_inputs)
    name = opts["compiler"] if opts["compiler"] != "auto" else get_backend(device.type).dynamo_compiler()[0]
    training, why = _differentiated(gm, example_inputs)
    ctx = PassContext(device=device, training=training, example_inputs=tuple(example_inputs), options=opts,
                      compiler=name)
    nodes_before = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
    gm, records = run_passes(gm, ctx, opts["passes"])
    report = GraphReport(index, str(device), ctx.training, name, nodes_before,
                         sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output")), records, why=why)
    return gm, report


def torchport_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *, mode: str | None = None,
                      options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The dynamo backend behind ``torch.compile(model, backend="torchport")`` (see the module's documentation)."""
    opts = _options(options)
    gm, report = _prepare(gm, example_inputs, opts, 0)
    name, compiler = _compiler(torch.device(report.device), opts["compiler"])
    _logging.log("compile", "graph of %d nodes on %s (%s: %s): %d nodes after the passes, compiled with %s",
                 report.nodes_before, report.device, report.mode, report.why, report.nodes_after, name)
    if compiler is None:
        return gm.forward
    try:
        return _compile(name, compiler, gm, example_inputs, mode, opts["inductor"])
    except Exception as exc:
        if _settings.value("strict") or not opts["fallback"]:
            raise
        warnings.warn(
            f"torchport compile: {name} failed on a graph of {report.nodes_after} nodes on {report.device} "
            f"({type(exc).__name__}: {exc}); running that graph eagerly. Set options={{'fallback': False}} or "
            "TORCHPORT_STRICT=1 to raise instead",
            RuntimeWarning,
            stacklevel=2,
        )
        return gm.forward


def explain(model: Callable[..., Any], *inputs: Any, options: dict[str, Any] | None = None,
            **kwargs: Any) -> Explanation:
    """Run ``model(*inputs, **kwargs)`` once under dynamo and say which torchport pass changed what in each graph.

    Nothing is compiled: the rewritten graphs run eagerly, so this is quick. As ``torch._dynamo.explain`` does, it
    clears dynamo's caches first (models compiled earlier recompile on their next call). Set
    ``TORCHPORT_LOG=compile`` to see the same lines while a real ``torch.compile(..., backend="torchport")`` runs.

    Args:
        model: a module or function.
        inputs, kwargs: what to call it with. The graphs are training graphs when they will be differentiated:
            grad mode is on and some input or parameter requires grad, whatever the model's train/eval mode
            (passes unsafe for training are then left out). Call ``explain`` as the model will run: under
            ``torch.no_grad()`` to see what inference compiles. The report says which case it found and why.
        options: the backend's options (``compiler`` names the compiler the report mentions).

    Returns:
        An :class:`Explanation`; ``print`` it, or ``.changes()`` / ``.to_json()``.

    Example:
        >>> with torch.no_grad():
        ...     print(torchport.compile.explain(model.eval(), input_ids))
        graph 0 (cpu, inference, compiler inductor): 412 -> 250 nodes
          inference: grad mode is off (torch.no_grad() or torch.inference_mode()), so no backward is built; the
          model is in eval mode
          rms_norm: replaced 33 RMSNorm subgraphs with torchport::rms_norm (412 -> 250 nodes)
    """
    opts = _options(options)
    graphs: list[GraphReport] = []

    def recorder(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        gm, report = _prepare(gm, example_inputs, opts, len(graphs))
        graphs.append(report)
        return gm.forward

    import torch._dynamo

    with _explain_lock:
        torch._dynamo.reset()
        try:
            torch.compile(model, backend=recorder)(*inputs, **kwargs)
        finally:
            torch._dynamo.reset()
    return Explanation(graphs, _model_mode(model))
