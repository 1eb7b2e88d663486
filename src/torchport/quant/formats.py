"""Weight-only low-bit formats: how a float weight matrix becomes codes plus scales, and back.

Every format stores a linear layer's ``(out_features, in_features)`` weight row by row, with one scale per *group*
of consecutive input features, so that one kernel layout serves them all:

=========  ================================  ==============  =============================  =============  ======
format     codes (``qweight``)               group           scale per group                 w =            bits
=========  ================================  ==============  =============================  =============  ======
``int8``   int8 in [-127, 127]               the whole row   float32, ``amax / 127``         ``q * s``      8.0
``fp8``    float8 e4m3 (finite, ±448)        the whole row   float32, ``amax / 448``         ``q * s``      8.0
``int4``   two per byte, in [-8, 7]          128 (any even   ``s`` and ``offset`` in the     ``(q + o) * s``  4.25
                                             divisor of K)   weight's dtype (asymmetric)
``mxfp4``  two e2m1 codes per byte           32 (fixed)      a power of two, E8M0 (uint8)    ``q * s``      4.25
``nvfp4``  two e2m1 codes per byte           16 (fixed)      float8 e4m3, times one float32  ``q * s * g``  4.5
                                                             scale ``g`` for the tensor
=========  ================================  ==============  =============================  =============  ======

(``fp4`` is another name for ``nvfp4``.) Bits count the codes and the scales per weight, for bf16 scales.

* ``int4`` follows the min/max scheme of tinygemm and torchao's int4 weight-only (15 steps between the group's
  minimum and maximum) and the formula of torch_npu's ``npu_weight_quant_batchmatmul``, ``(q + offset) * scale``,
  so its tensors go to the Ascend operator unchanged.
* ``mxfp4`` is the OCP Microscaling layout: the scale's exponent is ``floor(log2(amax)) - 2`` (2 is e2m1's largest
  exponent), so the block's largest value lands in [4, 8) and is rounded to at most 6.
* ``nvfp4`` is NVIDIA's layout: the tensor scale ``g = amax / (448 * 6)`` maps the largest block scale onto
  e4m3's range; each block's scale is ``amax_block / 6 / g`` rounded to e4m3.
* Packed 4-bit codes: the code of even column ``2j`` in the low nibble of byte ``j``, of ``2j + 1`` in the high one.
* e2m1 codes: bit 3 is the sign, bits 2-1 the exponent, bit 0 the mantissa; the magnitudes are
  0, 0.5, 1, 1.5, 2, 3, 4, 6. Rounding is to nearest, ties to the even code.

Every function here is plain PyTorch on any device; quantising runs in float32 whatever the weight's dtype.

Example:
    >>> fmt = get_format("int4")
    >>> packed = fmt.quantize(weight, 128)
    >>> torch.allclose(fmt.dequantize(packed, weight.dtype), weight, atol=...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from .._registry import Registry

__all__ = ["ALIASES", "FORMATS", "E2M1_VALUES", "Format", "QuantizationError", "canonical_name", "e2m1_decode",
           "e2m1_encode", "get_format", "list_formats", "register_format", "unpack_nibbles", "pack_nibbles"]


class QuantizationError(ValueError):
    """A quantisation request that cannot be honoured; the message names what was asked and what is allowed."""


#: The 8 non-negative e2m1 magnitudes, indexed by the code's low three bits.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP8_MAX = 448.0  # largest finite float8 e4m3fn


@dataclasses.dataclass(frozen=True)
class Format:
    """One weight-only format.

    Attributes:
        name: the format's name (``"int4"``).
        description: one line for tables and error messages.
        code_bits: bits per weight of the codes (8 or 4).
        fixed_group: the group size the format defines (32 for mxfp4), or None.
        default_group: the group size used when none is asked for; None means one group per row.
        quantize: ``quantize(weight, group) -> tensors`` for a 2-D float weight and a group size that divides its
            columns; returns ``qweight``, ``scale`` and, for some formats, ``offset`` / ``global_scale``.
        dequantize: ``dequantize(tensors, dtype) -> weight`` in ``dtype``.
    """

    name: str
    description: str
    code_bits: int
    fixed_group: int | None
    default_group: int | None
    quantize: Callable[[torch.Tensor, int], dict[str, torch.Tensor]]
    dequantize: Callable[[Mapping[str, torch.Tensor], torch.dtype], torch.Tensor]

    def group_size(self, requested: int | None, in_features: int) -> int:
        """The group size to use for a layer with ``in_features`` columns, or :class:`QuantizationError`."""
        if self.fixed_group is not None:
            if requested not in (None, self.fixed_group):
                raise QuantizationError(
                    f"format {self.name!r} has a fixed group size of {self.fixed_group}; got group_size={requested}"
                )
            group = self.fixed_group
        elif requested is None:
            group = _default_group(self.default_group, in_features)
        else:
            if not isinstance(requested, int) or isinstance(requested, bool) or requested <= 0:
                raise QuantizationError(f"group_size must be a positive integer or None; got {requested!r}")
            group = requested
        if self.default_group is None and self.fixed_group is None and group != in_features:
            raise QuantizationError(
                f"format {self.name!r} uses one scale per output channel (group_size=None); got group_size={group}"
            )
        if in_features % group:
            raise QuantizationError(
                f"group size {group} of format {self.name!r} does not divide in_features={in_features}; "
                f"choose a divisor of {in_features}" + ("" if self.fixed_group is None else " or another format")
            )
        if self.code_bits == 4 and group % 2:
            raise QuantizationError(f"4-bit format {self.name!r} packs two codes per byte: the group size must be "
                                    f"even; got {group}")
        return group

    def bits_per_weight(self, group: int, scale_bytes: int = 2) -> float:
        """Stored bits per weight: the codes plus the scales of one group (``scale_bytes`` each)."""
        per_group = {"int4": 2 * scale_bytes, "mxfp4": 1, "nvfp4": 1}.get(self.name, 4)
        return self.code_bits + 8 * per_group / group


def _default_group(default: int | None, in_features: int) -> int:
    """``default`` where it divides ``in_features``; else the largest even divisor between 32 and ``default``;
    else one group per row (a layer of 200 inputs gets groups of 100, one of 64 a single group)."""
    if default is None or in_features % default == 0:
        return default or in_features
    for group in range(min(default, in_features), 31, -1):
        if in_features % group == 0 and group % 2 == 0:
            return group
    return in_features


FORMATS: Registry[Format] = Registry("quantisation format")
ALIASES = {"fp4": "nvfp4"}


def register_format(fmt: Format) -> Format:
    """Add ``fmt`` to the formats ``torchport.quantize`` accepts; a second format of the same name is refused."""
    if fmt.name in FORMATS or fmt.name in ALIASES:
        raise ValueError(f"a quantisation format named {fmt.name!r} already exists; registered: "
                         f"{', '.join(list_formats())}")
    return FORMATS.register(fmt.name, fmt)


def list_formats() -> list[str]:
    """The format names ``torchport.quantize`` accepts, aliases included.

    Example:
        >>> list_formats()
        ['int8', 'fp8', 'int4', 'mxfp4', 'nvfp4', 'fp4']
    """
    return [*FORMATS, *ALIASES]


def canonical_name(name: str) -> str:
    """``name`` with aliases resolved (``"fp4"`` -> ``"nvfp4"``), or :class:`QuantizationError` listing the formats."""
    if not isinstance(name, str) or ALIASES.get(name, name) not in FORMATS:
        raise QuantizationError(f"unknown quantisation format {name!r}; valid: {', '.join(list_formats())}")
    return ALIASES.get(name, name)


def get_format(name: str) -> Format:
    """The :class:`Format` called ``name`` (aliases allowed).

    Example:
        >>> get_format("fp4").name
        'nvfp4'
    """
    return FORMATS.get(canonical_name(name))


# -- helpers shared by the formats ----------------------------------------------------------------------------------
def _groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    """``weight`` in float32 as ``(rows, groups, group)``."""
    rows, cols = weight.shape
    return weight.float().reshape(rows, cols // group, group)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 in [0, 15], even last dimension) -> bytes, column ``2j`` in the low nibble of byte ``j``."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: bytes -> uint8 codes in [0, 15], twice as many columns."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float values (already scaled into e2m1's range) -> e2m1 codes (uint8), nearest, ties to the even code."""
    magnitude = x.abs().clamp(max=6.0)
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=magnitude.dtype, device=magnitude.device)
    code = torch.bucketize(magnitude, midpoints)  # a value on a midpoint goes to the lower code...
    on_midpoint_of_odd = (code % 2 == 1) & (code < 7) & (magnitude == midpoints[code.clamp(max=6)])
    code = code + on_midpoint_of_odd.to(code.dtype)  # ...unless that code is odd: ties go to the even one
    sign = (x < 0) & (code > 0)  # no negative zero
    return (code | (sign.to(code.dtype) << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e2m1 codes (uint8 in [0, 15]) -> their values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=codes.device)
    return table[codes.long()]


# -- int8: symmetric, one scale per output channel ------------------------------------------------------------------
def _int8_quantize(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    w = _groups(weight, group)
    scale = w.abs().amax(dim=-1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return {"qweight": q.reshape(weight.shape), "scale": scale.reshape(weight.shape[0], -1)}


def _scaled_dequantize(t: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    q, scale = t["qweight"], t["scale"]
    rows, groups = scale.shape
    w = q.float().reshape(rows, groups, -1) * scale.float().unsqueeze(-1)
    return w.reshape(q.shape).to(dtype)


# -- fp8: e4m3, one scale per output channel ------------------------------------------------------------------------
def _fp8_quantize(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    w = _groups(weight, group)
    scale = w.abs().amax(dim=-1, keepdim=True) / _FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return {"qweight": q.reshape(weight.shape), "scale": scale.reshape(weight.shape[0], -1)}


# -- int4: asymmetric min/max per group -----------------------------------------------------------------------------
def _int4_quantize(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    w = _groups(weight, group)
    low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scale = (high - low) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # Scales and offsets are stored in the weight's dtype (what the matmul computes in); the codes are chosen
    # against the stored values, so rounding them does not bias the result.
    store = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float32
    scale = scale.to(store).float()
    offset = (low / scale + 8.0).to(store).float()  # q = -8 maps to the group's minimum
    q = torch.round(w / scale - offset).clamp_(-8, 7)
    codes = (q + 8).to(torch.uint8).reshape(weight.shape)
    rows = weight.shape[0]
    return {"qweight": pack_nibbles(codes), "scale": scale.reshape(rows, -1).to(store),
            "offset": offset.reshape(rows, -1).to(store)}


def _int4_dequantize(t: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_nibbles(t["qweight"]).float() - 8.0
    scale, offset = t["scale"].float(), t["offset"].float()
    rows, groups = scale.shape
    w = (codes.reshape(rows, groups, -1) + offset.unsqueeze(-1)) * scale.unsqueeze(-1)
    return w.reshape(codes.shape).to(dtype)


# -- mxfp4: e2m1 codes, power-of-two scale per 32 -------------------------------------------------------------------
def _mxfp4_quantize(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    w = _groups(weight, group)
    amax = w.abs().amax(dim=-1, keepdim=True)
    exponent = torch.floor(torch.log2(amax)) - 2.0  # e2m1's largest exponent is 2
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -127.0)).clamp_(-127, 127)
    codes = e2m1_encode(w / torch.exp2(exponent)).reshape(weight.shape)
    biased = (exponent + 127).to(torch.uint8).reshape(weight.shape[0], -1)
    return {"qweight": pack_nibbles(codes), "scale": biased}


def _mxfp4_dequantize(t: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    values = e2m1_decode(unpack_nibbles(t["qweight"]))
    scale = torch.exp2(t["scale"].float() - 127.0)
    rows, groups = scale.shape
    return (values.reshape(rows, groups, -1) * scale.unsqueeze(-1)).reshape(values.shape).to(dtype)


# -- nvfp4: e2m1 codes, e4m3 scale per 16, float32 scale per tensor -------------------------------------------------
def _nvfp4_quantize(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    w = _groups(weight, group)
    amax = w.abs().amax()
    global_scale = amax / (_FP8_MAX * 6.0) if amax > 0 else torch.ones((), device=w.device)
    block = (w.abs().amax(dim=-1, keepdim=True) / 6.0 / global_scale).clamp_(max=_FP8_MAX)
    block = block.to(torch.float8_e4m3fn)
    effective = block.float() * global_scale
    effective = torch.where(effective > 0, effective, torch.ones_like(effective))  # all-zero block: codes are 0
    codes = e2m1_encode(w / effective).reshape(weight.shape)
    return {"qweight": pack_nibbles(codes), "scale": block.reshape(weight.shape[0], -1),
            "global_scale": global_scale.float().reshape(())}


def _nvfp4_dequantize(t: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    values = e2m1_decode(unpack_nibbles(t["qweight"]))
    scale = t["scale"].float() * t["global_scale"].float()
    rows, groups = scale.shape
    return (values.reshape(rows, groups, -1) * scale.unsqueeze(-1)).reshape(values.shape).to(dtype)


register_format(Format("int8", "int8 codes, symmetric, one float32 scale per output channel", 8, None, None,
                       _int8_quantize, _scaled_dequantize))
register_format(Format("fp8", "float8 e4m3 codes, one float32 scale per output channel", 8, None, None,
                       _fp8_quantize, _scaled_dequantize))
register_format(Format("int4", "int4 codes, asymmetric (scale and offset) per group of 128", 4, None, 128,
                       _int4_quantize, _int4_dequantize))
register_format(Format("mxfp4", "e2m1 codes, power-of-two (E8M0) scale per block of 32 (OCP MX)", 4, 32, 32,
                       _mxfp4_quantize, _mxfp4_dequantize))
register_format(Format("nvfp4", "e2m1 codes, float8 e4m3 scale per block of 16 and a float32 tensor scale", 4, 16,
                       16, _nvfp4_quantize, _nvfp4_dequantize))
