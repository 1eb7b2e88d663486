"""torchport kernels as ``torch.library`` custom ops in the ``torchport`` namespace, for compiled graphs.

AOTAutograd and Inductor trace a graph with FakeTensors, so a Python kernel that launches Triton or picks an
implementation at run time cannot sit in a compiled graph as it is. As a custom op it can: its fake implementation
gives the output's shape, dtype and strides to the tracer; its real implementation calls the kernel through
:mod:`torchport.kernels.registry` at run time, so the per-device choice (Triton on CUDA, the fused operator on
Ascend, the reference elsewhere) still happens per call. The compile passes of :mod:`torchport.compile.passes`
rewrite plain-PyTorch subgraphs into calls of these ops, and under ``torch.compile`` the public functions of
:mod:`torchport.kernels` call them (:func:`torchport.kernels.registry.custom_op`), so patched models compile with
no graph break.

=====================================================  ===============================================  ==========
op                                                     computes                                         backward
=====================================================  ===============================================  ==========
``rms_norm(x, weight, eps, offset)``                   :func:`torchport.kernels.rms_norm`               recompute
``layer_norm(x, weight, bias, eps)``                   :func:`torchport.kernels.layer_norm`             recompute
``swiglu(gate, up)`` / ``geglu(gate, up)``             :func:`~torchport.kernels.swiglu` / ``geglu``    recompute
``rope(q, k, cos, sin) -> (q, k)``                     :func:`torchport.kernels.rope`                   rotation
``cross_entropy(logits, target, ignore_index,          :func:`torchport.kernels.cross_entropy`, the     recompute
label_smoothing, reduction, z_loss=0.0)``              loss in float32 (float64 for float64 logits)
``fused_linear_cross_entropy(hidden, weight, target,   :func:`torchport.kernels.fused_linear_cross_     recompute
bias, ignore_index, label_smoothing, reduction,        entropy` (``divisor``: ``num_items_in_batch``),
divisor, z_loss, softcap)``                            the loss in float32 (float64 for float64)
=====================================================  ===============================================  ==========

Backward:

* *recompute*: ``torchport::<op>_backward`` runs the kernel's forward again on detached copies of the saved inputs,
  with autograd, and differentiates it. The kernel's own backward runs (Triton's fused backward on CUDA, the vendor
  operator's on Ascend, autograd through the reference elsewhere), chosen per device at run time like the forward,
  for the price of one more forward: RMSNorm moves 7·M·N·s bytes instead of the fused kernels' 5·M·N·s (read x,
  write y again), a GLU 11·n·s instead of 8·n·s.
* ``rope`` is linear in q and k: its gradient is the same rotation with the sine's halves exchanged and negated,
  so ``torchport::rope_backward`` runs the rope kernel itself, once (cos and sin get gradients too, in plain
  PyTorch, when they need them).
* ``fused_linear_cross_entropy``'s backward runs the op again with autograd on the saved hidden states and weight
  (its forward computes the gradients in its two passes), so a compiled graph pays its forward twice; the eager
  path pays it once.
* ``cross_entropy``'s backward differentiates the summed loss with an upstream gradient of exactly 1 and scales the
  result in float32 afterwards (by the upstream gradient, divided by the kept rows for a mean), so a bfloat16 kernel
  never sees a rounded 1/num_items. The forward rounds each row's loss to the logits' dtype and sums in float32.

Importing this module registers the ops; ``import torchport`` does not import it.

Example:
    >>> from torchport.kernels import library
    >>> y = torch.ops.torchport.rms_norm(x, weight, 1e-6, 0.0)
    >>> torch.compile(lambda x, w: torch.ops.torchport.rms_norm(x, w, 1e-6, 0.0), fullgraph=True)(x, weight)
"""

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from .checks import widen
from .registry import list_specs
from .cross_entropy import REDUCTIONS, cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .glu import geglu, swiglu
from .layer_norm import layer_norm
from .rms_norm import rms_norm
from .rope import rope

__all__ = ["OPS", "autograd_enabled"]

# The ops with a custom op (``torch.ops.torchport.<name>``, its schema from the op's spec), and their backwards.
_FORWARD = tuple(name for name, spec in list_specs().items() if spec.custom_op is not None)
OPS = (*_FORWARD, *(f"{name}_backward" for name in _FORWARD))


def _schema(name: str) -> str:
    return list_specs()[name].custom_op  # type: ignore[return-value]  # one of _FORWARD


def _keys_excluded_below_autograd() -> torch._C.DispatchKeySet:
    """The keys the dispatcher excludes below autograd, found from an empty exclusion set: this module may be
    imported where some are excluded already (inside a compiler call or a custom op), and a difference taken there
    would miss them."""
    current = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), current - current), \
            torch._C._AutoDispatchBelowAutograd():
        return torch._C._dispatch_tls_local_exclude_set()


_AUTOGRAD_KEYS = _keys_excluded_below_autograd()


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Autograd recording inside a custom op's implementation, which the dispatcher runs below autograd.

    The recompute backward needs it: the kernel's forward must record a graph for ``torch.autograd.grad``. The
    dispatcher's other exclusions (autocast) stay as they are.
    """
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _fresh(out: torch.Tensor, like: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out`` with the strides ``torch.empty_like(like)`` has (what the fake implementation promises the
    compiler) and sharing memory with none of ``inputs`` (a custom op's output may not alias its inputs).

    Copies only when needed: the references follow their input's layout, the Triton kernels write contiguous rows.
    """
    layout = torch.empty_like(like, dtype=out.dtype, device="meta")
    storage = out.untyped_storage().data_ptr()
    aliased = out.numel() > 0 and any(storage == t.untyped_storage().data_ptr() for t in inputs)
    if out.stride() == layout.stride() and not aliased:
        return out
    copy = torch.empty_like(like, dtype=out.dtype)
    copy.copy_(out)
    return copy


def _vjp(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
         grad: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``fn(*inputs)`` with respect to every input, for the upstream gradient ``grad``: the kernel's
    forward runs again on detached inputs and its own backward differentiates it."""
    with autograd_enabled():
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
        found = torch.autograd.grad(out, leaves, grad.to(out.dtype), allow_unused=True)
    return [torch.zeros_like(t) if g is None else _fresh(g, t, (grad, *inputs)) for g, t in zip(found, inputs)]


# --- rms_norm -------------------------------------------------------------------------------------------------------

@torch.library.custom_op("torchport::rms_norm", mutates_args=(), schema=_schema("rms_norm"))
def _rms_norm(x, weight, eps, offset):
    return _fresh(rms_norm(x.detach(), weight.detach(), eps, offset), x, (x, weight))


@_rms_norm.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x)


@torch.library.custom_op("torchport::rms_norm_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor x, Tensor weight, float eps, float offset) -> (Tensor, Tensor)")
def _rms_norm_backward(grad, x, weight, eps, offset):
    dx, dw = _vjp(lambda a, b: rms_norm(a, b, eps, offset), (x, weight), grad)
    return dx, dw


@_rms_norm_backward.register_fake
def _(grad, x, weight, eps, offset):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, ctx.eps, ctx.offset = inputs
    ctx.save_for_backward(x, weight)


def _rms_norm_grad(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = torch.ops.torchport.rms_norm_backward(grad, x, weight, ctx.eps, ctx.offset)
    return dx, dw, None, None


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# --- layer_norm -----------------------------------------------------------------------------------------------------

@torch.library.custom_op("torchport::layer_norm", mutates_args=(), schema=_schema("layer_norm"))
def _layer_norm(x, weight, bias, eps):
    weight, bias = (None if t is None else t.detach() for t in (weight, bias))
    return _fresh(layer_norm(x.detach(), weight, bias, eps), x, [t for t in (x, weight, bias) if t is not None])


@_layer_norm.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x)


@torch.library.custom_op("torchport::layer_norm_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor x, Tensor? weight, Tensor? bias, float eps) "
                                "-> (Tensor, Tensor, Tensor)")
def _layer_norm_backward(grad, x, weight, bias, eps):
    present = [t for t in (weight, bias) if t is not None]
    has_weight = weight is not None

    def fn(x, *affine):
        w = affine[0] if has_weight else None
        b = affine[-1] if bias is not None else None
        return layer_norm(x, w, b, eps)

    found = iter(_vjp(fn, (x, *present), grad))
    dx = next(found)
    # a custom op returns tensors, never None: a missing weight or bias gets an empty gradient, dropped below
    dw = next(found) if has_weight else x.new_empty(0)
    db = next(found) if bias is not None else x.new_empty(0)
    return dx, dw, db


@_layer_norm_backward.register_fake
def _(grad, x, weight, bias, eps):
    return (torch.empty_like(x), x.new_empty(0) if weight is None else torch.empty_like(weight),
            x.new_empty(0) if bias is None else torch.empty_like(bias))


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, ctx.eps = inputs
    ctx.save_for_backward(x, weight, bias)


def _layer_norm_grad(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.torchport.layer_norm_backward(grad, x, weight, bias, ctx.eps)
    return dx, None if weight is None else dw, None if bias is None else db, None


_layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


# --- swiglu, geglu --------------------------------------------------------------------------------------------------

def _gated(name: str, kernel: Callable[..., torch.Tensor]) -> None:
    @torch.library.custom_op(f"torchport::{name}", mutates_args=(), schema=_schema(name))
    def forward(gate, up):
        return _fresh(kernel(gate.detach(), up.detach()), gate, (gate, up))

    @forward.register_fake
    def _(gate, up):
        return torch.empty_like(gate)

    @torch.library.custom_op(f"torchport::{name}_backward", mutates_args=(),
                             schema="(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)")
    def backward(grad, gate, up):
        dgate, dup = _vjp(kernel, (gate, up), grad)
        return dgate, dup

    @backward.register_fake
    def _(grad, gate, up):
        return torch.empty_like(gate), torch.empty_like(up)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def grad_fn(ctx, grad):
        gate, up = ctx.saved_tensors
        return getattr(torch.ops.torchport, f"{name}_backward")(grad, gate, up)

    forward.register_autograd(grad_fn, setup_context=setup)


_gated("swiglu", swiglu)
_gated("geglu", geglu)


# --- rope -----------------------------------------------------------------------------------------------------------

@torch.library.custom_op("torchport::rope", mutates_args=(), schema=_schema("rope"))
def _rope(q, k, cos, sin):
    q_out, k_out = rope(q.detach(), k.detach(), cos.detach(), sin.detach())
    inputs = (q, k, cos, sin)
    return _fresh(q_out, q, inputs), _fresh(k_out, k, inputs)


@_rope.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("torchport::rope_backward", mutates_args=(),
                         schema="(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin) -> (Tensor, Tensor)")
def _rope_backward(grad_q, grad_k, cos, sin):
    # out = x·cos + rotate_half(x)·sin is linear in x; its transpose is the same rotation by
    # sin' = -(sin's halves exchanged): g1 = d1·c1 + d2·s2, g2 = d2·c2 - d1·s1.
    half = sin.shape[-1] // 2
    sin_t = -torch.cat((sin[..., half:], sin[..., :half]), dim=-1)
    gq, gk = rope(grad_q.detach(), grad_k.detach(), cos.detach(), sin_t)
    inputs = (grad_q, grad_k, cos, sin)
    return _fresh(gq, grad_q, inputs), _fresh(gk, grad_k, inputs)


@_rope_backward.register_fake
def _(grad_q, grad_k, cos, sin):
    return torch.empty_like(grad_q), torch.empty_like(grad_k)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_setup(ctx, inputs, output):
    q, k, cos, sin = inputs
    table_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    # q and k are needed only for the (rare) gradient of cos and sin
    ctx.save_for_backward(q if table_grad else None, k if table_grad else None, cos, sin)


def _table_grad(parts: Sequence[torch.Tensor], table: torch.Tensor) -> torch.Tensor:
    """Sum of ``[B, H, S, D]`` products over heads, and over the batch where ``table`` broadcasts it."""
    total = sum(p.sum(1) for p in parts)
    if table.dim() == 2:
        total = total.sum(0)
    elif table.shape[0] == 1 and total.shape[0] != 1:
        total = total.sum(0, keepdim=True)
    return total.to(table.dtype)


def _rope_grad(ctx, dq, dk):
    q, k, cos, sin = ctx.saved_tensors
    gq, gk = torch.ops.torchport.rope_backward(dq, dk, cos, sin)
    dcos = dsin = None
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        dq32, dk32 = widen(dq), widen(dk)
        q32, k32 = widen(q), widen(k)
        dcos = _table_grad((dq32 * q32, dk32 * k32), cos)
        dsin = _table_grad((dq32 * _rotate_half(q32), dk32 * _rotate_half(k32)), sin)
    return gq, gk, dcos, dsin


_rope.register_autograd(_rope_grad, setup_context=_rope_setup)


# --- cross_entropy --------------------------------------------------------------------------------------------------

def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"torchport::cross_entropy: reduction={reduction!r}; allowed: "
                         f"{', '.join(map(repr, REDUCTIONS))}")


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@torch.library.custom_op("torchport::cross_entropy", mutates_args=(), schema=_schema("cross_entropy"))
def _cross_entropy(logits, target, ignore_index, label_smoothing, reduction, z_loss=0.0):
    _check_reduction(reduction)
    # Per-row losses in the logits' dtype, summed here in float32: one rounding per row, none of the sum.
    rows = cross_entropy(logits.detach(), target, ignore_index, label_smoothing, "none",
                         z_loss=z_loss).to(_loss_dtype(logits))
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "mean":
        total = total / (target != ignore_index).sum().clamp_min(1)
    return total


@_cross_entropy.register_fake
def _(logits, target, ignore_index, label_smoothing, reduction, z_loss=0.0):
    _check_reduction(reduction)
    shape = target.shape if reduction == "none" else ()
    return logits.new_empty(shape, dtype=_loss_dtype(logits))


@torch.library.custom_op(
    "torchport::cross_entropy_backward", mutates_args=(),
    schema="(Tensor grad, Tensor logits, Tensor target, int ignore_index, float label_smoothing, str reduction, "
           "float z_loss=0.0) -> Tensor",
)
def _cross_entropy_backward(grad, logits, target, ignore_index, label_smoothing, reduction, z_loss=0.0):
    _check_reduction(reduction)
    ones = torch.ones((), dtype=logits.dtype, device=logits.device)
    (dlogits,) = _vjp(lambda x: cross_entropy(x, target, ignore_index, label_smoothing, "sum", z_loss=z_loss),
                      (logits,), ones)
    if reduction == "none":
        scale = grad.unsqueeze(-1)
    elif reduction == "mean":
        scale = grad / (target != ignore_index).sum().clamp_min(1)
    else:
        scale = grad
    return dlogits.mul_(scale)  # in float32 (opmath), rounded once to the logits' dtype


@_cross_entropy_backward.register_fake
def _(grad, logits, target, ignore_index, label_smoothing, reduction, z_loss=0.0):
    return torch.empty_like(logits)


def _cross_entropy_setup(ctx, inputs, output):
    logits, target, ctx.ignore_index, ctx.label_smoothing, ctx.reduction, ctx.z_loss = inputs
    ctx.save_for_backward(logits, target)


def _cross_entropy_grad(ctx, grad):
    logits, target = ctx.saved_tensors
    dlogits = torch.ops.torchport.cross_entropy_backward(grad, logits, target, ctx.ignore_index,
                                                         ctx.label_smoothing, ctx.reduction, ctx.z_loss)
    return dlogits, None, None, None, None, None


_cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


# --- fused_linear_cross_entropy -------------------------------------------------------------------------------------

def _linear_loss(target, bias, ignore_index, label_smoothing, reduction, divisor, z_loss, softcap, loss_dtype):
    """``fused_linear_cross_entropy`` of ``(hidden, weight[, bias])`` with the other arguments fixed."""
    def loss(hidden, weight, *with_bias):
        return fused_linear_cross_entropy(hidden, weight, target, with_bias[0] if with_bias else bias, ignore_index,
                                          label_smoothing, reduction, num_items_in_batch=divisor, z_loss=z_loss,
                                          softcap=softcap, loss_dtype=loss_dtype)

    return loss


@torch.library.custom_op("torchport::fused_linear_cross_entropy", mutates_args=(),
                         schema=_schema("fused_linear_cross_entropy"))
def _fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor,
                                z_loss, softcap):
    _check_reduction(reduction)
    fn = _linear_loss(target, None if bias is None else bias.detach(), ignore_index, label_smoothing, reduction,
                      divisor, z_loss, softcap, _loss_dtype(hidden))
    return fn(hidden.detach(), weight.detach())


@_fused_linear_cross_entropy.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor, z_loss, softcap):
    _check_reduction(reduction)
    return hidden.new_empty(target.shape if reduction == "none" else (), dtype=_loss_dtype(hidden))


@torch.library.custom_op(
    "torchport::fused_linear_cross_entropy_backward", mutates_args=(),
    schema="(Tensor grad, Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index, "
           "float label_smoothing, str reduction, float? divisor, float z_loss, float? softcap) "
           "-> (Tensor, Tensor, Tensor)",
)
def _fused_linear_cross_entropy_backward(grad, hidden, weight, target, bias, ignore_index, label_smoothing,
                                         reduction, divisor, z_loss, softcap):
    fn = _linear_loss(target, None, ignore_index, label_smoothing, reduction, divisor, z_loss, softcap,
                      _loss_dtype(hidden))
    inputs = (hidden, weight) if bias is None else (hidden, weight, bias)
    grads = _vjp(fn, inputs, grad)
    # a custom op returns tensors, never None: no bias gives an empty gradient, dropped by the autograd formula
    return grads[0], grads[1], grads[2] if bias is not None else hidden.new_empty(0)


@_fused_linear_cross_entropy_backward.register_fake
def _(grad, hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor, z_loss, softcap):
    return torch.empty_like(hidden), torch.empty_like(weight), \
        torch.empty_like(bias) if bias is not None else hidden.new_empty(0)


def _fused_linear_cross_entropy_setup(ctx, inputs, output):
    hidden, weight, target, bias, *ctx.options = inputs
    ctx.save_for_backward(hidden, weight, target, bias)


def _fused_linear_cross_entropy_grad(ctx, grad):
    hidden, weight, target, bias = ctx.saved_tensors
    dh, dw, db = torch.ops.torchport.fused_linear_cross_entropy_backward(grad, hidden, weight, target, bias,
                                                                         *ctx.options)
    return dh, dw, None, None if bias is None else db, *(None,) * len(ctx.options)


_fused_linear_cross_entropy.register_autograd(_fused_linear_cross_entropy_grad,
                                              setup_context=_fused_linear_cross_entropy_setup)


_missing = [name for name in _FORWARD if not hasattr(torch.ops.torchport, name)]
if _missing:  # a spec names a schema this module has no implementation for
    raise RuntimeError(f"torchport.kernels.library: the specs of {', '.join(_missing)} name a custom op, and this "
                       "module registers none for them; add their forward, fake and backward here")
