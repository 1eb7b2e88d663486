"""``F.cross_entropy`` on class indices (Hugging Face's causal-LM loss) -> ``torchport::cross_entropy``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from ...kernels import library  # noqa: F401 - registers torch.ops.torchport
from ...kernels.loss_checks import REDUCTIONS
from . import note, register_pass
from ._graph import value as _value
from ._replace import replace

__all__ = ["cross_entropy"]

Node = torch.fx.Node

_SIGNATURE = inspect.signature(F.cross_entropy)
_RESHAPES = ("view", "reshape")


def _arguments(node: Node) -> dict[str, Any] | None:
    """``F.cross_entropy``'s arguments by name, defaults filled in; None when they do not bind."""
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _supported(args: dict[str, Any]) -> bool:
    """What the kernel computes: no class weights, no legacy reduction flags, class-index targets."""
    smoothing, ignore_index = args["label_smoothing"], args["ignore_index"]
    return (args["weight"] is None and args["size_average"] is None and args["reduce"] is None
            and args["reduction"] in REDUCTIONS
            and isinstance(ignore_index, int) and not isinstance(ignore_index, bool)
            and isinstance(smoothing, (int, float)) and not isinstance(smoothing, bool) and 0.0 <= smoothing <= 1.0)


def _is_upcast(node: Any) -> bool:
    """``x.float()`` / ``x.to(torch.float32)`` of a float16, bfloat16 or float32 ``x``."""
    if not isinstance(node, Node) or node.op != "call_method" or not node.args:
        return False
    source = _value(node.args[0])
    if source is None:
        return False
    if source.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False  # (a float64 -> float32 cast changes the result's dtype: it stays)
    if node.target == "float":
        return len(node.args) == 1 and not node.kwargs
    given = [*node.args[1:], *node.kwargs.values()]
    return node.target == "to" and given == [torch.float32] and set(node.kwargs) <= {"dtype"}


def _without_upcast(logits: Node) -> tuple[Node, tuple[Any, ...] | None]:
    """The logits to hand to the kernel: for ``x.float()`` or ``x.float().view(sizes)`` feeding only the loss,
    ``x`` (and ``sizes``, to reshape ``x`` to), so no float32 copy of the logits is made (the kernel computes in
    float32 inside); else ``logits`` itself."""
    if _is_upcast(logits) and len(logits.users) == 1:
        return logits.args[0], None
    reshape = logits
    if not (reshape.op == "call_method" and reshape.target in _RESHAPES and len(reshape.users) == 1
            and not reshape.kwargs and all(_is_size(a) for a in reshape.args[1:])):
        return logits, None
    upcast = reshape.args[0]
    if not (_is_upcast(upcast) and len(upcast.users) == 1):
        return logits, None
    sizes = reshape.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = tuple(sizes[0])
    if any(isinstance(s, (list, tuple)) for s in sizes):
        return logits, None
    return upcast.args[0], sizes


def _is_size(arg: Any) -> bool:
    """A size argument of ``view``/``reshape`` (an int, a symbolic size, or a list of them), not a dtype."""
    if isinstance(arg, (list, tuple)):
        return all(_is_size(a) for a in arg)
    return isinstance(arg, (int, torch.SymInt, Node)) and not isinstance(arg, bool)


def _fused(graph: torch.fx.Graph, inputs: Sequence[Any], *, options: tuple[Any, ...], reshape: bool,
           cast: torch.dtype | None) -> list[Node]:
    """The op on ``inputs`` = (logits, target, reshape sizes...), reshaping the logits and casting the loss first
    where asked. (reshape, not view: the dropped upcast made a dense copy that any view fits; the logits
    themselves may be strided.)"""
    logits = graph.call_method("reshape", (inputs[0], *inputs[2:])) if reshape else inputs[0]
    loss = graph.call_function(torch.ops.torchport.cross_entropy.default, (logits, inputs[1], *options))
    return [graph.call_method("to", (loss, cast)) if cast is not None else loss]


def _sample_targets(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator, *, classes: Any,
                    ignore_index: int) -> torch.Tensor:
    """Class indices, a quarter of them ``ignore_index`` (never all of them, whose mean is NaN in PyTorch)."""
    classes = int(classes.node.hint) if isinstance(classes, torch.SymInt) else int(classes)
    targets = torch.randint(0, classes, tuple(shape), generator=gen, dtype=dtype)
    ignored = torch.rand(tuple(shape), generator=gen) < 0.25
    if ignored.numel():
        ignored.view(-1)[0] = False
    return targets.masked_fill(ignored, ignore_index)


@register_pass("cross_entropy", order=240, training=True, fusion=True)
def cross_entropy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``F.cross_entropy(logits, target, ...)`` on ``[N, V]`` logits -> one ``torchport::cross_entropy``.

    Rewrites what dynamo captures of Hugging Face's ``ForCausalLMLoss`` (``fixed_cross_entropy`` inlined)::

        logits = logits.float().view(-1, vocab)        # the upcast, when it feeds only the loss, is dropped
        loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")    # or "mean"
        ->  loss = torch.ops.torchport.cross_entropy(logits.reshape(-1, vocab), labels, -100, 0.0, "sum", 0.0,
                                                     False)

    The op computes in float32 and returns a float32 loss (cast to the original loss's dtype where that differs),
    so dropping the upcast keeps the float32 result without a float32 copy of the logits. Any ``ignore_index``,
    ``label_smoothing`` and reduction ``mean``/``sum``/``none`` are kept. Rewritten only for 2-D floating logits
    with 1-D integer targets; class weights, probability targets, the legacy ``size_average``/``reduce`` flags and
    ``[N, C, d...]`` inputs stay. Two differences: a mean over targets that are all ``ignore_index`` is 0, where
    PyTorch gives NaN; a target outside the classes makes the loss NaN (the op reads nothing on the host), where
    PyTorch's kernel fails a device-side assertion.
    """
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.cross_entropy:
            continue
        args = _arguments(node)
        if args is None or not _supported(args):
            continue
        logits, target = args["input"], args["target"]
        lv, tv, out = _value(logits), _value(target), _value(node)
        if lv is None or tv is None or out is None or lv.dim() != 2 or tv.dim() != 1:
            continue
        if not lv.is_floating_point() or tv.is_floating_point() or tv.is_complex() or tv.dtype == torch.bool:
            continue
        source, sizes = _without_upcast(logits)
        loss_dtype = torch.float64 if lv.dtype == torch.float64 else torch.float32  # what the op returns
        # z-loss 0, and no target check on the host (none in a compiled step): a bad target's loss is NaN
        fused = functools.partial(_fused, options=(args["ignore_index"], float(args["label_smoothing"]),
                                                   args["reduction"], 0.0, False),
                                  reshape=sizes is not None, cast=out.dtype if out.dtype != loss_dtype else None)
        samplers = {1: functools.partial(_sample_targets, classes=lv.shape[-1], ignore_index=args["ignore_index"])}
        if replace(gm, [node], (source, target, *(sizes or ())), fused, what="cross-entropy loss",
                   samplers=samplers) is not None:
            count += 1
    if count:
        note(f"replaced {count} cross-entropy loss{'es' * (count > 1)} with torchport::cross_entropy")
    return gm
