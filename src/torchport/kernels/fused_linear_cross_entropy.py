"""Cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising the logits: the LM head and its loss in one.

For N tokens, hidden size H and vocabulary V, the logits are N·V values (2 GiB in bf16 for 8192 x 128256) and
the gradients must be formed from them; the op keeps at most a *workspace* of them at a time beyond its outputs and
gradients, and computes the gradients in the forward (the backward only multiplies by the upstream gradient).
:mod:`torchport.kernels.linear_ce_passes` describes and runs its two strategies, and
:mod:`torchport.kernels.linear_ce_plan` sizes them (``ROWS_WORKSPACE_BYTES``, ``MAX_ROW_CHUNKS``,
``WORKSPACE_BYTES``): chunks of whole rows, three matmuls, with ``grad_weight`` summed over at most 8 chunks within
256 MiB (``TORCHPORT_LOSS_WORKSPACE_MIB`` sets another size) where the weight's gradient is wanted, the reduction is
a mean or a sum and the inputs are not float16; otherwise two passes, four matmuls, every gradient rounded once,
within :func:`workspace_bytes` (48 MiB, or 3/4 of the hidden states' size when that is more).

``num_items_in_batch`` (Hugging Face Trainer's gradient-accumulation convention): the loss is the *sum* over the
non-ignored tokens of this micro-batch divided by ``num_items_in_batch`` — exactly
``F.cross_entropy(logits, target, reduction="sum") / num_items_in_batch`` — so micro-batch losses add up to the
mean over the whole accumulated batch.

Implementations: ``triton`` (CUDA/ROCm: the per-slice kernels in :mod:`torchport.kernels.triton.linear_ce_slices`, and
for whole rows without soft-capping the cross-entropy kernel of :mod:`torchport.kernels.triton.cross_entropy`),
``npu`` and ``chunked`` (the same strategies with the per-slice math in PyTorch; torch_npu's vocabulary-parallel
pieces, npu_fused_linear_online_max_sum and npu_fused_cross_entropy_loss_with_max_sum, are not used), and the
``reference``: the full logits, then the cross-entropy in float32.
``chunked`` serves every other device in auto mode; ``TORCHPORT_KERNELS`` can force any of them (``chunked`` on
every device, ``triton`` on CUDA, ``npu`` on Ascend).

Example:
    >>> loss = torchport.kernels.fused_linear_cross_entropy(hidden_states, lm_head.weight, labels)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import registry
from ._autograd import autograd_enabled, vjp
from .checks import capturing, check_floating, check_same_device, check_same_dtype, widen
from .cross_entropy import per_row_losses
from .loss_checks import (check_options, check_reduction, check_target_tensor, check_targets, loss_dtype_of,
                          mark_bad_targets)
from .linear_ce_passes import RESCALE_MARGIN, TORCH_MATH, linear_cross_entropy, triton_math
from .linear_ce_plan import Blocks, blocks, row_chunk, workspace_bytes
from .spec import CustomOp, OpSpec, randn, targets

__all__ = ["RESCALE_MARGIN", "Blocks", "FusedLinearCrossEntropyLoss", "blocks",
           "fused_linear_cross_entropy", "row_chunk", "workspace_bytes"]


@registry.register_kernel("fused_linear_cross_entropy", "reference")
def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                                         label_smoothing: float = 0.0, reduction: str = "mean",
                                         divisor: float | None = None, n_valid: int | None = None,
                                         z_loss: float = 0.0, softcap: float | None = None,
                                         loss_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear``, the soft-cap, then the cross-entropy in float32 (float64 for float64 inputs), on ``[N, H]``
    hidden states; a mean over no rows is 0, and ``divisor`` replaces the mean's row count."""
    logits = widen(F.linear(hidden, weight, bias))
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    rows, valid = per_row_losses(logits, target, ignore_index, label_smoothing, z_loss)
    dtype = loss_dtype or hidden.dtype
    if reduction == "none":
        return rows.to(dtype)
    total = rows.sum()
    if divisor is not None:
        total = total / divisor
    elif reduction == "mean":
        total = total / valid.sum().clamp_min(1)
    return total.to(dtype)


# On Ascend the same passes serve as the "npu" implementation (it calls no torch_npu operator; module
# docstring), so that TORCHPORT_KERNELS=npu also covers this op.
@registry.register_kernel("fused_linear_cross_entropy", "npu", devices=["npu"], priority=15)
@registry.register_kernel("fused_linear_cross_entropy", "chunked", priority=10)
def _fused_linear_cross_entropy_chunked(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                        bias: torch.Tensor | None = None, ignore_index: int = -100,
                                        label_smoothing: float = 0.0, reduction: str = "mean",
                                        divisor: float | None = None, n_valid: int | None = None,
                                        z_loss: float = 0.0, softcap: float | None = None,
                                        loss_dtype: torch.dtype | None = None) -> torch.Tensor:
    return linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor,
                                n_valid, z_loss, softcap, loss_dtype, TORCH_MATH)


@registry.register_kernel("fused_linear_cross_entropy", "triton", devices=["cuda"], priority=20)
def _fused_linear_cross_entropy_triton(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                       bias: torch.Tensor | None = None, ignore_index: int = -100,
                                       label_smoothing: float = 0.0, reduction: str = "mean",
                                       divisor: float | None = None, n_valid: int | None = None,
                                       z_loss: float = 0.0, softcap: float | None = None,
                                       loss_dtype: torch.dtype | None = None) -> torch.Tensor:
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise registry.Unsupported(f"the Triton kernels take float32, bfloat16 or float16, not {hidden.dtype}")
    return linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor,
                                n_valid, z_loss, softcap, loss_dtype, triton_math())


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean", *,
                               num_items_in_batch: int | float | torch.Tensor | None = None, z_loss: float = 0.0,
                               softcap: float | None = None, loss_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``target``, without the ``[tokens, vocab]`` logits.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` hidden states (float32, bfloat16 or float16).
        weight: ``[V, H]``, the LM head's weight, of hidden's dtype.
        target: integer class indices with hidden's leading shape.
        bias: optional ``[V]``.
        ignore_index, label_smoothing: as ``F.cross_entropy``.
        reduction: ``"mean"`` (over non-ignored tokens; 0 when all are ignored), ``"sum"`` or ``"none"``.
        num_items_in_batch: when given (Hugging Face Trainer under gradient accumulation), the loss is the sum
            over this call's tokens divided by it, whatever ``reduction`` (``"mean"`` or ``"sum"``) says. A tensor
            is read on the host (a count ≤ 0 is an error) except while torch.compile traces or a graph is
            captured, where it divides on the device and a count ≤ 0 makes the loss NaN.
        z_loss: weight of ``lse²`` added to each non-ignored token's loss (as :func:`cross_entropy`).
        softcap: when given, the logits are ``softcap · tanh(logits / softcap)`` (Gemma 2's
            ``final_logit_softcapping``), with that function's derivative in the gradients.
        loss_dtype: the dtype of the returned loss; default hidden's (as ``F.cross_entropy``). ``torch.float32``
            returns the float32 sum unrounded, as Hugging Face's causal-LM loss (which upcasts the logits) does.
            Gradients keep the inputs' dtypes.

    Returns:
        A scalar, or for ``"none"`` the per-token losses with ``target``'s shape.

    Example:
        >>> h, w = torch.randn(4, 16, 64, requires_grad=True), torch.randn(1000, 64, requires_grad=True)
        >>> loss = fused_linear_cross_entropy(h, w, torch.randint(0, 1000, (4, 16)))
        >>> loss.backward()
    """
    op = "fused_linear_cross_entropy"
    check_floating(op, hidden=hidden, weight=weight, bias=bias)
    check_same_dtype(op, hidden=hidden, weight=weight, bias=bias)
    if hidden.dim() < 2:
        raise ValueError(f"{op}: hidden must be [N, H] or [B, T, H], got shape {list(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"{op}: weight must have shape [vocab, hidden] = [V, {hidden.shape[-1]}] for hidden of shape "
            f"{list(hidden.shape)}, got weight of shape {list(weight.shape)}"
        )
    vocab = weight.shape[0]
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"{op}: bias must have shape [vocab] = [{vocab}], got {list(bias.shape)}")
    target = check_target_tensor(op, target, hidden.shape[:-1], "hidden's shape without the hidden dim")
    check_same_device(op, hidden=hidden, weight=weight, bias=bias, target=target)
    check_options(op, label_smoothing, reduction)
    if not z_loss >= 0:
        raise ValueError(f"{op}: z_loss={z_loss} must be >= 0")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"{op}: softcap={softcap!r} must be a number > 0, or None for no soft-capping")
    if loss_dtype is not None and not (isinstance(loss_dtype, torch.dtype) and loss_dtype.is_floating_point):
        raise TypeError(f"{op}: loss_dtype={loss_dtype!r} must be a floating dtype (torch.float32, ...) or None")
    divisor = count = None
    if num_items_in_batch is not None:
        if reduction == "none":
            raise ValueError(f"{op}: num_items_in_batch divides a summed loss; it cannot be used with reduction='none'")
        if isinstance(num_items_in_batch, torch.Tensor) and capturing(hidden.device):
            # No host read while torch.compile traces or a graph is captured: the summed loss is divided on the
            # device below (its gradients then take the factor with the upstream gradient), NaN unless it is > 0.
            count, reduction = num_items_in_batch, "sum"
        else:
            divisor = float(num_items_in_batch)
            if not divisor > 0:
                raise ValueError(f"{op}: num_items_in_batch must be > 0, got {num_items_in_batch}")
    rows, flat = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    flat, bad = check_targets(op, flat, vocab, ignore_index)
    softcap = None if softcap is None else float(softcap)
    if torch.compiler.is_dynamo_compiling():  # a constant to dynamo: its graph calls the custom op
        # which gradients its forward computes (with the loss, as the eager path does): known when tracing
        wanted = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (rows, weight, flat, bias)]
        loss = registry.custom_op(op)(rows, weight, flat, bias, int(ignore_index), float(label_smoothing), reduction,
                                      divisor, float(z_loss), softcap, wanted)[0]
    else:
        loss = registry.call(op, hidden.device, rows, weight, flat, bias, int(ignore_index), float(label_smoothing),
                             reduction, divisor, None, float(z_loss), softcap,
                             loss_dtype if count is None else loss_dtype_of(hidden))
    if count is not None:
        count = count.to(device=loss.device, dtype=loss.dtype)
        loss = torch.where(count > 0, loss / count, torch.full_like(loss, float("nan")))
    loss = mark_bad_targets(loss.to(loss_dtype or hidden.dtype), bad, reduction)
    return loss.view(target.shape) if reduction == "none" else loss


class FusedLinearCrossEntropyLoss(nn.Module):
    """``nn.Module`` form of :func:`fused_linear_cross_entropy`: ``forward(hidden, weight, target, bias=None)``.

    Example:
        >>> criterion = FusedLinearCrossEntropyLoss(ignore_index=-100)
        >>> loss = criterion(hidden_states, model.lm_head.weight, labels)
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean", *,
                 z_loss: float = 0.0, softcap: float | None = None, loss_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_options("FusedLinearCrossEntropyLoss", label_smoothing, reduction)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.z_loss = z_loss
        self.softcap = softcap
        self.loss_dtype = loss_dtype

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, *,
                num_items_in_batch: int | float | torch.Tensor | None = None) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden, weight, target, bias, self.ignore_index, self.label_smoothing,
                                          self.reduction, num_items_in_batch=num_items_in_batch, z_loss=self.z_loss,
                                          softcap=self.softcap, loss_dtype=self.loss_dtype)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                f"reduction={self.reduction!r}, z_loss={self.z_loss}, softcap={self.softcap}, "
                f"loss_dtype={self.loss_dtype}")


# -- torch.ops.torchport.fused_linear_cross_entropy (kernels/library.py) ---------------------------------------------
def _op_loss(target: torch.Tensor, bias: torch.Tensor | None, ignore_index: int, label_smoothing: float,
             reduction: str, divisor: float | None, z_loss: float, softcap: float | None, loss_dtype: torch.dtype):
    """The public function of ``(hidden, weight[, bias])`` with the other arguments fixed."""
    def loss(hidden, weight, *with_bias):
        return fused_linear_cross_entropy(hidden, weight, target, with_bias[0] if with_bias else bias, ignore_index,
                                          label_smoothing, reduction, num_items_in_batch=divisor, z_loss=z_loss,
                                          softcap=softcap, loss_dtype=loss_dtype)

    return loss


def _op_forward(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor, z_loss, softcap,
                wanted):
    """The loss, then its gradients with respect to hidden, weight, target (never) and bias for an upstream gradient
    of 1, those of ``wanted`` computed with it (the passes' gradients; autograd through the logits for the
    reference), the others empty. ``"none"`` computes none: its backward weights each row (:func:`_op_backward`)."""
    check_reduction("torchport::fused_linear_cross_entropy", reduction)
    fn = _op_loss(target, None, ignore_index, label_smoothing, reduction, divisor, z_loss, softcap,
                  loss_dtype_of(hidden))
    inputs = (hidden, weight, bias)
    wanted = [bool(wanted[0]), bool(wanted[1]), bias is not None and bool(wanted[3])]

    def empty():  # one of its own for each output (a custom op's outputs may not alias each other)
        return hidden.new_empty(0)

    if reduction == "none" or not any(wanted):
        return fn(hidden, weight, bias), empty(), empty(), target.new_empty(0), empty()
    with autograd_enabled():
        leaves = [None if t is None else t.detach().requires_grad_(w) for t, w in zip(inputs, wanted)]
        loss = fn(*leaves)
        found = iter(torch.autograd.grad(loss, [t for t in leaves if t is not None and t.requires_grad]))
    grads = [next(found) if w else empty() for w in wanted]
    return loss.detach(), grads[0], grads[1], target.new_empty(0), grads[2]


def _op_fake(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor, z_loss, softcap,
             wanted):
    check_reduction("torchport::fused_linear_cross_entropy", reduction)
    loss = hidden.new_empty(target.shape if reduction == "none" else (), dtype=loss_dtype_of(hidden))
    computed = reduction != "none"

    def grad(t, want):
        return torch.empty_like(t) if computed and t is not None and want else hidden.new_empty(0)

    return loss, grad(hidden, wanted[0]), grad(weight, wanted[1]), target.new_empty(0), grad(bias, wanted[3])


def _op_backward(grads, needs, hidden, weight, target, bias, ignore_index, label_smoothing, reduction, divisor,
                 z_loss, softcap, wanted):
    """``reduction="none"`` (the other reductions' gradients come from the forward): the op again with autograd on
    the saved hidden states and weight, its first pass paid twice in a compiled graph."""
    fn = _op_loss(target, None, ignore_index, label_smoothing, reduction, divisor, z_loss, softcap,
                  loss_dtype_of(hidden))
    with_bias = bias is not None
    inputs = (hidden, weight, bias) if with_bias else (hidden, weight)
    wanted = (needs[0], needs[1], needs[3]) if with_bias else (needs[0], needs[1])
    found = vjp(fn, inputs, grads, wanted)
    return found[0], found[1], None, found[2] if with_bias else None


def _inputs(gen: torch.Generator | None, rows: int, hidden: int, vocab: int) -> tuple[torch.Tensor, ...]:
    return randn(gen, (rows, hidden)), randn(gen, (vocab, hidden), hidden**-0.5), targets(gen, rows, vocab)


SPEC = registry.register_op(OpSpec(
    "fused_linear_cross_entropy", "linear + CE", "cross-entropy of ``hidden @ weight.T`` without the logits",
    ("FusedLinearCrossEntropyLoss", "fused_linear_cross_entropy"), "tokens × hidden × vocabulary",
    sizes={"test": (7, 32, 1003), "smoke": (256, 64, 1000), "small": (256, 512, 8192),
           "medium": (2048, 2048, 32000), "large": (8192, 4096, 128256), "benchmark": (8192, 4096, 128256)},
    make=_inputs, call=fused_linear_cross_entropy, differentiable=2,
    # FLOP-bound: 3 matmuls of 2·N·H·V (logits, d hidden, d weight); the bytes are the tensors read and written
    # once: hidden, weight and their gradients. The fused op runs 3 or 4 such matmuls (module docstring), and every
    # contender is counted at the unfused op's 6·N·H·V
    bytes_moved=lambda hidden, weight, target: 2 * (hidden.numel() + weight.numel()) * hidden.element_size(),
    flops=lambda hidden, weight, target: 6 * hidden.shape[0] * hidden.shape[1] * weight.shape[0],
    custom_op=CustomOp("(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index, "
                       "float label_smoothing, str reduction, float? divisor, float z_loss, float? softcap, "
                       "bool[] wanted) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
                       like=None, fake=_op_fake, forward=_op_forward, backward=_op_backward, precomputed=True),
))
