"""Constant folding: subgraphs that depend on no input and no parameter are computed once, at compile time.

Also what the other passes know about a node's result before it runs (:func:`known_value`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from . import note, register_pass
from .dead_code import has_side_effects

__all__ = ["MAX_FOLDED_BYTES", "add_constant", "constant_fold", "declare_constants", "known_value"]

#: Largest tensor a fold may create (64 MiB). A larger result (a causal mask over a long context, say) costs less
#: to compute on every call than to keep in memory; its inputs stay as they are.
MAX_FOLDED_BYTES = 64 * 2**20

# Calls that make a tensor from literals alone: the roots of foldable subgraphs besides buffers. torch.empty and
# the random factories are left out: their values are not defined by their arguments.
_FACTORIES = frozenset(
    getattr(torch, name) for name in (
        "arange", "ones", "zeros", "full", "eye", "linspace", "logspace", "tensor", "as_tensor", "scalar_tensor",
        "tril_indices", "triu_indices",
    )
)


def known_value(node: torch.fx.Node) -> torch.Tensor | None:
    """A tensor with the shape, dtype, strides and device ``node``'s result will have, from what tracing recorded
    (dynamo's ``example_value``, ``val``, or ``ShapeProp``'s ``tensor_meta``, whose device reads ``meta``); None
    when the node's result is not a tensor or was not recorded. Shapes may hold symbolic sizes."""
    for key in ("example_value", "val"):
        value = node.meta.get(key)
        if isinstance(value, torch.Tensor):
            return value
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "stride"):
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
    return None


def _attribute(gm: torch.fx.GraphModule, target: str) -> Any:
    owner, _, leaf = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, leaf)


def _candidates(gm: torch.fx.GraphModule, blocked: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes whose values follow from constants alone, judged from the graph's structure."""
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    found: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node in blocked:
            continue
        if node.op == "get_attr":
            value = _attribute(gm, node.target)
            # parameters change while training; buffers of a called module (batch-norm statistics) change when
            # it runs
            if (isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
                    and not value.requires_grad and not any(node.target.startswith(m + ".") for m in called)):
                found.add(node)
        elif node.op in ("call_function", "call_method") and not has_side_effects(node):
            inputs = node.all_input_nodes
            if node.kwargs.get("requires_grad") is True:
                continue
            if inputs and all(n in found for n in inputs):
                found.add(node)
            elif not inputs and node.op == "call_function" and node.target in _FACTORIES:
                found.add(node)
    return found


def _mutated(gm: torch.fx.GraphModule, candidates: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Candidates that a node with side effects may write into, with every candidate they were computed from
    (a view shares its base's memory)."""
    hit: set[torch.fx.Node] = set()
    stack = [n for node in gm.graph.nodes if node.op != "output" and has_side_effects(node)
             for n in node.all_input_nodes if n in candidates]
    while stack:
        node = stack.pop()
        if node not in hit:
            hit.add(node)
            stack.extend(n for n in node.all_input_nodes if n in candidates)
    return hit


def _too_large(value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    if not all(isinstance(size, int) for size in value.shape):
        return True  # a symbolic size: its bound is unknown (and reading it would add a guard)
    count = 1
    for size in value.shape:
        count *= size
    return count * value.element_size() > MAX_FOLDED_BYTES


def _agrees(value: Any, expected: torch.Tensor | None) -> bool:
    """Whether a value computed now matches what tracing recorded (an autocast region, for one, would not)."""
    if expected is None:
        return True
    if not isinstance(value, torch.Tensor) or value.dtype != expected.dtype or value.dim() != expected.dim():
        return False
    if expected.device.type != "meta" and value.device.type != expected.device.type:
        return False
    return all(not isinstance(e, int) or v == e for v, e in zip(value.shape, expected.shape))


def _evaluate(gm: torch.fx.GraphModule, candidates: set[torch.fx.Node]) -> dict[torch.fx.Node, Any]:
    values: dict[torch.fx.Node, Any] = {}
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node not in candidates or any(n not in values for n in node.all_input_nodes):
                continue
            if node.op == "get_attr":
                values[node] = _attribute(gm, node.target)
                continue
            expected = known_value(node)
            if _too_large(expected):
                continue
            args = torch.fx.node.map_arg(node.args, lambda n: values[n])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: values[n])
            try:
                if node.op == "call_function":
                    value = node.target(*args, **kwargs)
                else:
                    value = getattr(args[0], node.target)(*args[1:], **kwargs)
            except Exception:  # noqa: BLE001 - what fails now runs at run time, as it did before
                continue
            if not _too_large(value) and _agrees(value, expected):
                values[node] = value
    return values


def declare_constants(gm: torch.fx.GraphModule, names: list[str]) -> None:
    """Tell a dynamo graph that the tensors ``names`` (added by a pass) are constants: AOTAutograd, under
    Inductor, requires a source for every parameter and buffer of a graph dynamo captured."""
    sources = getattr(gm, "_param_name_to_source", None)
    if isinstance(sources, dict):
        from torch._dynamo.source import ConstantSource

        for name in names:
            sources[name] = ConstantSource(name)


def add_constant(gm: torch.fx.GraphModule, stem: str, value: torch.Tensor) -> str:
    """Store ``value`` in ``gm`` as a non-persistent buffer named ``<stem>_<n>`` (the first free ``n``) and return
    the name, for a get_attr node.

    Example:
        >>> name = add_constant(gm, "_folded_constant", torch.arange(4.0))   # doctest: +SKIP
        >>> node = gm.graph.get_attr(name)                                    # doctest: +SKIP
    """
    index = 0
    while hasattr(gm, f"{stem}_{index}"):
        index += 1
    name = f"{stem}_{index}"
    gm.register_buffer(name, value.detach(), persistent=False)
    declare_constants(gm, [name])
    return name


@register_pass("constant_fold", order=20)
def constant_fold(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Compute subgraphs whose inputs are all constants once, at compile time, and read their results instead.

    The results are kept as buffers of the graph module.

    Pattern (a rotary embedding's frequencies and positions)::

        inv_freq = self.inv_freq                      # get_attr of a buffer, not a parameter, never written
        pos = torch.arange(8, device="cpu").float()   # factory call of literals
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), -1)
        return x * emb.cos()
    ->
        return x * self._folded_constant_0            # emb.cos(), computed once

    Constants are buffers and plain tensor attributes read with get_attr (not parameters, which change while
    training, nor buffers of modules the graph calls, which they may update), literals, and factory calls
    (``torch.arange``, ``ones``, ``zeros``, ``full``, ``eye``, ``linspace``, ``tensor``...) without
    ``requires_grad=True``. Not folded: anything that depends on a placeholder (when dynamo lifts parameters and
    buffers into placeholders, only factory subgraphs remain foldable), random draws, calls with side effects,
    constants some node writes into, results larger than :data:`MAX_FOLDED_BYTES`, results whose dtype, shape
    or device differ from what tracing recorded, and graph outputs (the last step before an output still runs, so
    that each call returns a new tensor). A fold assumes buffers keep their values between calls, as
    a buffer that is only read does.
    """
    blocked: set[torch.fx.Node] = set()
    while True:  # blocking a written constant can only shrink the candidates: this ends
        candidates = _candidates(gm, blocked)
        mutated = _mutated(gm, candidates)
        if not mutated:
            break
        blocked |= mutated
    values = _evaluate(gm, candidates)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in output.all_input_nodes:
        if node.op != "get_attr":
            values.pop(node, None)  # a graph output must be a fresh tensor: a caller may write into it
    names_by_id = {id(values[n]): n.target for n in values if n.op == "get_attr"}
    folded: list[str] = []
    replaced = 0
    for node in list(gm.graph.nodes):
        if node not in values or node.op == "get_attr" or not isinstance(values[node], torch.Tensor):
            continue
        if all(user in values for user in node.users):
            continue  # only other constants use it: the fold happens at the subgraph's end
        value = values[node]
        name = names_by_id.get(id(value))  # x.float() of a float buffer is the buffer itself
        if name is None:
            name = add_constant(gm, "_folded_constant", value)
            names_by_id[id(value)] = name
            folded.append(name)
        with gm.graph.inserting_before(node):
            replacement = gm.graph.get_attr(name)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        replaced += 1
    if not replaced:
        return gm
    removed = 0
    read: set[str] = set()
    for node in reversed(list(gm.graph.nodes)):
        if node in values and not node.users:
            if node.op == "get_attr":
                read.add(node.target)
            gm.graph.erase_node(node)
            removed += 1
    still_read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for target in read - still_read:  # a buffer only the folded subgraph read (inv_freq) is no longer kept
        owner, _, leaf = target.rpartition(".")
        delattr(gm.get_submodule(owner) if owner else gm, leaf)
    into = ", ".join(folded) if folded else "tensors the graph already reads"
    note(f"folded {removed} constant node{'s' if removed != 1 else ''} into {into}")
    return gm
