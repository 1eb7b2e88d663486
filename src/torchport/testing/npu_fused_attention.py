"""``torch_npu.npu_fusion_attention`` on the simulated NPU, in the layouts BSH, SBH, BSND and BNSD."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .npu_fused_contract import start

__all__ = ["npu_fusion_attention"]

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
                         gen_mask_parallel: bool = True, sync: bool = False, softmax_layout: str = "",
                         sink: torch.Tensor | None = None, dropout_mask: torch.Tensor | None = None, seed: int = 0,
                         offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int,
                                                   int]:
    """``torch_npu.npu_fusion_attention`` -> ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset,
    numels)``.

    Contract (torch_npu documentation, op-plugin ``torch_npu-npu_fusion_attention.md``, and the vendor's golden
    reference in mindstudio-probe's ``bench_functions/npu_fusion_attention.py``):

    * query, key, value in fp16, bf16 or fp32, one dtype, laid out as ``input_layout``: ``BSH``, ``SBH``, ``BSND``,
      ``BNSD`` (``TND``, the varlen layout, is not simulated). ``head_num`` is the query's head count N1; key and
      value have N2 heads with N1 % N2 == 0 (GQA), 1 <= N1 <= 256. Key and value have one shape (so Dv == Dk; the
      documentation's "Dk >= Dv" contradicts its own "key and value must have the same shape", which the
      simulation follows), and 1 <= D <= 768.
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
    * the arguments added by later releases (softmax_layout for TND, sink, dropout_mask, seed, offset) are taken at
      their defaults only.

    torch_npu documents it for training, and not for graph mode or aclgraph capture; the simulation cannot tell a
    graph from eager execution, so callers must avoid those themselves.
    """
    limits = start("npu_fusion_attention")
    if softmax_layout or sink is not None or dropout_mask is not None or seed or offset:
        raise RuntimeError("npu_fusion_attention: softmax_layout, sink, dropout_mask, seed and offset are simulated "
                           "at their defaults only")
    if input_layout not in limits["layouts"]:
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
    if key.shape != value.shape:
        raise RuntimeError(f"npu_fusion_attention: key {list(key.shape)} and value {list(value.shape)} must have the "
                           "same shape")
    if k.shape[0] != batch:
        raise RuntimeError(f"npu_fusion_attention: key {list(key.shape)} does not match the query "
                           f"{list(query.shape)} in batch")
    if heads % kv_heads:
        raise RuntimeError(f"npu_fusion_attention: query heads ({heads}) must be a multiple of key/value heads "
                           f"({kv_heads})")
    low_n, high_n = limits["query_heads"]
    low_d, high_d = limits["head_dim"]
    if not low_n <= heads <= high_n:
        raise RuntimeError(f"npu_fusion_attention: the query has {heads} heads; allowed: {low_n} to {high_n}")
    if d_q != d_k or not low_d <= d_k <= high_d:
        raise RuntimeError(f"npu_fusion_attention: query and key head dims must be equal and within {low_d} to "
                           f"{high_d}; got {d_q} and {d_k}")

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
