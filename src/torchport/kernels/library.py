"""torchport kernels as ``torch.library`` custom ops in the ``torchport`` namespace, for compiled graphs.

AOTAutograd and Inductor trace a graph with FakeTensors, so a Python kernel that launches Triton or picks an
implementation at run time cannot sit in a compiled graph as it is. As a custom op it can: its fake implementation
gives the output's shape, dtype and strides to the tracer; its real implementation calls the kernel through
:mod:`torchport.kernels.registry` at run time, so the per-device choice (Triton on CUDA, the fused operator on
Ascend, the reference elsewhere) still happens per call. The compile passes of :mod:`torchport.compile.passes`
rewrite plain-PyTorch subgraphs into calls of these ops, and under ``torch.compile`` the public functions of
:mod:`torchport.kernels` call them (:func:`torchport.kernels.registry.custom_op`), so patched models compile with
no graph break.

Every op is registered here from its :class:`~torchport.kernels.spec.CustomOp` (``custom_op=`` in its spec, in
``kernels/<op>.py``): the forward, its fake implementation, ``torchport::<op>_backward`` with its fake, and the
autograd formula that calls it. An op that declares only a schema gets the defaults: outputs shaped like the first
argument, and the *recompute* backward. The backward's schema is the forward's arguments (every tensor optional:
what the backward does not need is not saved) after ``Tensor[] grads`` (one per output) and ``bool[] needs`` (which
tensor arguments want a gradient), and it returns one tensor per tensor argument, empty where none is wanted.

Backward, chosen per call like the forward:

* the implementation's own (``register_kernel(..., backward=...)``, run by
  :func:`torchport.kernels.registry.call_backward`): the Triton norms and GLUs launch their backward kernels on the
  saved inputs, recomputing what their eager forward keeps (a norm's per-row statistics, in the kernel that reads
  x anyway), so a compiled graph moves what the eager path moves.
* *recompute*, for an implementation without one (or arguments it refuses): ``torchport::<op>_backward`` runs the
  kernel's forward again on detached copies of the saved inputs, with autograd, and differentiates it: the vendor
  operator's backward on Ascend, autograd through the reference elsewhere, for the price of one more forward
  (RMSNorm moves 7·M·N·s bytes instead of 5·M·N·s, a GLU 11·n·s instead of 8·n·s).
* an op's own (``CustomOp.backward``, next to the op): ``rope`` runs its kernel once with the transposed rotation;
  ``cross_entropy`` scales the gradient of the summed loss in float32; ``fused_linear_cross_entropy`` runs its
  two-pass forward again with autograd (a compiled graph pays its forward twice, the eager path once). The losses'
  custom ops return the loss in float32 (float64 for float64 inputs), summed from per-row losses.

``python -c "import torch, torchport.kernels.library as l; print(*(getattr(torch.ops.torchport, o).default._schema
for o in l.OPS), sep=chr(10))"`` prints every op's schema.

Importing this module registers the ops; ``import torchport`` does not import it.

Example:
    >>> from torchport.kernels import library
    >>> y = torch.ops.torchport.rms_norm(x, weight, 1e-6, 0.0)
    >>> torch.compile(lambda x, w: torch.ops.torchport.rms_norm(x, w, 1e-6, 0.0), fullgraph=True)(x, weight)
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._autograd import autograd_enabled, fresh, vjp
from .registry import call_backward, list_specs
from .spec import CustomOp, OpSpec

__all__ = ["IMPLEMENTATIONS", "OPS", "autograd_enabled", "ensure"]

# What each forward computes on detached inputs, looked up per call (tests put a wrong kernel here to check that the
# compile passes refuse it).
IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}
_vjp = vjp  # the recompute backward's differentiation, looked up per call
_lock = threading.Lock()


def ensure(spec: OpSpec) -> None:
    """Register ``torch.ops.torchport.<name>`` and its backward from ``spec`` unless done: the ops known when this
    module is imported are registered then, an op registered later (a plugin's) by
    :func:`torchport.kernels.registry.register_op`, so a compiled call never registers anything."""
    with _lock:
        if spec.name in IMPLEMENTATIONS or spec.custom_op is None:
            return
        _register(spec)
        IMPLEMENTATIONS[spec.name] = spec.custom_op.forward or spec.call  # type: ignore[union-attr]


def _arguments(schema: str) -> list[str]:
    """The argument declarations of ``schema`` (``"(Tensor x, float eps) -> Tensor"``), as written."""
    inner = schema[schema.index("(") + 1:schema.rindex(") ->")]
    return [part.strip() for part in inner.split(",") if part.strip()]


def _backward_schema(forward: str) -> str:
    optional = [f"Tensor? {arg.split(None, 1)[1]}" if arg.split(None, 1)[0] == "Tensor" else arg
                for arg in _arguments(forward)]
    return f"(Tensor[] grads, bool[] needs, {', '.join(optional)}) -> Tensor[]"


def _tensor_positions(name: str, schema: str) -> tuple[int, ...]:
    parsed = torch._C.parse_schema(f"torchport::{name}{schema}")
    return tuple(i for i, arg in enumerate(parsed.arguments)
                 if str(arg.type) in ("Tensor", "Optional[Tensor]"))


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _register(spec: OpSpec) -> None:
    name, op = spec.name, spec.custom_op
    assert isinstance(op, CustomOp)
    positions = _tensor_positions(name, op.schema)
    returns = len(torch._C.parse_schema(f"torchport::{name}{op.schema}").returns)
    results = returns - len(positions) if op.precomputed else returns  # the outputs with an upstream gradient
    schema_tensors = [torch._C.parse_schema(f"torchport::{name}{op.schema}").arguments[i] for i in positions]

    def tensors(args: Sequence[Any]) -> list[torch.Tensor | None]:
        return [args[i] for i in positions]

    def forward(*args):
        detached = [a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
        out = IMPLEMENTATIONS[name](*detached)
        if op.like is None:
            return out
        inputs = tensors(args)
        made = tuple(fresh(o, args[i], inputs) for o, i in zip(_outputs(out), op.like))
        return made if returns > 1 else made[0]

    def fake(*args):
        if op.fake is not None:
            return op.fake(*args)
        made = tuple(torch.empty_like(args[i]) for i in op.like)  # type: ignore[union-attr]
        return made if returns > 1 else made[0]

    def backward(grads, needs, *args):
        inputs = tensors(args)
        if op.backward is not None:
            found = op.backward(tuple(grads), tuple(needs), *args)
        else:
            found = call_backward(name, grads[0].device, tuple(grads), tuple(needs), *args)
        if found is None:
            def recompute(*leaves):
                full = list(args)
                for i, leaf in zip(positions, leaves):
                    full[i] = leaf
                return IMPLEMENTATIONS[name](*full)

            found = _vjp(recompute, inputs, grads, needs)
        found = list(found)
        if len(found) != len(positions):
            raise RuntimeError(f"torchport::{name}_backward returned {len(found)} gradients for "
                               f"{len(positions)} tensor arguments")
        # a custom op returns tensors, never None: an empty one stands for no gradient
        return [grads[0].new_empty(0) if g is None or not need else fresh(g, g if t is None else t, (*grads, *inputs))
                for g, need, t in zip(found, needs, inputs)]

    def backward_fake(grads, needs, *args):
        # an argument the backward did not keep (None) has its output's shape: rope's q and k
        return [grads[0].new_empty(0) if not need else torch.empty_like(grads[i] if t is None else t)
                for i, (need, t) in enumerate(zip(needs, tensors(args)))]

    forward_op = torch.library.custom_op(f"torchport::{name}", forward, mutates_args=(), schema=op.schema)
    forward_op.register_fake(fake)
    backward_op = torch.library.custom_op(f"torchport::{name}_backward", backward, mutates_args=(),
                                          schema=_backward_schema(op.schema))
    backward_op.register_fake(backward_fake)

    def setup(ctx, inputs, output):
        needs = tuple(ctx.needs_input_grad[i] for i in positions)
        keep = op.saved(needs) if op.saved is not None else (True,) * len(positions)
        kept = [t if k else None for t, k in zip(tensors(inputs), keep)]
        ctx.precomputed = False
        if op.precomputed:  # the gradients are outputs that nothing differentiates
            ctx.mark_non_differentiable(*output[results:])
            ctx.precomputed = any(g.numel() for g in output[results:])
        if ctx.precomputed:  # they are all the backward needs
            kept = list(output[results:])
            missing = [str(arg.name) for need, g, arg in zip(needs, kept, schema_tensors) if need and not g.numel()]
            if missing:
                raise ValueError(f"torchport::{name}: a gradient is needed for {', '.join(missing)}, which the "
                                 "forward was not asked to compute; ask for every tensor that requires a gradient")
            ctx.set_materialize_grads(False)
        ctx.save_for_backward(*kept)
        ctx.arguments = [None if i in positions else a for i, a in enumerate(inputs)]
        ctx.needs = list(needs)

    def gradient(ctx, *grads):
        result: list[torch.Tensor | None] = [None] * len(ctx.arguments)
        if ctx.precomputed:
            upstream = grads[0]
            for i, g, need in zip(positions, ctx.saved_tensors, ctx.needs):
                if need and upstream is not None and g.numel():  # multiplied in float32, rounded once
                    result[i] = g * upstream if g.dtype == upstream.dtype else (g.to(upstream.dtype) * upstream).to(
                        g.dtype)
            return tuple(result)
        args = list(ctx.arguments)
        for i, t in zip(positions, ctx.saved_tensors):
            args[i] = t
        found = backward_op(list(grads[:results]), ctx.needs, *args)
        for i, g, need in zip(positions, found, ctx.needs):
            result[i] = g if need else None
        return tuple(result)

    forward_op.register_autograd(gradient, setup_context=setup)


for _spec in list_specs().values():
    ensure(_spec)
# The ops with a custom op (``torch.ops.torchport.<name>``) when this module was imported, and their backwards.
OPS = (*IMPLEMENTATIONS, *(f"{name}_backward" for name in IMPLEMENTATIONS))
