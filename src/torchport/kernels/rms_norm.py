"""RMSNorm: ``y = x / sqrt(mean(x²) + eps) * (offset + weight)``, computed in float32 and cast back to x's dtype.

``offset=0`` is Llama's form (weights start at 1), ``offset=1`` Gemma's (weights start at 0). Implementations:
``triton`` on CUDA/ROCm (see :mod:`torchport.kernels.triton.norm` for the bytes it moves; host-bound calls of at most
:data:`~torchport.kernels.registry.HOST_BOUND_ELEMENTS` elements without Gemma's offset go to torch's fused
``F.rms_norm`` instead, see :func:`~torchport.kernels.registry.host_bound`), ``npu`` through
``torch_npu.npu_rms_norm`` on Ascend, and the ``reference`` below everywhere else.

Example:
    >>> y = torchport.kernels.rms_norm(x, weight, eps=1e-6)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.npu import device_chip, operator_limits
from . import registry
from .checks import check_floating, check_same_device, widen
from .spec import OpSpec, randn

__all__ = ["RMSNorm", "rms_norm"]


@registry.register_kernel("rms_norm", "reference")
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                       in_place: bool = False) -> torch.Tensor:
    """Plain PyTorch, as Hugging Face's Llama and Gemma norms compute it (float32 inside)."""
    h = widen(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (widen(weight) + offset)).to(x.dtype)


def _rms_norm_triton_backward(grads: tuple[torch.Tensor, ...], needs: tuple[bool, ...], x: torch.Tensor,
                              weight: torch.Tensor, eps: float, offset: float) -> tuple[torch.Tensor | None, ...]:
    from .triton import norm

    dx, dw, _ = norm.backward(grads[0], x, weight, None, eps, offset, True, needs[1], False)
    return dx, dw


@registry.register_kernel("rms_norm", "triton", devices=["cuda"], priority=20, backward=_rms_norm_triton_backward)
def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                     in_place: bool = False) -> torch.Tensor:
    # Host-bound calls (decode) take torch's fused operator (on CUDA one kernel each way and a C++ autograd node,
    # FusedRmsNormBackward0 in torch 2.11): it costs the host what LayerNorm does. Gemma's offset stays here:
    # 1 + weight rounded to a 16-bit weight would lose its precision.
    if offset == 0.0 and weight.dtype == x.dtype and registry.host_bound("rms_norm", x):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    from .triton import norm

    return norm.rms_norm(x, weight, eps, offset, in_place, rms_norm_reference)


@registry.register_kernel("rms_norm", "npu", devices=["npu"], priority=10,
                          requires=registry.fused_op_reason("npu_rms_norm"))
def _rms_norm_npu(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                  in_place: bool = False) -> torch.Tensor:
    # torch_npu.npu_rms_norm(self, gamma, epsilon) -> (y, rstd), over gamma's dims; gamma in x's dtype (the one pair
    # every chip takes). It takes 2 to 8 dims, so other inputs go as [rows, hidden]; the 310P wants rows of at least
    # 32 bytes (torch_npu_contract.json).
    limits = operator_limits("npu_rms_norm")
    chip = device_chip(x.device)
    least = limits["min_last_dim_bytes"].get(chip.family) if chip is not None else None
    if least is not None and x.shape[-1] * x.element_size() < least:
        raise registry.Unsupported(f"npu_rms_norm on {chip.soc_version} takes rows of at least {least} bytes, not "
                                   f"{x.shape[-1]} x {x.dtype}")
    low, high = limits["input_dims"]
    rows = x if low <= x.dim() <= high else x.reshape(-1, x.shape[-1])
    gamma = (weight + offset if offset else weight).to(x.dtype)
    return registry.fused_op("npu_rms_norm", x.device)(rows, gamma, epsilon=eps)[0].view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, *,
             in_place: bool = False) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension, scaled by ``offset + weight``.

    Args:
        x: activations ``[..., hidden]`` (float32, bfloat16 or float16; any leading dims, any strides).
        weight: ``[hidden]``.
        eps: added to the mean square before the square root.
        offset: added to the weight (1.0 for Gemma).
        in_place: let the backward write the input gradient over the incoming gradient, saving one activation's
            memory. Only safe when nothing else uses that gradient: true after a linear layer's backward, false
            when ``y`` feeds a residual addition directly (Gemma 2/3's post-norms), where it would corrupt the
            other branch's gradient.

    Returns:
        ``y`` with x's shape and dtype.

    Example:
        >>> y = rms_norm(torch.randn(2, 5, 64), torch.ones(64))
    """
    check_floating("rms_norm", x=x, weight=weight)
    check_same_device("rms_norm", x=x, weight=weight)
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rms_norm: weight must have shape [hidden] = [{x.shape[-1] if x.dim() else '?'}] for x of shape "
            f"{list(x.shape)}, got weight of shape {list(weight.shape)}"
        )
    if torch.compiler.is_dynamo_compiling():  # a constant to dynamo: its graph calls the custom op
        return registry.custom_op("rms_norm")(x, weight, float(eps), float(offset))
    return registry.call("rms_norm", x.device, x, weight, float(eps), float(offset), bool(in_place))


class RMSNorm(nn.Module):
    """``nn.Module`` form of :func:`rms_norm` with a learnable weight (ones, or zeros when ``offset`` is 1).

    Example:
        >>> norm = RMSNorm(4096, eps=1e-6)
        >>> y = norm(x)
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, *, in_place: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.offset = offset
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, in_place=self.in_place)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}"


def _inputs(gen: torch.Generator | None, rows: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(gen, (rows, hidden)), 1 + randn(gen, (hidden,), 0.1)


SPEC = registry.register_op(OpSpec(
    "rms_norm", "RMSNorm", "``x / rms(x) * (offset + weight)``", ("RMSNorm", "rms_norm"), "rows × hidden",
    sizes={"test": (3, 123), "smoke": (256, 512), "small": (1024, 1024), "medium": (4096, 4096),
           "large": (16384, 4096), "benchmark": (8192, 4096)},
    make=_inputs, call=rms_norm, differentiable=2,
    # fwd: read x, write y; bwd: read x and dy, write dx (the weight's few KiB left out)
    bytes_moved=lambda x, weight: 5 * x.numel() * x.element_size(),
    custom_op="(Tensor x, Tensor weight, float eps, float offset) -> Tensor", in_place=True,
))
