"""torch_npu's fused operators for the simulated NPU, with torch_npu's names, signatures and results.

They compute with ordinary PyTorch ops on the simulated device (so autograd works as with torch_npu, whose fused
operators have backward kernels), and count their calls, so tests can check that a kernel took the fused path.
Contracts, from torch_npu's documentation:

* ``npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)``: normalised over gamma's dims, y in x's dtype, rstd float32
  with those dims kept as 1.
* ``npu_rotary_mul(x, r1, r2) -> x·r1 + rotate_half(x)·r2``, r1/r2 broadcast to x.
* ``npu_swiglu(x, dim=-1) -> silu(a)·b`` where ``a, b = x.chunk(2, dim)``.
* ``npu_gelu(x, approximate="none")``.
* ``npu_fusion_attention(query, key, value, head_num, input_layout, ...)`` -> 7 outputs; see its docstring.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["OPS", "calls", "enabled", "lookup", "only"]

calls: collections.Counter[str] = collections.Counter()


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    calls["npu_rms_norm"] += 1
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + epsilon)
    return (h * rstd * gamma.float()).to(x.dtype), rstd


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    calls["npu_rotary_mul"] += 1
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * r1 + rotated * r2


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    calls["npu_swiglu"] += 1
    a, b = x.chunk(2, dim=dim)
    return (F.silu(a.float()) * b.float()).to(x.dtype)


def npu_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    calls["npu_gelu"] += 1
    return F.gelu(x, approximate=approximate)


OPS: dict[str, Callable[..., Any]] = {
    fn.__name__: fn for fn in (npu_rms_norm, npu_rotary_mul, npu_swiglu, npu_gelu)
}
enabled: set[str] = set(OPS)


def lookup(name: str) -> Callable[..., Any] | None:
    """The operator ``name`` if the simulated software stack has it now."""
    return OPS.get(name) if name in enabled else None


@contextlib.contextmanager
def only(names: Iterable[str]) -> Iterator[None]:
    """Simulate a torch_npu release that has only the operators ``names`` (e.g. ``()`` for none) in a block."""
    names = set(names)
    unknown = names - set(OPS)
    if unknown:
        raise ValueError(f"no simulated fused operator(s) {sorted(unknown)}; simulated: {', '.join(OPS)}")
    saved = set(enabled)
    enabled.clear()
    enabled.update(names)
    try:
        yield
    finally:
        enabled.clear()
        enabled.update(saved)


def npu_cross_entropy_loss(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                           reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                           lse_square_scale_for_zloss: float = 0.0,
                           return_zloss: bool = False) -> tuple[torch.Tensor, ...]:
    """``torch_npu.npu_cross_entropy_loss`` -> ``(loss, log_prob, zloss, lse_for_zloss)``.

    Contract (torch_npu documentation): input ``[N, C]`` fp16/bf16/fp32 with 0 < N <= 200000; target int64 in
    ``[0, C)``; ignore_index < C, a negative one ignoring nothing; loss in input's dtype (``[N]`` for "none", else
    one element); log_prob ``[N, C]``; z-loss documented as not supported yet (its outputs are empty).
    """
    calls["npu_cross_entropy_loss"] += 1
    if input.dim() != 2 or not 0 < input.shape[0] <= 200_000:
        raise RuntimeError(f"npu_cross_entropy_loss: input must be [N, C] with 0 < N <= 200000, got {list(input.shape)}")
    if target.dtype != torch.int64 or target.shape != input.shape[:1]:
        raise RuntimeError("npu_cross_entropy_loss: target must be int64 of shape [N]")
    if ((target < 0) | (target >= input.shape[1])).any():
        raise RuntimeError("npu_cross_entropy_loss: target values must lie in [0, C)")
    if lse_square_scale_for_zloss or return_zloss:
        raise RuntimeError("npu_cross_entropy_loss: z-loss is not supported")
    log_prob = torch.log_softmax(input.float(), dim=-1)
    loss = F.nll_loss(log_prob, target, weight, ignore_index=ignore_index if ignore_index >= 0 else -(2**62),
                      reduction=reduction)
    if label_smoothing:
        smooth = -log_prob.mean(-1)
        if ignore_index >= 0:
            smooth = torch.where(target == ignore_index, torch.zeros_like(smooth), smooth)
        smooth = smooth if reduction == "none" else smooth.sum() if reduction == "sum" else smooth.mean()
        loss = (1 - label_smoothing) * loss + label_smoothing * smooth
    loss = loss.to(input.dtype)
    if reduction != "none":
        loss = loss.reshape(1)
    empty = input.new_empty(0)
    return loss, log_prob.to(input.dtype), empty, empty


OPS[npu_cross_entropy_loss.__name__] = npu_cross_entropy_loss
enabled.add(npu_cross_entropy_loss.__name__)


_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_SIMULATED_SPARSE_MODES = (0, 1, 2, 3)
_COMPRESSED = 2048  # side of the compressed lower-triangular mask that sparse modes 2, 3 and 4 take


def _to_bnsd(t: torch.Tensor, layout: str, heads: int | None, head_dim: int | None) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    seq_first = layout == "SBH"
    b_s_h = t.transpose(0, 1) if seq_first else t  # [B, S, H]
    if heads is None:
        heads = b_s_h.shape[-1] // head_dim
    return b_s_h.reshape(b_s_h.shape[0], b_s_h.shape[1], heads, -1).transpose(1, 2)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t.contiguous()
    if layout == "BSND":
        return t.transpose(1, 2).contiguous()
    b_s_h = t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)
    return (b_s_h.transpose(0, 1) if layout == "SBH" else b_s_h).contiguous()


def npu_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                         input_layout: str, pse: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                         atten_mask: torch.Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0,
                         pre_tockens: int = 2147483647, next_tockens: int = 2147483647, inner_precise: int = 0,
                         prefix: list[int] | None = None, actual_seq_qlen: list[int] | None = None,
                         actual_seq_kvlen: list[int] | None = None, sparse_mode: int = 0,
                         gen_mask_parallel: bool = True, sync: bool = False) -> tuple[Any, ...]:
    """``torch_npu.npu_fusion_attention`` -> ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset,
    numels)``.

    Contract (torch_npu documentation, op-plugin ``torch_npu-npu_fusion_attention.md``, and the vendor's golden
    reference in mindstudio-probe's ``bench_functions/npu_fusion_attention.py``):

    * query, key, value in fp16, bf16 or fp32, one dtype, laid out as ``input_layout``: ``BSH``, ``SBH``, ``BSND``,
      ``BNSD`` (``TND``, the varlen layout, is not simulated). ``head_num`` is the query's head count N1; key and
      value have N2 heads with N1 % N2 == 0 (GQA). Head dims: Dq == Dk >= Dv.
    * ``scores = (query @ keyᵀ + pse) * scale`` (``scale`` defaults to 1, not 1/sqrt(D)); ``atten_mask`` is bool or
      uint8, **True/1 = masked out**, of shape [B, N1, Sq, Skv], [B, 1, Sq, Skv], [1, 1, Sq, Skv] or [Sq, Skv]; the
      golden reference adds -40000 at masked positions (a row masked everywhere therefore attends to every key).
    * ``sparse_mode`` 0 (the mask as given; no mask = full attention), 1 (allMask: the full mask), 2 (leftUpCausal)
      and 3 (rightDownCausal) — modes 2 and 3 take the compressed 2048x2048 mask ``torch.triu(ones, diagonal=1)``
      and build the causal mask aligned top-left (key j masked for query i when j > i) or bottom-right
      (j > i + Skv - Sq). Without a mask, sparse_mode, pre_tockens and next_tockens are ignored. Band and prefix
      modes (4 to 8) are not simulated.
    * ``keep_prob`` < 1 applies dropout to the probabilities.
    * softmax_max / softmax_sum are float32 [B, N1, Sq, 8] (the row max and the sum of exp(score - max), repeated
      8 times); softmax_out is reserved (empty); seed, offset, numels are ints (0 without dropout).
    """
    calls["npu_fusion_attention"] += 1
    if input_layout not in _LAYOUTS:
        raise RuntimeError(f"npu_fusion_attention: input_layout {input_layout!r} is not one of {', '.join(_LAYOUTS)}")
    if input_layout == "TND":
        raise RuntimeError("npu_fusion_attention: the TND (varlen) layout is not simulated by torchport.testing")
    if sparse_mode not in _SIMULATED_SPARSE_MODES:
        raise RuntimeError(f"npu_fusion_attention: sparse_mode={sparse_mode} is not simulated (simulated: "
                           f"{', '.join(map(str, _SIMULATED_SPARSE_MODES))})")
    if padding_mask is not None:
        raise RuntimeError("npu_fusion_attention: padding_mask is not supported (torch_npu documents it as such)")
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (torch.float16, torch.bfloat16,
                                                                             torch.float32):
        raise RuntimeError(f"npu_fusion_attention: query, key and value must share one of float16, bfloat16, "
                           f"float32; got {query.dtype}, {key.dtype}, {value.dtype}")
    if not 0 < keep_prob <= 1:
        raise RuntimeError(f"npu_fusion_attention: keep_prob must lie in (0, 1], got {keep_prob}")
    if input_layout in ("BSH", "SBH"):
        if query.dim() != 3 or query.shape[-1] % head_num:
            raise RuntimeError(f"npu_fusion_attention: {input_layout} query of shape {list(query.shape)} does not "
                               f"split into head_num={head_num} heads")
        head_dim = query.shape[-1] // head_num
        q = _to_bnsd(query, input_layout, head_num, None)
        k = _to_bnsd(key, input_layout, None, head_dim)
        v = _to_bnsd(value, input_layout, k.shape[1], None)
    else:
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise RuntimeError(f"npu_fusion_attention: {input_layout} takes 4-D query, key and value")
        q, k, v = (_to_bnsd(t, input_layout, None, None) for t in (query, key, value))
    batch, heads, s_q, d_q = q.shape
    kv_heads, s_kv, d_k = k.shape[1], k.shape[2], k.shape[3]
    if heads != head_num:
        raise RuntimeError(f"npu_fusion_attention: head_num={head_num} but the query has {heads} heads")
    if k.shape[0] != batch or v.shape[:3] != k.shape[:3]:
        raise RuntimeError(f"npu_fusion_attention: key {list(key.shape)} and value {list(value.shape)} do not match "
                           f"the query {list(query.shape)} in batch, heads or sequence")
    if heads % kv_heads:
        raise RuntimeError(f"npu_fusion_attention: query heads ({heads}) must be a multiple of key/value heads "
                           f"({kv_heads})")
    if d_q != d_k or v.shape[3] > d_k:
        raise RuntimeError(f"npu_fusion_attention: head dims must satisfy Dq == Dk >= Dv; got {d_q}, {d_k}, "
                           f"{v.shape[3]}")

    masked = None
    if atten_mask is not None:
        if atten_mask.dtype not in (torch.bool, torch.uint8):
            raise RuntimeError(f"npu_fusion_attention: atten_mask must be bool or uint8, got {atten_mask.dtype}")
        if sparse_mode in (2, 3):
            expected = torch.triu(torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool), diagonal=1)
            if tuple(atten_mask.shape) != (_COMPRESSED, _COMPRESSED) or not torch.equal(atten_mask.cpu().bool(),
                                                                                        expected):
                raise RuntimeError(f"npu_fusion_attention: sparse_mode={sparse_mode} takes the compressed "
                                   "2048x2048 mask torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1); "
                                   f"got shape {list(atten_mask.shape)}")
            offset = 1 if sparse_mode == 2 else s_kv - s_q + 1
            masked = torch.triu(torch.ones(s_q, s_kv, dtype=torch.bool, device=q.device), diagonal=offset)
        else:
            shape = tuple(atten_mask.shape)
            valid = shape == (s_q, s_kv) or (len(shape) == 4 and shape[2:] == (s_q, s_kv)
                                             and shape[0] in (1, batch) and shape[1] in (1, heads))
            if not valid:
                raise RuntimeError(f"npu_fusion_attention: atten_mask of shape {list(shape)} is none of BNSS, B1SS, "
                                   f"11SS, SS for B={batch}, N={heads}, Sq={s_q}, Skv={s_kv}")
            masked = atten_mask.bool()

    group = heads // kv_heads
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ kf.transpose(-1, -2)
    if pse is not None:
        scores = scores + pse.float()
    scores = scores * scale
    if masked is not None:
        scores = scores - masked.float() * 40000.0
    row_max = scores.amax(dim=-1, keepdim=True)
    exp = torch.exp(scores - row_max)
    row_sum = exp.sum(dim=-1, keepdim=True)
    probs = exp / row_sum
    if keep_prob < 1:
        probs = F.dropout(probs, p=1 - keep_prob)
    out = (probs @ vf).to(query.dtype)
    softmax_max = row_max.detach().expand(batch, heads, s_q, 8).contiguous()
    softmax_sum = row_sum.detach().expand(batch, heads, s_q, 8).contiguous()
    return _from_bnsd(out, input_layout), softmax_max, softmax_sum, query.new_empty(0), 0, 0, 0


OPS[npu_fusion_attention.__name__] = npu_fusion_attention
enabled.add(npu_fusion_attention.__name__)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """``torch_npu.npu_convert_weight_to_int4pack``: int32 ``(k, n)`` with values in [-8, 7] -> int32 ``(k, n / 8)``.

    Contract (torch_npu documentation): 2-D contiguous int32 input, last dimension a multiple of 8, values inside
    int4's range; eight codes per int32. torch_npu's order inside a word is its own; the simulation puts code ``i``
    of a word in bits ``4i..4i+3``, and :func:`npu_weight_quant_batchmatmul` reads it back the same way.
    """
    calls["npu_convert_weight_to_int4pack"] += 1
    if weight.dtype != torch.int32 or weight.dim() != 2 or not weight.is_contiguous():
        raise RuntimeError("npu_convert_weight_to_int4pack: weight must be a contiguous 2-D int32 tensor")
    if weight.shape[-1] % 8:
        raise RuntimeError(f"npu_convert_weight_to_int4pack: the last dimension ({weight.shape[-1]}) must be a "
                           f"multiple of 8")
    if ((weight < -8) | (weight > 7)).any():
        raise RuntimeError("npu_convert_weight_to_int4pack: values must lie in int4's range [-8, 7]")
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
                                 antiquant_group_size: int = 0, inner_precise: int = 0) -> torch.Tensor:
    """``torch_npu.npu_weight_quant_batchmatmul``: ``x @ ((weight + antiquant_offset) * antiquant_scale) + bias``.

    Contract (torch_npu documentation, Atlas A2/A3): x ``(M, K)`` fp16/bf16; weight ``(K, N)`` int8, or int32 ``(K,
    N / 8)`` from :func:`npu_convert_weight_to_int4pack` (transposed views allowed); antiquant_scale in x's dtype,
    ``(N,)`` / ``(1, N)`` per channel or ``(ceil(K / group), N)`` per group with ``antiquant_group_size`` = group;
    antiquant_offset of the same shape and dtype; output in x's dtype. Output quantisation (quant_scale) is not
    simulated.
    """
    calls["npu_weight_quant_batchmatmul"] += 1
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: x must be 2-D fp16/bf16, got {x.dtype} {list(x.shape)}")
    if quant_scale is not None or quant_offset is not None:
        raise RuntimeError("npu_weight_quant_batchmatmul: output quantisation is not simulated")
    if weight.dtype == torch.int8:
        codes = weight.to(torch.int32)
    elif weight.dtype == torch.int32:
        codes = _unpack_int4(weight.contiguous())
    else:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: weight must be int8 or int32 (int4 pack), got {weight.dtype}")
    k, n = codes.shape
    if x.shape[1] != k:
        raise RuntimeError(f"npu_weight_quant_batchmatmul: x has K={x.shape[1]}, weight has K={k}")
    for name, t in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset)):
        if t is not None and t.dtype != x.dtype:
            raise RuntimeError(f"npu_weight_quant_batchmatmul: {name} must have x's dtype {x.dtype}, got {t.dtype}")
    if antiquant_group_size:
        groups = -(-k // antiquant_group_size)
        if antiquant_group_size % 32 or tuple(antiquant_scale.shape) != (groups, n):
            raise RuntimeError(f"npu_weight_quant_batchmatmul: per-group scales must be ({groups}, {n}) with a group "
                               f"size that is a multiple of 32, got {list(antiquant_scale.shape)} and "
                               f"{antiquant_group_size}")
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
        out = out + bias.float()
    return out.to(x.dtype)


for _op in (npu_convert_weight_to_int4pack, npu_weight_quant_batchmatmul):
    OPS[_op.__name__] = _op
    enabled.add(_op.__name__)
