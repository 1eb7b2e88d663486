"""Cross-entropy of logits against class targets, as ``torch.nn.functional.cross_entropy``, plus an optional z-loss.

For row ``i`` with logits ``x`` (``V`` classes), target ``t`` and ``lse = logsumexp(x)``:

    loss_i = (1 − ε)·(lse − x_t) + ε·(lse − mean(x)) + z·lse²        (0 for rows whose target is ignore_index)

with ``ε = label_smoothing`` and ``z = z_loss``. ``reduction="mean"`` divides the sum by the number of non-ignored
rows, so the z-term of a mean is exactly ``z · mean(lse²)`` over non-ignored rows (PaLM's z-loss; liger-kernel's
``lse_square_scale``); ``"sum"`` sums the rows, ``"none"`` returns them. Without z-loss this is
``F.cross_entropy(logits, target, ignore_index=..., label_smoothing=..., reduction=...)`` exactly, with one
deliberate difference: a mean over rows that are all ignored is 0 (gradients 0), where PyTorch returns NaN.

Implementations:

* ``triton`` on CUDA/ROCm (:mod:`torchport.kernels.triton.cross_entropy` counts its bytes): whole rows in
  registers up to 4096 classes, an online softmax over the vocabulary in chunks beyond (any vocabulary size, no
  float32 copy of the logits), with the gradient computed in the forward pass and the mean's row count kept on the
  device (no host synchronisation). The backward only multiplies it by the upstream gradient, and skips even that
  when the upstream gradient is 1. Host-bound eager calls (at most
  :data:`~torchport.kernels.registry.HOST_BOUND_ELEMENTS` logits, :func:`~torchport.kernels.registry.host_bound`)
  without z-loss or ``in_place``, whose targets the eager check has just read, go to ``F.cross_entropy`` instead:
  its two C++ autograd nodes cost the host a fraction of a Python ``Function``'s, for microseconds of device time.
* ``npu`` on Ascend through ``torch_npu.npu_cross_entropy_loss(input, target, weight, reduction, ignore_index,
  label_smoothing, ...)``, called per row (``reduction="none"``) with ignored rows masked here, because its
  contract takes targets in ``[0, C)`` and treats a negative ignore_index as "ignore nothing". Its z-loss is
  documented as not yet supported, and so is a label_smoothing for logits that require grad: those calls use the
  reference.
* ``reference``: plain PyTorch in float32 (float64 for float64 logits) everywhere else and as the fallback.

Where the gradient lives (``in_place``): the Triton kernel writes the gradient while the logits are in registers.
By default it goes into a new buffer of the logits' size, allocated in the forward and handed to autograd as the
logits' gradient in the backward (so it costs no more than the gradient autograd would allocate, only earlier).
``in_place=True`` writes it over the logits themselves, saving that N·V buffer (2 GiB for 8192 x 128256 bf16):
only correct when nothing reads the logits after the loss, e.g. logits that come straight out of the LM head
(the matmul's backward needs its inputs, not its output). An autograd node that saved the logits (a softcap's
tanh) then fails loudly; plain Python reads of the logits see the gradient.

Called eagerly, a target outside ``[0, V)`` that is not ``ignore_index`` is a ``ValueError``
(:class:`~torchport.kernels.registry.InputError`) that names the allowed range, before any loss kernel runs, after
one host read of the targets (:func:`check_targets`; the Triton implementation counts the bad targets and the
mean's rows in one program instead, :func:`torchport.kernels.triton.loss_reduce.target_counts`). Inside a compiled
graph or a captured CUDA graph, where nothing may read the device on the host, every implementation checks the
targets itself: such a row gets no gradient and a NaN loss (the reduced loss too), never a finite number, and nothing
outside the logits is read. The Triton path then runs four kernels for a forward and backward (the mean's row count,
the loss and gradient, the sum, the backward's scale), with no separate check.

Example:
    >>> loss = torchport.kernels.cross_entropy(logits.view(-1, vocab), labels.view(-1), ignore_index=-100)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.npu import operator_limits
from . import registry
from .checks import capturing, check_floating, check_same_device, widen
from .loss_checks import (bad_target_error, check_options, check_reduction, check_target_tensor, check_targets,
                          loss_dtype_of)
from ._autograd import vjp
from .spec import CustomOp, OpSpec, randn, targets

__all__ = ["CrossEntropyLoss", "cross_entropy", "per_row_losses"]


def _reduce(rows: torch.Tensor, valid: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """Per-row losses to the requested reduction ("mean" over the kept rows; 0 when none is kept), in ``dtype``."""
    if reduction == "none":
        return rows.to(dtype)
    total = rows.sum()
    if reduction == "mean":
        total = total / valid.sum().clamp_min(1)
    return total.to(dtype)


def _per_row(x: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
             z_loss: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-row loss, lse, mask of rows with a class target, safe target) for ``[N, V]`` logits already in float32 or
    float64. A target that is neither ``ignore_index`` nor a class in ``[0, V)`` (possible only where no host read
    checked it: :func:`cross_entropy`) gives its row a NaN loss and no gradient."""
    kept = target != ignore_index
    valid = _classes(target, ignore_index, x.shape[-1])
    safe = torch.where(valid, target, torch.zeros_like(target))
    lse = torch.logsumexp(x, dim=-1)
    x_t = x.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    loss = lse - x_t
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - x.mean(-1))
    if z_loss:
        loss = loss + z_loss * lse * lse
    return torch.where(valid, loss, torch.where(kept, torch.full_like(loss, float("nan")), 0.0)), lse, valid, safe


def per_row_losses(x: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                   z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row losses, non-ignored mask) of ``[N, V]`` logits already in float32 or float64, differentiable: the
    reference math that the fused linear cross-entropy's reference shares."""
    rows, _, valid, _ = _per_row(x, target, ignore_index, label_smoothing, z_loss)
    return rows, valid


@registry.register_kernel("cross_entropy", "reference")
def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                            label_smoothing: float = 0.0, reduction: str = "mean", z_loss: float = 0.0,
                            in_place: bool = False, n_valid: int | None = None,
                            loss_dtype: torch.dtype | None = None, check: bool = False) -> torch.Tensor:
    """Plain PyTorch on ``[N, V]`` logits and ``[N]`` targets, in float32 (float64 for float64 logits); the loss is
    returned in ``loss_dtype``, by default the logits' dtype, as ``F.cross_entropy`` does. ``check``: read the
    targets on the host first (:func:`check_targets`), as the fallback of an implementation that checks itself."""
    if check:
        check_targets("cross_entropy", target, logits.shape[-1], ignore_index)
    rows, _, valid, _ = _per_row(widen(logits), target, ignore_index, label_smoothing, z_loss)
    return _reduce(rows, valid, reduction, loss_dtype or logits.dtype)


@registry.register_kernel("cross_entropy", "triton", devices=["cuda"], priority=20)
def _cross_entropy_triton(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                          label_smoothing: float = 0.0, reduction: str = "mean", z_loss: float = 0.0,
                          in_place: bool = False, n_valid: int | None = None,
                          loss_dtype: torch.dtype | None = None, check: bool = False) -> torch.Tensor:
    from .triton import cross_entropy as kernel

    if check:  # one program counts the bad targets and the mean's rows; one host read (before any refusal below)
        from .triton.loss_reduce import target_counts

        target = target.contiguous()  # the program reads the targets as one contiguous run
        bad, n_valid = target_counts(target, ignore_index, logits.shape[-1])
        if bad:
            raise bad_target_error("cross_entropy", logits.shape[-1], ignore_index)
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise registry.Unsupported(f"the Triton kernel takes float32, bfloat16 or float16 logits, not {logits.dtype}")
    # Host-bound and checked (so eager): torch's log_softmax and nll_loss (C++ autograd nodes, four kernels in all)
    if check and not (z_loss or in_place) and registry.host_bound("cross_entropy", logits):
        return _torch_cross_entropy(logits, target, ignore_index, label_smoothing, reduction, n_valid, loss_dtype)
    return kernel.cross_entropy(logits, target, ignore_index, label_smoothing, reduction, z_loss, in_place, n_valid,
                                loss_dtype)


def _torch_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                         reduction: str, n_valid: int, loss_dtype: torch.dtype | None) -> torch.Tensor:
    """``F.cross_entropy`` on targets already checked, with torchport's two differences: a mean over no class
    target is 0 (PyTorch: NaN), and a ``loss_dtype`` wider than the logits computes in it (unrounded). 16-bit logits
    are taken in float32, so that the loss and gradient are rounded once, as the Triton kernel rounds them (PyTorch's
    16-bit log-softmax rounds every log-probability: twice the error with label smoothing)."""
    dtype = loss_dtype or logits.dtype
    work = torch.promote_types(torch.promote_types(logits.dtype, dtype), torch.float32)
    x = logits if logits.dtype == work else logits.to(work)
    if reduction == "mean" and n_valid == 0:
        reduction = "sum"  # every row ignored: 0, and gradients 0
    loss = F.cross_entropy(x, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
    return loss if loss.dtype == dtype else loss.to(dtype)


_NPU_MAX_ROWS = 200_000  # torch_npu documents N in (0, 200000]


@registry.register_kernel("cross_entropy", "npu", devices=["npu"], priority=10,
                          requires=registry.fused_op_reason("npu_cross_entropy_loss"))
def _cross_entropy_npu(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                       label_smoothing: float = 0.0, reduction: str = "mean", z_loss: float = 0.0,
                       in_place: bool = False, n_valid: int | None = None,
                       loss_dtype: torch.dtype | None = None, check: bool = False) -> torch.Tensor:
    # check: never True here; _rows_or_total checks the targets before calling an implementation outside
    # _CHECKS_ITSELF
    if z_loss:
        raise registry.Unsupported("torch_npu.npu_cross_entropy_loss does not support z-loss yet")
    if not 0 < logits.shape[0] <= _NPU_MAX_ROWS:
        raise registry.Unsupported(f"torch_npu.npu_cross_entropy_loss takes 1 to {_NPU_MAX_ROWS} rows, "
                                   f"not {logits.shape[0]}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise registry.Unsupported(f"torch_npu.npu_cross_entropy_loss takes float32, bfloat16 or float16, "
                                   f"not {logits.dtype}")
    # With logits that require grad, torch_npu takes only the default label_smoothing for "none" (torchport's
    # reduction here; torch_npu_contract.json): smoothing in training takes the reference
    fixed = operator_limits("npu_cross_entropy_loss")["defaults_only_when_input_requires_grad"]["none"]
    if label_smoothing and "label_smoothing" in fixed and logits.requires_grad and torch.is_grad_enabled():
        raise registry.Unsupported("torch_npu.npu_cross_entropy_loss takes no label_smoothing when the logits "
                                   "require grad")
    op = registry.fused_op("npu_cross_entropy_loss", logits.device)
    # Targets must lie in [0, C): ignored rows get class 0 and are masked out of the loss (and so the gradient); a
    # target outside the classes (unchecked only in a compiled or captured graph) makes its row NaN.
    kept = target != ignore_index
    valid = _classes(target, ignore_index, logits.shape[-1])
    safe = torch.where(valid, target, torch.zeros_like(target)).long()
    rows = op(logits, safe, None, "none", -1, float(label_smoothing))[0]
    nan = torch.full((), float("nan"), dtype=torch.float32, device=rows.device)
    rows = torch.where(valid, rows.float(), torch.where(kept, nan, torch.zeros_like(nan)))
    return _reduce(rows, valid, reduction, loss_dtype or logits.dtype)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
                  reduction: str = "mean", *, z_loss: float = 0.0, in_place: bool = False,
                  loss_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cross-entropy of ``logits`` against class indices ``target`` (see the module docstring for the formula).

    Args:
        logits: ``[N, V]`` or ``[B, T, V]`` (any leading dims), float32, bfloat16 or float16.
        target: integer class indices with the logits' leading shape (``[N]`` or ``[B, T]``).
        ignore_index: rows with this target contribute nothing (and are not counted by a mean).
        label_smoothing: ε in [0, 1], as ``F.cross_entropy``.
        reduction: ``"mean"`` (over non-ignored rows; 0 when all are ignored), ``"sum"`` or ``"none"``.
        z_loss: weight of ``lse²`` added to each non-ignored row's loss (0 disables it).
        in_place: let the Triton kernel write the gradient over ``logits`` instead of a new buffer (saves one
            logits-sized buffer; only when nothing reads the logits afterwards — see the module docstring).
        loss_dtype: the dtype of the returned loss; default the logits' (as ``F.cross_entropy``).
            ``torch.float32`` returns the float32 sum unrounded, as Hugging Face's causal-LM loss (which upcasts the
            logits) does. The gradient keeps the logits' dtype.

    Returns:
        A scalar, or for ``"none"`` the per-row losses with ``target``'s shape.

    Example:
        >>> loss = cross_entropy(torch.randn(8, 1000, requires_grad=True), torch.randint(0, 1000, (8,)))
        >>> loss.backward()
    """
    op = "cross_entropy"
    check_floating(op, logits=logits)
    if logits.dim() < 2:
        raise ValueError(f"{op}: logits must be [N, V] or [B, T, V], got shape {list(logits.shape)}")
    target = check_target_tensor(op, target, logits.shape[:-1], "the logits' shape without the vocabulary dim")
    check_same_device(op, logits=logits, target=target)
    check_options(op, label_smoothing, reduction)
    if z_loss < 0:
        raise ValueError(f"{op}: z_loss={z_loss} must be >= 0")
    if loss_dtype is not None and not (isinstance(loss_dtype, torch.dtype) and loss_dtype.is_floating_point):
        raise TypeError(f"{op}: loss_dtype={loss_dtype!r} must be a floating dtype (torch.float32, ...) or None")
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(f"{op}: logits have an empty class dimension (shape {list(logits.shape)})")
    rows = logits if logits.dim() == 2 else logits.reshape(-1, vocab)  # (a reshape is a view and an autograd node)
    flat = target if target.dim() == 1 else target.reshape(-1)
    # Eagerly the implementation reads the targets on the host first: a bad one is a ValueError. Where no host read
    # is possible, every implementation gives a row with a bad target a NaN loss itself.
    if torch.compiler.is_dynamo_compiling():  # a constant to dynamo: its graph calls the custom op
        loss = registry.custom_op(op)(rows, flat, int(ignore_index), float(label_smoothing), reduction, float(z_loss),
                                      False)
        loss = loss.to(loss_dtype or logits.dtype)
    else:
        loss = _rows_or_total(rows, flat, ignore_index, label_smoothing, reduction, z_loss, in_place, loss_dtype,
                              check=not capturing(flat.device))
    return loss.view(target.shape) if reduction == "none" else loss


#: This op's implementations that read the targets themselves when passed ``check=True`` (in one launch with what
#: they count anyway); every other one, registered here or elsewhere, gets targets checked by :func:`check_targets`
#: first and ``check=False``. The reference checks too, for a fallback after an implementation that was to check.
_CHECKS_ITSELF = frozenset({"triton"})


def _rows_or_total(rows: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                   reduction: str, z_loss: float, in_place: bool = False,
                   loss_dtype: torch.dtype | None = None, check: bool = False) -> torch.Tensor:
    """The chosen implementation on ``[N, V]`` logits and ``[N]`` int64 targets. ``check``: the targets are read on
    the host first (by :func:`check_targets`, or by an implementation of ``_CHECKS_ITSELF``), and a bad one is a
    ValueError (callers pass it where a host read is possible); without it nothing is read on the host, and a target
    outside ``[0, V)`` that is not ``ignore_index`` makes its row's loss NaN."""
    if check and registry.select("cross_entropy", rows.device).name not in _CHECKS_ITSELF:
        check_targets("cross_entropy", target, rows.shape[-1], ignore_index)
        check = False
    return registry.call("cross_entropy", rows.device, rows, target, int(ignore_index), float(label_smoothing),
                         reduction, float(z_loss), bool(in_place), None, loss_dtype, bool(check))


class CrossEntropyLoss(nn.Module):
    """``nn.Module`` form of :func:`cross_entropy` (a drop-in for ``nn.CrossEntropyLoss`` without class weights).

    Example:
        >>> criterion = CrossEntropyLoss(ignore_index=-100, z_loss=1e-4)
        >>> loss = criterion(logits.view(-1, vocab), labels.view(-1))
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean", *,
                 z_loss: float = 0.0, in_place: bool = False, loss_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_options("CrossEntropyLoss", label_smoothing, reduction)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.z_loss = z_loss
        self.in_place = in_place
        self.loss_dtype = loss_dtype

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, target, self.ignore_index, self.label_smoothing, self.reduction,
                             z_loss=self.z_loss, in_place=self.in_place, loss_dtype=self.loss_dtype)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                f"reduction={self.reduction!r}, z_loss={self.z_loss}, in_place={self.in_place}, "
                f"loss_dtype={self.loss_dtype}")


# -- torch.ops.torchport.cross_entropy (kernels/library.py) -----------------------------------------------------------
def _op_forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                reduction: str, z_loss: float = 0.0, check: bool = True) -> torch.Tensor:
    """Per-row losses in the logits' dtype, summed in float32: one rounding per row, none of the sum.

    ``check``: a bad target is a ValueError (one host read), as for :func:`cross_entropy` called eagerly. The graph
    that torch.compile makes of :func:`cross_entropy` passes False, so that its steps read nothing on the host: a
    bad target's row is then NaN."""
    check_reduction("torchport::cross_entropy", reduction)
    rows = _rows_or_total(logits, target.long(), ignore_index, label_smoothing, "none", z_loss,
                          check=check and not capturing(target.device)).to(loss_dtype_of(logits))
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "mean":
        total = total / _classes(target, ignore_index, logits.shape[-1]).sum().clamp_min(1)
    return total


def _classes(target: torch.Tensor, ignore_index: int, vocab: int) -> torch.Tensor:
    """Which targets are classes in ``[0, vocab)`` (the rows a mean counts)."""
    return (target != ignore_index) & (target >= 0) & (target < vocab)


def _op_fake(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
             reduction: str, z_loss: float = 0.0, check: bool = True) -> torch.Tensor:
    check_reduction("torchport::cross_entropy", reduction)
    return logits.new_empty(target.shape if reduction == "none" else (), dtype=loss_dtype_of(logits))


def _op_backward(grads: tuple[torch.Tensor, ...], needs: tuple[bool, ...], logits: torch.Tensor,
                 target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str,
                 z_loss: float = 0.0, check: bool = True) -> tuple[torch.Tensor | None, None]:
    """The summed loss differentiated with an upstream gradient of exactly 1, the result scaled in float32 after
    (by the upstream gradient, divided by the kept rows for a mean): a bfloat16 kernel never sees a rounded
    1/num_items."""
    if not needs[0]:
        return None, None
    (grad,) = grads
    ones = torch.ones((), dtype=logits.dtype, device=logits.device)
    (dlogits,) = vjp(lambda x: _rows_or_total(x, target.long(), ignore_index, label_smoothing, "sum", z_loss),
                     (logits,), (ones,))
    if reduction == "none":
        scale = grad.unsqueeze(-1)
    elif reduction == "mean":
        scale = grad / _classes(target, ignore_index, logits.shape[-1]).sum().clamp_min(1)
    else:
        scale = grad
    return dlogits.mul_(scale), None  # in float32 (opmath), rounded once to the logits' dtype


def _inputs(gen: torch.Generator | None, rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(gen, (rows, vocab), 2.0), targets(gen, rows, vocab)


SPEC = registry.register_op(OpSpec(
    "cross_entropy", "cross-entropy", "``-log softmax(logits)[target]`` (ignore_index, smoothing, z-loss)",
    ("CrossEntropyLoss", "cross_entropy"), "rows × vocabulary",
    sizes={"test": (7, 1003), "smoke": (256, 32003), "small": (512, 8192), "medium": (4096, 32000),
           "large": (8192, 128256), "benchmark": (8192, 128256)},
    make=_inputs, call=cross_entropy, differentiable=1,
    # fwd: read the logits once; bwd: write their gradient (the loss is a scalar). torchport's kernel computes the
    # gradient in the forward, reading each row a second time (from L2 when it fits)
    bytes_moved=lambda logits, target: 2 * logits.numel() * logits.element_size(),
    custom_op=CustomOp("(Tensor logits, Tensor target, int ignore_index, float label_smoothing, str reduction, "
                       "float z_loss=0.0, bool check=True) -> Tensor", like=None, fake=_op_fake, forward=_op_forward,
                       backward=_op_backward),
    in_place=True,
))
