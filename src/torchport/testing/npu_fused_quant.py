"""torch_npu's low-bit weight operators on the simulated NPU: int4 packing and the weight-quantised matmul."""

from __future__ import annotations

import torch

from .npu_fused_contract import chip_family, dtype_name, start, without_backward

__all__ = ["npu_convert_weight_to_int4pack", "npu_weight_quant_batchmatmul"]


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """``torch_npu.npu_convert_weight_to_int4pack``: int32 ``(k, n)`` with values in [-8, 7] -> int32 ``(k, n / 8)``.

    Contract (torch_npu documentation): 2-D contiguous int32 input, last dimension a multiple of 8, values inside
    int4's range; eight codes per int32. torch_npu's order inside a word is its own; the simulation puts code ``i``
    of a word in bits ``4i..4i+3``, and :func:`npu_weight_quant_batchmatmul` reads it back the same way.
    """
    limits = start("npu_convert_weight_to_int4pack")
    if weight.dtype != torch.int32 or weight.dim() != limits["dims"] or not weight.is_contiguous():
        raise RuntimeError("npu_convert_weight_to_int4pack: weight must be a contiguous 2-D int32 tensor")
    if weight.shape[-1] % limits["last_dim_multiple"]:
        raise RuntimeError(f"npu_convert_weight_to_int4pack: the last dimension ({weight.shape[-1]}) must be a "
                           f"multiple of {limits['last_dim_multiple']}")
    low, high = limits["value_range"]
    if ((weight < low) | (weight > high)).any():
        raise RuntimeError(f"npu_convert_weight_to_int4pack: values must lie in int4's range [{low}, {high}]")
    nibbles = (weight & 0xF).to(torch.int64).reshape(*weight.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, device=weight.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_int4(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).reshape(*words.shape[:-1], -1)


def npu_weight_quant_batchmatmul(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                                 antiquant_offset: torch.Tensor | None = None, quant_scale: torch.Tensor | None = None,
                                 quant_offset: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                                 antiquant_group_size: int = 0, inner_precise: int = 0,
                                 weight_dtype: int | None = None) -> torch.Tensor:
    """``torch_npu.npu_weight_quant_batchmatmul``: ``x @ ((weight + antiquant_offset) * antiquant_scale) + bias``.

    Contract (torch_npu documentation): x ``(M, K)`` fp16/bf16 (fp16 only on 310P); weight ``(K, N)`` int8, or
    int32 ``(K, N / 8)`` from :func:`npu_convert_weight_to_int4pack` (not on 310P; transposed views allowed); K and
    N within [1, 65535]; antiquant_scale in x's dtype, ``(N,)`` / ``(1, N)`` per channel or ``(ceil(K / group), N)``
    per group, with ``antiquant_group_size`` 0 (no groups) or a multiple of 32 within [32, K - 1]; antiquant_offset
    of the same shape and dtype; output in x's dtype; no backward. Output quantisation (quant_scale) and
    weight_dtype are not simulated.
    """
    limits = start("npu_weight_quant_batchmatmul")
    family = chip_family()
    x_dtypes, weight_dtypes = limits["x_dtypes"][family], limits["weight_dtypes"][family]
    if dtype_name(x) not in x_dtypes or x.dim() != limits["x_dims"]:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: x must be 2-D {'/'.join(x_dtypes)} on {family}, got "
                           f"{x.dtype} {list(x.shape)}")
    if quant_scale is not None or quant_offset is not None or weight_dtype is not None:
        raise RuntimeError("npu_weight_quant_batchmatmul: output quantisation and weight_dtype are not simulated")
    if dtype_name(weight) not in weight_dtypes:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: weight must be {' or '.join(weight_dtypes)} on {family} "
                           f"(int32 holds packed int4), got {weight.dtype}")
    codes = weight.to(torch.int32) if weight.dtype == torch.int8 else _unpack_int4(weight.contiguous())
    k, n = codes.shape
    if x.shape[1] != k:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: x has K={x.shape[1]}, weight has K={k}")
    low, high = limits["k_n_range"]
    if not (low <= k <= high and low <= n <= high) or x.shape[0] == 0:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: K and N must lie in [{low}, {high}] and x must not be "
                           f"empty; got M={x.shape[0]}, K={k}, N={n}")
    if antiquant_group_size and not (limits["group_size_min"] <= antiquant_group_size <= k - 1
                                     and antiquant_group_size % limits["group_size_multiple"] == 0):
        raise RuntimeError(f"npu_weight_quant_batchmatmul: antiquant_group_size must be 0 or a multiple of "
                           f"{limits['group_size_multiple']} within [{limits['group_size_min']}, K - 1 = {k - 1}], "
                           f"got {antiquant_group_size}")
    for name, t in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset)):
        if t is not None and t.dtype != x.dtype:
            raise RuntimeError(f"npu_weight_quant_batchmatmul: {name} must have x's dtype {x.dtype}, got {t.dtype}")
    if antiquant_group_size:
        groups = -(-k // antiquant_group_size)
        if tuple(antiquant_scale.shape) != (groups, n):
            raise RuntimeError(f"npu_weight_quant_batchmatmul: per-group scales must be ({groups}, {n}), got "
                               f"{list(antiquant_scale.shape)}")
        expand = lambda t: t.float().repeat_interleave(antiquant_group_size, dim=0)[:k]  # noqa: E731
    else:
        if antiquant_scale.numel() not in (1, n):
            raise RuntimeError(f"npu_weight_quant_batchmatmul: per-channel scales must have {n} elements")
        expand = lambda t: t.float().reshape(1, -1)  # noqa: E731
    w = codes.float()
    if antiquant_offset is not None:
        w = w + expand(antiquant_offset)
    w = w * expand(antiquant_scale)
    out = x.float() @ w
    if bias is not None:
        wanted = limits["bias_dtype"][dtype_name(x)]
        if dtype_name(bias) != wanted:
            raise RuntimeError(f"npu_weight_quant_batchmatmul: bias must be {wanted} for {x.dtype} x, got {bias.dtype}")
        out = out + bias.float()
    return without_backward("npu_weight_quant_batchmatmul", out.to(x.dtype),
                             (x, antiquant_scale, antiquant_offset, bias))
