"""Dead-code elimination: nodes whose results nobody uses and whose running changes nothing else.

Also the judge, for the other passes, of which nodes have effects beyond their result (:func:`has_side_effects`).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from . import note, register_pass

__all__ = ["dead_code", "has_side_effects", "is_pure_function", "is_random", "remove_unused_attributes",
           "writes_in_place"]

# Namespaces of functions that only compute their result from their arguments (unless the checks below find an
# in-place variant, an ``out=`` or a random draw). A function from anywhere else (a user's ``torch.fx.wrap``-ed
# helper, ``torch.cuda``, the profiler, autocast entry and exit) is kept: it may print, record or switch state.
_PURE_NAMESPACES = frozenset({
    "torch", "torch.functional", "torch.nn.functional", "torch._C._nn", "torch._C._linalg", "torch._C._fft",
    "torch._C._special", "torch._C._VariableFunctions", "torch.linalg", "torch.fft", "torch.special",
    "operator", "math", "_operator",
})
_PURE_BUILTINS = frozenset({getattr, len, abs, min, max, int, float, bool, isinstance, round, pow})
_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.ilshift, operator.irshift, operator.iand, operator.ior, operator.ixor,
    operator.imatmul, operator.setitem, operator.delitem,
})
# Functions that draw from a random generator (removing one shifts every later random number, also after the graph).
_RANDOM_FUNCTIONS = frozenset(
    getattr(torch, name) for name in (
        "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "poisson",
        "bernoulli", "multinomial", "rrelu", "rrelu_", "dropout", "alpha_dropout", "feature_dropout",
        "feature_alpha_dropout", "native_dropout",
    ) if hasattr(torch, name)
) | {F.gumbel_softmax, F.fractional_max_pool2d, F.fractional_max_pool3d}
# Functions that draw random numbers only when their ``training`` argument is true.
_TRAINING_RANDOM_FUNCTIONS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                                        F.feature_alpha_dropout, F.rrelu})
_RANDOM_METHODS = frozenset({"bernoulli", "multinomial"})
# Methods with effects whose names do not end in "_": tensor methods, and those of the lists and dicts a traced
# graph may build.
_EFFECT_METHODS = frozenset({"backward", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
                             "record_stream", "__setitem__", "__delitem__", "append", "extend", "insert", "update",
                             "pop", "popitem", "clear", "setdefault", "remove"})
# Modules that draw random numbers or update their state while training.
_TRAINING_EFFECT_MODULES = (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU, torch.nn.modules.batchnorm._NormBase)


def _bound_argument(fn: Any, node: torch.fx.Node, name: str, default: Any) -> Any:
    """The value ``node`` passes to ``fn``'s parameter ``name`` (a node or a literal); ``default`` when the
    signature cannot be read."""
    try:
        bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return default
    bound.apply_defaults()
    return bound.arguments.get(name, default)


def is_random(node: torch.fx.Node) -> bool:
    """Whether running ``node`` draws from a random-number generator."""
    if "generator" in node.kwargs:
        return True
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", target)
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if target in _TRAINING_RANDOM_FUNCTIONS:
        return _bound_argument(target, node, "training", True) is not False
    return target in _RANDOM_FUNCTIONS or bool(getattr(target, "_nondeterministic_seeded", False))


def writes_in_place(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes into one of its inputs (``x.add_(1)``, ``out=``, ``inplace=True``, ``x[i] = v``)."""
    if "out" in node.kwargs:
        return True
    if node.op == "call_module":  # nn.ReLU(inplace=True)
        return bool(getattr(node.graph.owning_module.get_submodule(node.target), "inplace", False))
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):  # add_, relu_, copy_, torch.nn.init.normal_
        return True
    if node.op == "call_method":
        return name in _EFFECT_METHODS or (name.startswith("__i") and name.endswith("__"))  # __iadd__
    if node.target in _INPLACE_OPERATORS:
        return True
    if callable(node.target) and not isinstance(node.target, torch._ops.OpOverload):
        inplace = _bound_argument(node.target, node, "inplace", False)  # F.relu(x, inplace=True)
        return inplace is not False
    return False


def _module_has_effects(module: torch.nn.Module) -> bool:
    if getattr(module, "_is_impure", False) or isinstance(module, torch.fx.GraphModule):
        return True
    if not type(module).__module__.startswith("torch.nn.modules."):
        return True  # a user's module may do anything in its forward
    if getattr(module, "inplace", False):
        return True
    return module.training and isinstance(module, _TRAINING_EFFECT_MODULES)


def is_pure_function(target: Any) -> bool:
    """Whether a call_function target is known to compute only its result (torch's operators, math, operator);
    in-place variants, ``out=`` and random draws are judged per node by the other checks."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True  # Node.is_impure() reads their schema (mutation) and tags (random draws)
    if target in _PURE_BUILTINS:
        return True
    name = getattr(target, "__name__", "")
    namespace = getattr(target, "__module__", None)
    if namespace is None and getattr(torch, name, None) is target:
        namespace = "torch"
    # torch.set_default_dtype, torch.use_deterministic_algorithms, torch.manual_seed... switch global state
    return namespace in _PURE_NAMESPACES and not name.startswith(("_", "set_", "use_", "manual_seed", "seed"))


def has_side_effects(node: torch.fx.Node) -> bool:
    """Whether running ``node`` may change anything besides producing its result: it writes into a tensor
    (``add_``, ``out=``, ``inplace=True``, ``x[i] = v``), draws random numbers, switches global state (grad mode,
    autocast), calls a module or function whose body is not known to be pure, or is a placeholder or the output.

    Example:
        >>> [n.name for n in gm.graph.nodes if has_side_effects(n)]   # doctest: +SKIP
        ['x', 'add_', 'output']
    """
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "get_attr":
        return False
    if node.is_impure() or is_random(node) or writes_in_place(node):
        return True
    if node.op == "call_module":
        return _module_has_effects(node.graph.owning_module.get_submodule(node.target))
    if node.op == "call_function":
        return not is_pure_function(node.target)
    return False  # call_method: tensor methods without "_" compute a new value or a view


def _needed(name: str, used: set[str]) -> bool:
    return any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in used)


def remove_unused_attributes(gm: torch.fx.GraphModule) -> list[str]:
    """Delete the submodules, parameters, buffers and tensor attributes of ``gm`` that no node refers to; return
    their names."""
    before = {name for name, _ in gm.named_modules()}
    gm.delete_all_unused_submodules()
    gone = before - {name for name, _ in gm.named_modules()}
    removed = sorted(name for name in gone if name.rpartition(".")[0] not in gone)  # "block", not "block.fc" too
    used = {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    tensors = [name for name, _ in gm.named_parameters(remove_duplicate=False)]
    tensors += [name for name, _ in gm.named_buffers(remove_duplicate=False)]
    # tensors set as plain attributes of the graph module (symbolic_trace's "_tensor_constant0")
    tensors += [name for name, value in vars(gm).items() if isinstance(value, torch.Tensor)]
    for name in tensors:
        if not _needed(name, used):
            owner, _, leaf = name.rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            if hasattr(module, leaf):
                delattr(module, leaf)
                removed.append(name)
    return removed


@register_pass("dead_code", order=10)
def dead_code(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove nodes whose results are unused and whose running has no other effect, and what only they used.

    The attributes and submodules that no node refers to any more go too.

    Pattern::

        t = torch.exp(x)            # no user               -> removed
        u = self.unused_linear(x)   # no user (nn.Linear)   -> removed, and the submodule with it
        x.add_(1)                   # no user, writes into x -> kept
        torch.randn(3)              # no user, draws random numbers -> kept (later random numbers would change)
        return x * 2

    Kept whatever their users: placeholders (the graph's signature), in-place methods and operators, ``out=``
    and ``inplace=True`` calls, random draws (also dropout in training), grad-mode and autocast switches,
    asserts, calls of user modules and of functions outside torch's pure namespaces, and torch.nn modules that
    update state while training (batch norm, dropout).
    """
    removed = 0
    for node in reversed(list(gm.graph.nodes)):  # users come after their inputs: one sweep removes whole chains
        if not node.users and not has_side_effects(node):
            gm.graph.erase_node(node)
            removed += 1
    attributes = remove_unused_attributes(gm)
    if removed:
        note(f"removed {removed} unused node{'s' if removed != 1 else ''}")
    if attributes:
        note(f"removed unused attributes {', '.join(attributes)}")
    return gm
