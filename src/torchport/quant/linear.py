"""``QuantizedLinear``: an ``nn.Linear`` whose weight is held in a low-bit format and decoded inside the matmul."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.lowbit_matmul import lowbit_linear, tensor_version
from .formats import Format, get_format

__all__ = ["QuantizedLinear"]

_TENSORS = ("qweight", "scale", "offset", "global_scale")
_DECODERS: dict[str, Any] = {}  # format name -> its plain-PyTorch decoder (a format's name is registered once)
_DECODE_ROWS = 16  # up to this many rows the fused decode kernels read the codes; above it the cache may apply


class QuantizedLinear(nn.Module):
    """A linear layer with weight-only low-bit storage: activations, bias and output stay in ``dtype``.

    The codes and scales are buffers (they move with ``.to(device)`` and are saved in ``state_dict``); a dtype
    conversion of the module (``.half()``, ``.to(torch.bfloat16)``) changes the compute dtype and the bias only, never
    the stored codes. Build one from a layer with :meth:`from_linear` (what :func:`torchport.quantize` does).

    Above 16 rows (prefill) each call either decodes the weight tiles inside a tensor-core GEMM or dequantises the
    weight into the compute dtype and drops it after the matmul (on CUDA the autotuner picks per shape), so the
    layer holds only its codes. ``cache_dequantized = True`` keeps that dense weight between calls instead:
    prefill then runs at the dense matmul's speed, and the layer holds the codes plus a dense copy (bf16: 2 bytes per
    weight) from its first call of more than 16 rows until the flag is cleared or the layer is moved.

    Layers that :func:`torchport.quantize` merged (q/k/v, gate/up: :mod:`torchport.quant.merge`) hold their codes
    as row slices of one tensor and, at one row, run one kernel for the set.

    Example:
        >>> layer = QuantizedLinear.from_linear(nn.Linear(4096, 4096, dtype=torch.bfloat16), "int4")
        >>> y = layer(x)                    # == x @ layer.dequantized_weight().T, fused where the device allows
        >>> layer.cache_dequantized = True  # prefill: dequantise once, keep the dense weight
    """

    cache_dequantized: bool = False
    _group: Any = None  # the quant.merge.SiblingGroup this layer's codes are a row slice of, if any

    def __init__(self, in_features: int, out_features: int, format: str, group_size: int | None = None, *,
                 bias: bool = True, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        fmt = get_format(format)
        self.in_features, self.out_features = in_features, out_features
        self.format: str = fmt.name
        self.group_size: int = fmt.group_size(group_size, in_features)
        self.dtype: torch.dtype = dtype or torch.get_default_dtype()
        self._cache: dict[str, Any] = {}
        # Placeholders of the right shapes and dtypes, so that a state dict saved from a quantised model loads.
        example = fmt.quantize(torch.zeros(1, in_features, dtype=self.dtype), self.group_size)
        for name in _TENSORS:
            if name in example:
                t = example[name]
                shape = (out_features, *t.shape[1:]) if t.dim() else ()
                self.register_buffer(name, torch.zeros(shape, dtype=t.dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=self.dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str, group_size: int | None = None) -> QuantizedLinear:
        """Quantise ``linear``'s weight into ``format``; the bias is kept as it is (same Parameter).

        Quantising runs on the weight's device, in float32.
        """
        weight = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, format, group_size, bias=False, dtype=weight.dtype,
                    device="meta")
        tensors = get_format(format).quantize(weight, layer.group_size)
        for name, value in tensors.items():
            setattr(layer, name, value.contiguous())
        layer.bias = linear.bias
        return layer

    @property
    def format_spec(self) -> Format:
        return get_format(self.format)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The format's tensors (``qweight``, ``scale``, and ``offset`` / ``global_scale`` by format)."""
        # Read from the buffers directly: nn.Module's attribute lookup, and hasattr's exception for an absent one,
        # cost the host microseconds per layer call (a prefill makes 225 of them on an 8B model)
        if torch.compiler.is_dynamo_compiling():  # dynamo follows nn.Module's attributes, not its dicts
            return {name: getattr(self, name) for name in _TENSORS if hasattr(self, name)}
        found = {}
        for name in _TENSORS:
            for place in (self._buffers, self._parameters, self.__dict__):
                if name in place:
                    found[name] = place[name]
                    break
        return found

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense ``(out_features, in_features)`` weight these codes stand for, in ``dtype`` (default: the
        layer's compute dtype)."""
        return self.format_spec.dequantize(self.tensors(), dtype or self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (computed on each access, for code that reads ``layer.weight``; the forward never
        builds it at decode sizes)."""
        return self.dequantized_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._group is not None and x.dim() and x.numel() == x.shape[-1] == self.in_features:
            y = self._group.output(self, x)  # one row: one kernel for this layer and its siblings
            if y is not None:
                return y
        if self.cache_dequantized and x.numel() > _DECODE_ROWS * x.shape[-1]:
            return F.linear(x, self._dense(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if not self.cache_dequantized:
            self._cache.pop("dense", None)
        # The format's decoder, looked up once per format name, not per call; a graph that dynamo traces calls the
        # custom op, which looks it up itself (the lookup takes a lock that dynamo cannot trace)
        decoder = None
        if not torch.compiler.is_dynamo_compiling():
            decoder = _DECODERS.get(self.format)
            if decoder is None:
                decoder = _DECODERS[self.format] = get_format(self.format).dequantize
        return lowbit_linear(x, self.tensors(), self.format, self.group_size, self.bias, dequantize=decoder,
                             cache=self._cache)

    def _dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantised weight in ``dtype``, made once per storage, version and dtype of the codes and scales
        (an in-place update such as ``load_state_dict`` bumps a version and so makes it again)."""
        tensors = self.tensors()
        key = (dtype, *((v.data_ptr(), tensor_version(v)) for v in tensors.values()))
        cached = self._cache.get("dense")
        if cached is None or cached[0] != key:
            self._cache.pop("dense", None)  # free the old copy before making the new one
            with torch.no_grad():
                cached = (key, self.dequantized_weight(dtype))
            self._cache["dense"] = cached
        return cached[1]

    def nbytes(self) -> int:
        """Bytes of the stored weight: codes and scales (the bias not counted)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> QuantizedLinear:
        # Inside torch.inference_mode, moved or emptied tensors would be inference tensors, which keep no count of
        # in-place writes: every cache derived from them (launch plans, merged siblings, torch_npu's repacked
        # weight) would then be made again at every call. Made as normal tensors, as quantize makes them.
        with torch.inference_mode(False):
            return self._move(fn)

    def _move(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedLinear:
        # nn.Module converts every floating buffer with fn, which would turn float8 codes or scales into the
        # target dtype. Learn where fn sends a tensor of the compute dtype, and move the codes there unconverted.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.scale.device))
        for name in _TENSORS:
            if hasattr(self, name):
                t = getattr(self, name)
                if t.is_meta:  # to_empty(): new storage, filled by a state-dict load
                    self._buffers[name] = torch.empty_like(t, device=probe.device)
                elif t.device != probe.device:
                    self._buffers[name] = t.to(probe.device)
        if self.bias is not None:
            moved = fn(self.bias.data)
            if moved is not self.bias.data:
                if torch._has_compatible_shallow_copy_type(self.bias.data, moved):
                    self.bias.data = moved
                else:  # another device's tensor type (as nn.Module._apply does)
                    self.bias = nn.Parameter(moved, requires_grad=self.bias.requires_grad)
        if probe.is_floating_point():
            self.dtype = probe.dtype
        self._cache.clear()
        if self._group is not None:  # let go of the merged tensors on the old device now, not at the next call
            self._group._reset()
        return self

    def __getstate__(self) -> dict[str, Any]:
        # copies and pickles carry the codes, not what was derived from them: a dense copy, torch_npu's repacked
        # weight, the launch plans (bound to this layer's tensors and to compiled kernels, which do not pickle)
        state = super().__getstate__()
        state["_cache"] = {}
        return state

    def extra_repr(self) -> str:
        merged = "" if self._group is None else f", merged={len(self._group.members)}"  # one weight with siblings
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, dtype={self.dtype}{merged}")
