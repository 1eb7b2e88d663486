"""Gated activations of LLM MLPs: ``swiglu(gate, up) = silu(gate) * up`` and ``geglu(gate, up) = gelu_tanh(gate) * up``.

Implementations: ``triton`` on CUDA/ROCm (one fused kernel each way; :mod:`torchport.kernels.triton.glu` counts
the bytes; host-bound calls of at most :data:`~torchport.kernels.registry.HOST_BOUND_ELEMENTS` elements go to torch's
own activation and product instead, see :func:`~torchport.kernels.registry.host_bound`), ``npu`` for SwiGLU through
``torch_npu.npu_swiglu`` on Ascend, and the ``reference`` below.

Example:
    >>> h = torchport.kernels.swiglu(gate_proj(x), up_proj(x))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.npu import operator_limits
from . import registry
from .checks import check_floating, check_same_device, check_same_dtype, widen
from .spec import OpSpec, randn

__all__ = ["GeGLU", "SwiGLU", "geglu", "swiglu"]


@registry.register_kernel("swiglu", "reference")
def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``silu(gate) * up``, computed in float32 and rounded once."""
    return (F.silu(widen(gate)) * widen(up)).to(gate.dtype)


@registry.register_kernel("geglu", "reference")
def geglu_reference(gate: torch.Tensor, up: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up``, computed in float32 and rounded once."""
    return (F.gelu(widen(gate), approximate="tanh") * widen(up)).to(gate.dtype)


def _triton_backward(gelu: bool):
    def backward(grads: tuple[torch.Tensor, ...], needs: tuple[bool, ...], gate: torch.Tensor,
                 up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from .triton import glu

        return glu.backward(grads[0], gate, up, gelu)

    return backward


@registry.register_kernel("swiglu", "triton", devices=["cuda"], priority=20, backward=_triton_backward(False))
def _swiglu_triton(gate: torch.Tensor, up: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    # Host-bound calls (decode outside a CUDA graph, tiny batches) take torch's two operators: their C++ autograd
    # nodes cost the host a fraction of the Triton path's Python Function. The result is rounded where the model's
    # own ``act_fn(gate_proj(x)) * up_proj(x)`` rounds it: after the activation and after the product.
    if registry.host_bound("swiglu", gate):
        return F.silu(gate) * up
    from .triton import glu

    return glu.glu(gate, up, False, in_place, swiglu_reference)


@registry.register_kernel("geglu", "triton", devices=["cuda"], priority=20, backward=_triton_backward(True))
def _geglu_triton(gate: torch.Tensor, up: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    if registry.host_bound("geglu", gate):  # as for SwiGLU
        return F.gelu(gate, approximate="tanh") * up
    from .triton import glu

    return glu.glu(gate, up, True, in_place, geglu_reference)


@registry.register_kernel("swiglu", "npu", devices=["npu"], priority=10,
                          requires=registry.fused_op_reason("npu_swiglu"))
def _swiglu_npu(gate: torch.Tensor, up: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    # torch_npu.npu_swiglu(x, dim) = silu(first half of x along dim) * second half, for a contiguous, non-empty x of
    # 1 to 8 dims (torch_npu_contract.json): other shapes go as [rows, features], an empty one needs no kernel
    if gate.numel() == 0:
        return swiglu_reference(gate, up)
    low, high = operator_limits("npu_swiglu")["input_dims"]
    shape = gate.shape
    if not low <= gate.dim() <= high:
        gate, up = gate.reshape(-1, shape[-1] if shape else 1), up.reshape(-1, shape[-1] if shape else 1)
    out = registry.fused_op("npu_swiglu", gate.device)(torch.cat([gate, up], dim=-1), dim=-1)
    return out.view(shape)


def _check(op: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    check_floating(op, gate=gate, up=up)
    check_same_device(op, gate=gate, up=up)
    check_same_dtype(op, gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate and up must have the same shape, got {list(gate.shape)} and {list(up.shape)}")


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` (Llama, Mistral, Qwen MLPs).

    Args:
        gate, up: tensors of one shape and dtype (float32, bfloat16 or float16), any strides.
        in_place: let the backward write the gradients over ``gate`` and ``up`` (saving two activations of
            memory). Only for intermediates used by nothing else, such as the outputs of an MLP's gate and up
            projections; an autograd node that saved ``gate`` or ``up`` then fails loudly instead of reading
            overwritten values.

    Example:
        >>> h = swiglu(torch.randn(4, 11008), torch.randn(4, 11008))
    """
    _check("swiglu", gate, up)
    if torch.compiler.is_dynamo_compiling():  # a constant to dynamo: its graph calls the custom op
        return registry.custom_op("swiglu")(gate, up)
    return registry.call("swiglu", gate.device, gate, up, bool(in_place))


def geglu(gate: torch.Tensor, up: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (Gemma MLPs); arguments as for :func:`swiglu`.

    Example:
        >>> h = geglu(torch.randn(4, 16384), torch.randn(4, 16384))
    """
    _check("geglu", gate, up)
    if torch.compiler.is_dynamo_compiling():  # a constant to dynamo: its graph calls the custom op
        return registry.custom_op("geglu")(gate, up)
    return registry.call("geglu", gate.device, gate, up, bool(in_place))


class _GatedActivation(nn.Module):
    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = in_place

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.function(gate, up, in_place=self.in_place)

    def extra_repr(self) -> str:
        return f"in_place={self.in_place}"


class SwiGLU(_GatedActivation):
    """``nn.Module`` form of :func:`swiglu`: ``forward(gate, up)``."""

    function = staticmethod(swiglu)


class GeGLU(_GatedActivation):
    """``nn.Module`` form of :func:`geglu`: ``forward(gate, up)``."""

    function = staticmethod(geglu)


def _inputs(gen: torch.Generator | None, rows: int, inner: int) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(gen, (rows, inner)), randn(gen, (rows, inner))


def _bytes(gate: torch.Tensor, up: torch.Tensor) -> int:
    # fwd: read gate, up, write y (3); bwd: read gate, up, dy, write dgate, dup (5)
    return 8 * gate.numel() * gate.element_size()


SWIGLU = registry.register_op(OpSpec(
    "swiglu", "SwiGLU", "``silu(gate) * up``", ("SwiGLU", "swiglu"), "rows × intermediate",
    sizes={"test": (3, 37), "smoke": (256, 512), "small": (1024, 2048), "medium": (4096, 8192),
           "large": (8192, 14336), "benchmark": (8192, 14336)},
    make=_inputs, call=swiglu, differentiable=2, bytes_moved=_bytes,
    custom_op="(Tensor gate, Tensor up) -> Tensor", in_place=True,
))
GEGLU = registry.register_op(OpSpec(
    "geglu", "GeGLU", "``gelu_tanh(gate) * up``", ("GeGLU", "geglu"), "rows × intermediate",
    sizes={"test": (3, 37), "smoke": (256, 512), "small": (1024, 2048), "medium": (4096, 8192),
           "large": (8192, 14336), "benchmark": (8192, 14336)},
    make=_inputs, call=geglu, differentiable=2, bytes_moved=_bytes,
    custom_op="(Tensor gate, Tensor up) -> Tensor", in_place=True,
))
