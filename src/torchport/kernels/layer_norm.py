"""LayerNorm over the last dimension: ``y = (x - mean) / sqrt(var + eps) * weight + bias``.

The ``reference`` is PyTorch's own ``layer_norm`` (already one fused kernel per direction on CUDA, and torch_npu's
fused LayerNorm on Ascend, both accumulating in float32). The ``triton`` kernel on CUDA/ROCm also folds the weight
and bias gradients into the input-gradient pass instead of re-reading x and dy for them; host-bound calls (at most
:data:`~torchport.kernels.registry.HOST_BOUND_ELEMENTS` elements, :func:`~torchport.kernels.registry.host_bound`)
take the reference there, whose launch and C++ autograd node cost the host less.

Example:
    >>> y = torchport.kernels.layer_norm(x, weight, bias, eps=1e-5)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import registry
from .checks import check_floating, check_same_device
from .spec import OpSpec, randn

__all__ = ["LayerNorm", "layer_norm"]


@registry.register_kernel("layer_norm", "reference")
def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         eps: float) -> torch.Tensor:
    """PyTorch's ``F.layer_norm`` over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _layer_norm_triton_backward(grads: tuple[torch.Tensor, ...], needs: tuple[bool, ...], x: torch.Tensor,
                                weight: torch.Tensor | None, bias: torch.Tensor | None,
                                eps: float) -> tuple[torch.Tensor | None, ...]:
    from .triton import norm

    return norm.backward(grads[0], x, weight, bias, eps, 0.0, False, needs[1], needs[2])


@registry.register_kernel("layer_norm", "triton", devices=["cuda"], priority=20, backward=_layer_norm_triton_backward)
def _layer_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       eps: float) -> torch.Tensor:
    # Host-bound calls (decode) take PyTorch's fused LayerNorm, whose C++ autograd node costs the host less
    if all(t is None or t.dtype == x.dtype for t in (weight, bias)) and registry.host_bound("layer_norm", x):
        return layer_norm_reference(x, weight, bias, eps)
    from .triton import norm

    return norm.layer_norm(x, weight, bias, eps, layer_norm_reference)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    """Layer normalisation over the last dimension with optional affine ``weight`` and ``bias`` (``[hidden]``).

    Example:
        >>> y = layer_norm(torch.randn(2, 5, 64), torch.ones(64), torch.zeros(64))
    """
    check_floating("layer_norm", x=x, weight=weight, bias=bias)
    check_same_device("layer_norm", x=x, weight=weight, bias=bias)
    hidden = x.shape[-1] if x.dim() else None
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (hidden is None or t.shape != (hidden,)):
            raise ValueError(
                f"layer_norm: {name} must have shape [hidden] = [{hidden if hidden is not None else '?'}] for x of "
                f"shape {list(x.shape)}, got {name} of shape {list(t.shape)}"
            )
    if hidden is None:
        raise ValueError("layer_norm: x must have at least one dimension, got a scalar")
    if torch.compiler.is_dynamo_compiling():  # a constant to dynamo: its graph calls the custom op
        return registry.custom_op("layer_norm")(x, weight, bias, float(eps))
    return registry.call("layer_norm", x.device, x, weight, bias, float(eps))


class LayerNorm(nn.Module):
    """``nn.Module`` form of :func:`layer_norm` (weight ones, bias zeros), like ``nn.LayerNorm`` over one dim.

    Example:
        >>> norm = LayerNorm(1024)
        >>> y = norm(x)
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


def _inputs(gen: torch.Generator | None, rows: int, hidden: int) -> tuple[torch.Tensor, ...]:
    return randn(gen, (rows, hidden)), 1 + randn(gen, (hidden,), 0.1), randn(gen, (hidden,), 0.1)


SPEC = registry.register_op(OpSpec(
    "layer_norm", "LayerNorm", "``(x - mean) / std * weight + bias``", ("LayerNorm", "layer_norm"), "rows × hidden",
    sizes={"test": (3, 123), "smoke": (256, 512), "small": (1024, 1024), "medium": (4096, 4096),
           "large": (16384, 4096), "benchmark": (8192, 4096)},
    make=_inputs, call=layer_norm, differentiable=3,
    # the five passes of RMSNorm: fwd reads x, writes y; bwd reads x and dy, writes dx
    bytes_moved=lambda x, weight, bias: 5 * x.numel() * x.element_size(),
    custom_op="(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor",
))
