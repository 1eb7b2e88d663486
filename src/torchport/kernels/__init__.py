"""Fused kernels with one API on every device: the implementation is chosen by the input tensor's device.

================  =====================================================  ===========================
op                computes                                               modules
================  =====================================================  ===========================
``rms_norm``      ``x / rms(x) * (offset + weight)``                     :class:`RMSNorm`
``layer_norm``    ``(x - mean) / std * weight + bias``                   :class:`LayerNorm`
``rope``          Hugging Face ``apply_rotary_pos_emb`` on q and k       :class:`RoPE`
``swiglu``        ``silu(gate) * up``                                    :class:`SwiGLU`
``geglu``         ``gelu_tanh(gate) * up``                               :class:`GeGLU`
``lowbit_matmul`` ``x @ dequantise(W).T`` for low-bit weights            :class:`torchport.quant.QuantizedLinear`
================  =====================================================  ===========================

Each op has a plain-PyTorch ``reference`` (every device, and the fallback), a ``triton`` kernel for CUDA/ROCm, and
an ``npu`` implementation through torch_npu's fused operators where Ascend has one. ``TORCHPORT_KERNELS`` forces a
choice (see :mod:`torchport.kernels.registry`); :func:`table` shows what each op uses on this machine.

Example:
    >>> import torchport
    >>> y = torchport.kernels.rms_norm(x, weight)
    >>> torchport.kernels.table()[0]
    {'op': 'geglu', 'device': 'cpu', 'implementation': 'reference', ...}
"""

from __future__ import annotations

from .cross_entropy import CrossEntropyLoss, cross_entropy
from .fused_linear_cross_entropy import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .glu import GeGLU, SwiGLU, geglu, swiglu
from .layer_norm import LayerNorm, layer_norm
from .lowbit_matmul import lowbit_linear
from .registry import KernelError, Unsupported, list_kernels, register_kernel, table
from .rms_norm import RMSNorm, rms_norm
from .rope import RoPE, rope

__all__ = [
    "CrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
    "GeGLU",
    "KernelError",
    "LayerNorm",
    "RMSNorm",
    "RoPE",
    "SwiGLU",
    "Unsupported",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "geglu",
    "layer_norm",
    "list_kernels",
    "lowbit_linear",
    "register_kernel",
    "rms_norm",
    "rope",
    "swiglu",
    "table",
]
