"""Replace a matched subgraph by a fused op, after proving on sample inputs that both compute the same function.

The fusion passes match subgraphs by their structure: which calls, in which order, with which constants. A library
release can keep that structure and change its meaning (a renamed default, a different broadcast, a new cast), and a
kernel can change too; a structural match alone would then give wrong values or wrong gradients to every user of the
compiled model. So before a pass rewrites, :func:`replace` runs the matched subgraph and its replacement side by side
on random inputs shaped like the graph's own (forward, and backward for every floating input) and refuses the
rewrite when they differ: the subgraph then stays as it was ("not fused"), and the pass notes why.

The check runs on the device the graph is compiled for, so the implementation that will run there is the one checked.
Sizes are shrunk before the check (every size above 4 that no input has as its last dimension becomes 4: batch and
sequence lengths shrink, hidden and vocabulary sizes stay), so a check costs a few small kernel launches; when the
subgraph does not run at the shrunk sizes (a size written into the graph), it runs at the graph's own sizes up to
:data:`FULL_SIZE_LIMIT` elements. Verdicts are remembered per subgraph structure, sizes and dtypes: a model whose
layers repeat one pattern is checked once.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from ... import _settings
from . import context, note

__all__ = ["FULL_SIZE_LIMIT", "TOLERANCE", "Sampler", "forget", "replace"]

Node = torch.fx.Node
#: ``sampler(shape, dtype, generator) -> tensor on the CPU`` for an input that random normal values would not fit
#: (class indices of a loss, say).
Sampler = Callable[[Sequence[int], torch.dtype, torch.Generator], torch.Tensor]

#: ||replacement - original|| / ||original|| allowed per output dtype. The fused kernels round once, from float32,
#: where the eager subgraph rounds after every op: in bfloat16 that alone reaches about 1%.
TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
#: The most elements (all sample inputs together) a check may use at the graph's own sizes.
FULL_SIZE_LIMIT = 1 << 24
_SHRUNK = 4
_WALK_LIMIT = 256  # nodes; the fused patterns are a few dozen at most

_verdicts: dict[Any, str | None] = {}
_warned: set[tuple[str, str]] = set()
_lock = threading.Lock()


class _Refused(Exception):
    """The check could not run, or found a difference: the message says which."""


def replace(gm: torch.fx.GraphModule, outputs: Sequence[Node], inputs: Sequence[Any],
            build: Callable[[torch.fx.Graph, Sequence[Any]], Sequence[Node]], *, what: str,
            samplers: dict[int, Sampler] | None = None, erased: set[Node] | None = None) -> list[Node] | None:
    """Replace the subgraph computing ``outputs`` from ``inputs`` by what ``build`` makes, if both agree.

    Args:
        gm: the graph module being rewritten.
        outputs: the subgraph's result nodes, replaced in order by the nodes ``build`` returns.
        inputs: the replacement's arguments: nodes of ``gm`` (the subgraph's boundary) or constants.
        build: ``build(graph, inputs) -> result nodes``; creates the replacement's nodes at the graph's insertion
            point (called twice: once in a scratch graph for the check, once in ``gm``).
        what: the pattern's name for notes and warnings ("RMSNorm subgraph").
        samplers: sample makers for some inputs, by their index in ``inputs``.
        erased: where to add the nodes the rewrite erases (a pass walking a list of the graph's nodes skips them).

    Returns:
        The new result nodes, or None when the rewrite was refused (``gm`` unchanged; a note and one warning per
        cause say why).
    """
    graph = gm.graph
    try:
        subgraph = _subgraph(outputs, inputs)
        reason = _verdict(gm, subgraph, outputs, inputs, build, samplers or {})
    except _Refused as exc:
        reason = str(exc)
    if reason is not None:
        _refuse(what, reason)
        return None
    first = min(outputs, key=_position(graph).__getitem__)
    with graph.inserting_before(first):
        new = list(build(graph, inputs))
    for old, fresh in zip(outputs, new):
        fresh.meta.update({k: old.meta[k] for k in ("val", "example_value", "stack_trace") if k in old.meta})
        old.replace_all_uses_with(fresh)
    alive = set(subgraph)
    while dead := [n for n in alive if not n.users]:  # users before what they use
        for node in dead:
            graph.erase_node(node)
        alive.difference_update(dead)
        if erased is not None:
            erased.update(dead)
    return new


def _position(graph: torch.fx.Graph) -> dict[Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def _subgraph(outputs: Sequence[Node], inputs: Sequence[Any]) -> list[Node]:
    """The nodes between ``inputs`` and ``outputs``, in graph order; refused when the outputs depend on a graph
    input that the replacement does not take."""
    boundary = {a for a in inputs if isinstance(a, Node)}
    found: set[Node] = set()
    stack = [n for n in outputs if n not in boundary]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        if node.op == "placeholder":
            raise _Refused(f"the subgraph reads the graph input {node.name!r}, which the fused op does not take")
        found.add(node)
        if len(found) > _WALK_LIMIT:
            raise _Refused(f"the subgraph has more than {_WALK_LIMIT} nodes")
        map_arg((node.args, node.kwargs), lambda n: stack.append(n) if n not in boundary else None)
    order = _position(outputs[0].graph)
    subgraph = sorted(found, key=order.__getitem__)
    first_output = min(order[n] for n in outputs)
    if any(order[n] > first_output for n in boundary):
        raise _Refused("an input of the fused op is computed after one of the subgraph's results")
    return subgraph


def _scratch(gm: torch.fx.GraphModule, placeholders: int,
             body: Callable[[torch.fx.Graph, list[Node]], Sequence[Node]]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    args = [graph.placeholder(f"input_{i}") for i in range(placeholders)]
    graph.output(tuple(body(graph, args)))
    return torch.fx.GraphModule(gm, graph)


def _modules(gm, subgraph, outputs, inputs, build) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, list[int]]:
    """The original subgraph and the replacement as two modules of the same tensor and number arguments, and which
    of ``inputs`` those arguments are."""
    sample_at = [i for i, a in enumerate(inputs) if isinstance(a, Node)]

    def original(graph: torch.fx.Graph, args: list[Node]) -> list[Node]:
        env = {inputs[i]: arg for i, arg in zip(sample_at, args)}
        for node in subgraph:
            env[node] = graph.node_copy(node, env.__getitem__)
        return [env[n] for n in outputs]

    def replacement(graph: torch.fx.Graph, args: list[Node]) -> Sequence[Node]:
        given = iter(args)
        return build(graph, [next(given) if isinstance(a, Node) else a for a in inputs])

    return (_scratch(gm, len(sample_at), original), _scratch(gm, len(sample_at), replacement), sample_at)


def _signature(gm: torch.fx.GraphModule) -> tuple:
    """The module's computation with node names left out (layers that repeat a pattern share one signature)."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    return tuple((n.op, str(n.target), repr(map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}"))) for n in gm.graph.nodes
                 if n.op != "placeholder")


def _hint(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        if size.node.hint is None:  # (a data-dependent size has no example value)
            raise _Refused("a size of the subgraph depends on data")
        return int(size.node.hint)
    return int(size)


def _example(node: Node) -> Any:
    found = node.meta.get("val", node.meta.get("example_value"))
    if found is None:
        raise _Refused(f"no example value is recorded for {node.name!r}")
    return found


def _shrink(shapes: list[list[int]]) -> dict[int, int]:
    """Size -> smaller size for the check: every size above 4 that is no input's last dimension."""
    last = {s[-1] for s in shapes if s}
    return {n: _SHRUNK for s in shapes for n in s[:-1] if n > _SHRUNK and n not in last}


def _samples(examples: list[Any], samplers: dict[int, Sampler], positions: list[int], device: torch.device,
             sizes: dict[int, int]) -> list[Any]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for position, example in zip(positions, examples):
        if isinstance(example, torch.Tensor):
            shape = [sizes.get(n, n) for n in (_hint(s) for s in example.shape)]
            if position in samplers:
                value = samplers[position](shape, example.dtype, gen)
            elif example.is_floating_point():
                value = torch.randn(shape, generator=gen, dtype=torch.float32).to(example.dtype)
            elif example.dtype == torch.bool:
                value = torch.rand(shape, generator=gen) < 0.5
            elif not example.is_complex():
                value = torch.randint(0, 2, shape, generator=gen, dtype=example.dtype)
            else:
                raise _Refused(f"no sample for a {example.dtype} input")
            out.append(value.to(device))
        elif isinstance(example, torch.SymInt):
            out.append(sizes.get(_hint(example), _hint(example)))
        elif isinstance(example, torch.SymFloat):
            out.append(float(example.node.hint) if example.node.hint is not None else 1e-6)
        elif isinstance(example, (bool, int, float)):
            out.append(example)
        else:
            raise _Refused(f"no sample for an input of type {type(example).__name__}")
    return out


@contextlib.contextmanager
def _eager(device: torch.device) -> Iterator[None]:
    """Real tensors and gradients, without autocast, inside a compiler call (which may run under fake-tensor,
    inference or autocast modes of its own)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with contextlib.ExitStack() as stack:
        stack.enter_context(unset_fake_temporarily())
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        for device_type in {"cpu", device.type}:
            if torch.amp.is_autocast_available(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def _evaluate(module: torch.fx.GraphModule, samples: list[Any]) -> list[torch.Tensor]:
    """Outputs, then the gradients of every floating sample for fixed random output gradients."""
    leaves = [s.detach().requires_grad_(s.is_floating_point()) if isinstance(s, torch.Tensor) else s
              for s in samples]
    outputs = [o for o in module(*leaves)]
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        raise _Refused("a result is not a tensor")
    wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    differentiable = [o for o in outputs if o.requires_grad]
    gen = torch.Generator().manual_seed(1)
    ups = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in differentiable]
    grads = torch.autograd.grad(differentiable, wanted, ups, allow_unused=True) if differentiable and wanted else []
    return [o.detach() for o in outputs] + [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wanted)]


def _difference(got: list[torch.Tensor], want: list[torch.Tensor], outputs: int,
                inputs: Sequence[torch.dtype]) -> str | None:
    """Why ``got`` is not ``want`` (None when it is), judged at the precision of the narrowest floating dtype among
    the inputs and the value itself (a float32 loss of bfloat16 logits is only as exact as bfloat16)."""
    if len(got) != len(want):
        return f"the replacement gives {len(got)} values where the subgraph gives {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        what = f"result {i}" if i < outputs else f"the gradient of input {i - outputs}"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{what} is {a.dtype} {tuple(a.shape)} instead of {b.dtype} {tuple(b.shape)}"
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return f"{what} differs"
            continue
        tolerance = max(TOLERANCE.get(d, TOLERANCE[torch.float32]) for d in (b.dtype, *inputs))
        a, b = a.double().cpu(), b.double().cpu()
        finite = torch.isfinite(b)
        if not torch.equal(finite, torch.isfinite(a)) or not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()):
            return f"{what} has non-finite values in other places"
        a, b = a[finite], b[finite]
        err = (a - b).norm().item() / max(b.norm().item(), 1e-3 * math.sqrt(max(b.numel(), 1)))
        if not err <= tolerance:
            return f"{what} differs by {err:.3g} (relative), more than {tolerance:g}"
    return None


def _verdict(gm, subgraph, outputs, inputs, build, samplers) -> str | None:
    original, fused, positions = _modules(gm, subgraph, outputs, inputs, build)
    examples = [_example(inputs[i]) for i in positions]
    described = tuple((tuple(_hint(s) for s in e.shape), e.dtype) if isinstance(e, torch.Tensor) else type(e).__name__
                      for e in examples)
    device = context().device
    # the kernel setting picks the implementation the check runs, so a verdict holds for one setting
    kernels = tuple(sorted(_settings.value("kernels").items()))
    key = (_signature(original), _signature(fused), described, str(device.type), kernels)
    with _lock:
        if key in _verdicts:
            return _verdicts[key]
    shapes = [[_hint(s) for s in e.shape] for e in examples if isinstance(e, torch.Tensor)]
    verdict = None
    with _eager(device):
        for sizes in (_shrink(shapes), {}):
            samples = _samples(examples, samplers, positions, device, sizes)
            try:
                want = _evaluate(original, samples)
            except _Refused as exc:
                verdict = str(exc)
                break
            except Exception as exc:  # noqa: BLE001 - a size written into the graph: try the graph's own sizes
                verdict = f"the subgraph does not run on sample inputs ({type(exc).__name__}: {exc})"
                elements = sum(math.prod(s) for s in shapes)
                if sizes and elements <= FULL_SIZE_LIMIT:
                    continue
                if sizes:
                    verdict = f"the subgraph runs only at its own sizes, {elements} elements, too many to check"
                break
            try:
                got = _evaluate(fused, samples)
            except Exception as exc:  # noqa: BLE001 - the fused op cannot serve these inputs here
                verdict = f"the fused op fails on these inputs ({type(exc).__name__}: {exc})"
                break
            dtypes = [s.dtype for s in samples if isinstance(s, torch.Tensor) and s.is_floating_point()]
            verdict = _difference(got, want, len(outputs), dtypes)
            break
    with _lock:
        _verdicts[key] = verdict
    return verdict


def _refuse(what: str, reason: str) -> None:
    note(f"left a {what} unfused: {reason}")
    with _lock:
        first = (what, reason) not in _warned
        _warned.add((what, reason))
    if first:
        warnings.warn(f"torchport compile: a {what} was left unfused, because {reason}", RuntimeWarning, stacklevel=3)


def forget() -> None:
    """Drop the remembered verdicts and warnings (tests that change a kernel between compilations)."""
    with _lock:
        _verdicts.clear()
        _warned.clear()

